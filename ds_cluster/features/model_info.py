"""What extraction needs to know of a model: where its output layer is, and a fingerprint of its weights."""
from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from ds_cluster.collectives import LOCAL, Collectives

# Config keys that name where or how a model was loaded, not what it computes.
_VOLATILE_CONFIG_KEYS = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "_attn_implementation",
                         "_attn_implementation_autoset", "_commit_hash", "use_cache", "output_hidden_states",
                         "return_dict", "architectures"}
_CHECKSUM_MODULUS = (1 << 61) - 1
_CHECKSUM_CHUNK = 1 << 22  # values summed at a time


# --------------------------------------------------------------------------- model access
def unwrap_model(engine: Any) -> torch.nn.Module:
    """The model inside a DeepSpeed engine (or the model itself)."""
    return getattr(engine, "module", engine)


def find_output_layer(model: torch.nn.Module) -> torch.nn.Module:
    """The layer that maps the last hidden state to the logits."""
    layer = None
    getter = getattr(model, "get_output_embeddings", None)
    if callable(getter):
        layer = getter()
    if layer is None:
        layer = getattr(model, "lm_head", None)
    if layer is None or getattr(layer, "weight", None) is None:
        raise ValueError(
            f"{type(model).__name__} has no output layer to compute gradient features for: looked for "
            "model.get_output_embeddings() (returned None or is missing) and a `lm_head` attribute. "
            "Use a causal language model with an output (lm_head) layer."
        )
    return layer


def output_layer_shape(layer: torch.nn.Module) -> tuple[int, int]:
    """(vocab V, hidden H) of the output matrix, also when ZeRO-3 has partitioned it."""
    weight = layer.weight
    shape = tuple(getattr(weight, "ds_shape", weight.shape))
    if len(shape) != 2:
        raise ValueError(f"output layer weight has shape {shape}, expected (vocab, hidden)")
    return int(shape[0]), int(shape[1])


# --------------------------------------------------------------------------- fingerprints
def _parameter_checksum(param: torch.Tensor) -> int:
    """Sum of the float bit patterns of this rank's part of a parameter (exact, so it adds up across ZeRO-3 shards)."""
    partition = getattr(param, "ds_tensor", None)
    if partition is not None:
        # ZeRO-3: this rank holds elements [rank * size, rank * size + size) of the flat
        # parameter; the tail of the last partition is uninitialised padding.
        import torch.distributed as dist

        size = partition.ds_numel if hasattr(partition, "ds_numel") else partition.numel()
        group = getattr(param, "ds_process_group", None)
        rank = dist.get_rank(group=group) if dist.is_initialized() else 0
        valid = max(0, min(size, param.ds_numel - rank * size))
        values = partition.detach().reshape(-1)[:valid]
    else:
        values = param.detach().reshape(-1)
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[values.element_size()]
    values = values.contiguous().view(bits)
    # A chunk at a time, where the values are: an int64 copy of a whole partition would be 4 times a bf16 one.
    total = 0
    for start in range(0, values.numel(), _CHECKSUM_CHUNK):
        total += int(values[start:start + _CHECKSUM_CHUNK].to(torch.int64).sum().item())
    return total % _CHECKSUM_MODULUS


def model_fingerprint(engine: Any, collectives: Collectives = LOCAL) -> str:
    """Hash of the model config, parameter names/shapes/dtypes and an exact checksum of every parameter's values.

    Identical across ZeRO stages and world sizes for the same weights: under
    ZeRO-3 each rank sums the bit patterns of its own partition and the sums
    are added across ranks (`collectives`), so no parameter is gathered.
    Collective: call on every rank.
    """
    model = unwrap_model(engine)
    config = getattr(model, "config", None)
    config_dict = config.to_dict() if hasattr(config, "to_dict") else {}
    config_dict = {key: value for key, value in config_dict.items() if key not in _VOLATILE_CONFIG_KEYS}
    names, checksums = [], []
    for name, param in model.named_parameters():
        shape = tuple(getattr(param, "ds_shape", param.shape))
        names.append(f"{name}:{shape}:{param.dtype}")
        checksums.append(_parameter_checksum(param))
    partitioned = any(hasattr(param, "ds_tensor") for param in model.parameters())
    if partitioned:
        per_rank = collectives.gather(checksums)
        checksums = [sum(column) % _CHECKSUM_MODULUS for column in zip(*per_rank)]
    digest = hashlib.sha256()
    digest.update(type(model).__name__.encode())
    digest.update(json.dumps(config_dict, sort_keys=True, default=str).encode())
    digest.update(json.dumps(names).encode())
    digest.update(json.dumps(checksums).encode())
    return digest.hexdigest()
