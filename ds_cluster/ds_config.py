"""Reading a DeepSpeed config the way DeepSpeed does, and finding it in a `deepspeed.initialize` call.

DeepSpeed accepts a dict, a path to a JSON or HJSON file (read with hjson,
duplicate keys rejected), or a base64-encoded JSON string, passed as
`config`, `config_params` or `args.deepspeed_config`. The hook reads configs
the same way, so a config DeepSpeed accepts is never refused here.
"""
from __future__ import annotations

import base64
import binascii
import collections
import os
from typing import Any, Mapping, Optional, Union

ConfigSource = Union[Mapping[str, Any], str, os.PathLike]

BLOCK_PATH = ("data_efficiency", "data_sampling", "cluster_sampling")


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    # DeepSpeed's rule: a key given twice in one object is an error, not "the last one wins".
    result = dict(pairs)
    if len(result) != len(pairs):
        repeated = [key for key, count in collections.Counter(key for key, _ in pairs).items() if count > 1]
        raise ValueError(f"duplicate keys in the DeepSpeed config: {repeated}")
    return result


def read_ds_config(config: ConfigSource) -> tuple[dict, str]:
    """A DeepSpeed config as a dict, and a name for it in messages.

    Raises FileNotFoundError for a path that does not exist (and is not
    base64), ValueError for a file or string that is not valid JSON/HJSON or
    not an object.
    """
    import hjson

    if isinstance(config, Mapping):
        return dict(config), "config"
    if not isinstance(config, (str, os.PathLike)):
        raise ValueError(f"a DeepSpeed config is a dict, a path or a base64 string, got {type(config).__name__}")
    path = os.fspath(config)
    if os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as handle:
                loaded = hjson.load(handle, object_pairs_hook=_reject_duplicate_keys)
        except hjson.HjsonDecodeError as err:
            raise ValueError(f"{path}: not valid JSON or HJSON ({err.msg} at line {err.lineno}, "
                             f"column {err.colno})") from None
        source = path
    else:
        try:
            decoded = base64.urlsafe_b64decode(path).decode("utf-8")
            loaded = hjson.loads(decoded, object_pairs_hook=_reject_duplicate_keys)
        except (binascii.Error, UnicodeDecodeError, ValueError):
            raise FileNotFoundError(f"DeepSpeed config file not found: {path}") from None
        source = "base64 config"
    if not isinstance(loaded, Mapping):
        raise ValueError(f"{source}: a DeepSpeed config must be a JSON object")
    return _plain(loaded), source


def _plain(value: Any) -> Any:
    # hjson builds OrderedDicts; the rest of the code (and the fingerprints) want plain dicts.
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    return value


def cluster_block(config_dict: Mapping[str, Any]) -> Optional[Any]:
    """The `cluster_sampling` block of a config, or None when it has none."""
    block: Any = config_dict
    for key in BLOCK_PATH:
        if not isinstance(block, Mapping) or key not in block:
            return None
        block = block[key]
    return block


def config_in_call(arguments: Mapping[str, Any]) -> Optional[Any]:
    """The config a `deepspeed.initialize` call passes, by DeepSpeed's rules; None when there is none.

    `arguments` are the call's bound arguments. `config` wins over
    `config_params`; `args.deepspeed_config` (or the older
    `args.deepscale_config`) is used when neither is given. Two configs at
    once is ambiguous: None, and DeepSpeed raises its own error.
    """
    config = arguments.get("config")
    if config is None:
        config = arguments.get("config_params")
    args = arguments.get("args")
    from_args = None
    for name in ("deepspeed_config", "deepscale_config"):
        if getattr(args, name, None) is not None:
            from_args = getattr(args, name)
            break
    if from_args is not None:
        return None if config is not None else from_args
    return config


# Parts of a training config a forward-only engine must not build (optimizer states,
# a scheduler, the data-efficiency sampler that ds_cluster itself provides).
_TRAINING_ONLY_KEYS = ("optimizer", "scheduler", "data_efficiency")


def forward_only_config(ds_config: Mapping[str, Any]) -> dict:
    """A copy of the DeepSpeed config for an engine that only runs forward passes.

    ZeRO stages 1 and 2 shard optimizer states and gradients, not parameters,
    and DeepSpeed refuses them without an optimizer: their forward is stage 0's.
    Stage 3 (sharded parameters) is kept.
    """
    config = {key: value for key, value in ds_config.items() if key not in _TRAINING_ONLY_KEYS}
    zero = dict(config.get("zero_optimization") or {})
    if int(zero.get("stage", 0)) in (1, 2):
        config["zero_optimization"] = {**zero, "stage": 0}
    return config
