"""The trained model written as a Hugging Face folder by rank 0, gathered one parameter at a time under ZeRO-3.

No rank ever holds the whole model: each parameter is gathered (collectively, every rank takes part), rank 0 copies
it into the safetensors file it is filling, and a file is written once it would pass `shard_bytes`. So rank 0
holds its shard, one gathered parameter and one file's worth; the other ranks their shard and one gathered
parameter. The folder (`model.safetensors`, or `model-0000k-of-0000N.safetensors` with their index) is what
`save_pretrained` writes and `from_pretrained` reads. A PEFT model (LoRA) writes its adapters only, as its own
`save_pretrained` does, so only they are gathered. The folder is built beside the target and swapped in.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from ds_cluster.fileio import replace_dir, staging_dir

logger = logging.getLogger(__name__)

SHARD_BYTES = 512 << 20  # one safetensors file; writing it takes about as much again (its bytes are serialised)
WEIGHTS_NAME, INDEX_NAME = "model.safetensors", "model.safetensors.index.json"


def _gathered(tensor: torch.Tensor) -> Any:
    """The parameter whole for the block (collective under ZeRO-3), or the tensor as it is."""
    if hasattr(tensor, "ds_id"):
        import deepspeed

        return deepspeed.zero.GatheredParameters([tensor], modifier_rank=None)
    return contextlib.nullcontext()


def _state_entries(module: torch.nn.Module, names: Optional[set[int]] = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the module's state dict, each tensor once (a tied weight under its first name); with
    `names`, only tensors whose id is in it."""
    seen: set[int] = set()
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) in seen or (names is not None and id(tensor) not in names):
            continue
        seen.add(id(tensor))
        yield name, tensor


def _cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy, inside the gather (outside it a ZeRO-3 parameter is an empty placeholder)."""
    return tensor.detach().to("cpu", copy=True).contiguous()


def save_gathered_model(module: torch.nn.Module, tokenizer: Any, folder: Path, rank: int,
                        shard_bytes: int = SHARD_BYTES) -> None:
    """Collective: write `module` (a transformers model, or a PEFT model's adapters) and `tokenizer` to `folder` on
    rank 0, every rank taking part in each parameter's gather."""
    folder = Path(folder)
    staging = staging_dir(folder) if rank == 0 else None
    if hasattr(module, "peft_config"):
        _save_adapters(module, staging)
    else:
        _save_weights(module, staging, shard_bytes)
    if staging is not None:
        tokenizer.save_pretrained(staging)
        for path in staging.iterdir():  # replace_dir wants every file on disk first
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
        replace_dir(staging, folder)
        logger.info("model saved to %s", folder)


def _save_adapters(module: Any, staging: Optional[Path]) -> None:
    """A PEFT model's adapters (what its save_pretrained keeps), gathered; the others are never gathered."""
    from peft.utils import get_peft_model_state_dict

    kept = get_peft_model_state_dict(module, state_dict=module.state_dict(keep_vars=True))
    adapters = {id(tensor) for tensor in kept.values()}
    state = {}
    for name, tensor in _state_entries(module, adapters):
        with _gathered(tensor):
            if staging is not None:
                state[name] = _cpu_copy(tensor)
    if staging is not None:
        module.save_pretrained(staging, state_dict=state)


def _save_weights(module: torch.nn.Module, staging: Optional[Path], shard_bytes: int) -> None:
    """Every weight, one parameter gathered at a time, into safetensors files of at most `shard_bytes` (or one
    tensor), then their index, the config and the generation config (rank 0 writes)."""
    from safetensors.torch import save_file

    files: list[dict[str, torch.Tensor]] = []
    current: dict[str, torch.Tensor] = {}
    current_bytes, total = 0, 0

    def flush() -> None:
        nonlocal current, current_bytes
        if current and staging is not None:
            save_file(current, str(staging / f"part-{len(files):05d}.safetensors"), metadata={"format": "pt"})
            files.append({name: tensor[:0] for name, tensor in current.items()})  # names and dtypes only
        current, current_bytes = {}, 0

    for name, tensor in _state_entries(module):
        with _gathered(tensor):
            if staging is None:
                continue
            size = tensor.numel() * tensor.element_size()
            if current and current_bytes + size > shard_bytes:
                flush()
            current[name] = _cpu_copy(tensor)
            current_bytes, total = current_bytes + size, total + size
    flush()
    if staging is not None:
        _name_files(staging, files, total)
        config = getattr(module, "config", None)
        if config is not None:
            config.architectures = [type(module).__name__]
            config.save_pretrained(staging)
        generation = getattr(module, "generation_config", None)
        if generation is not None and getattr(module, "can_generate", lambda: False)():
            generation.save_pretrained(staging)


def _name_files(staging: Path, files: list[dict[str, torch.Tensor]], total: int) -> None:
    """The files as save_pretrained names them: one `model.safetensors`, or `model-0000k-of-0000N.safetensors` and
    the index naming each weight's file."""
    if len(files) == 1:
        (staging / "part-00000.safetensors").rename(staging / WEIGHTS_NAME)
        return
    weight_map = {}
    for number, names in enumerate(files, start=1):
        name = f"model-{number:05d}-of-{len(files):05d}.safetensors"
        (staging / f"part-{number - 1:05d}.safetensors").rename(staging / name)
        weight_map.update({weight: name for weight in names})
    (staging / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                 indent=2, sort_keys=True) + "\n")
