"""Loading a Hugging Face causal LM and its tokenizer from a local folder, for any ZeRO stage."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Union

import torch

from ds_cluster.data.special_tokens import ensure_pad_token


def is_zero3(ds_config: Optional[dict]) -> bool:
    return bool(ds_config) and int((ds_config.get("zero_optimization") or {}).get("stage", 0)) == 3


def load_tokenizer(path: Union[str, os.PathLike], rank: Optional[int] = None) -> Any:
    """A checkpoint folder's tokenizer, with a pad token (``ensure_pad_token``: its eos, else its unk; one log line
    on rank 0, ``rank`` else the ``RANK`` variable)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(_checkpoint_folder(path), local_files_only=True)
    ensure_pad_token(tokenizer, rank)
    return tokenizer


def load_model(path: Union[str, os.PathLike], ds_config: Optional[dict] = None, dtype: torch.dtype = torch.float32,
               pad_token_id: Optional[int] = None) -> Any:
    """A causal LM from a local checkpoint folder, partitioned under ZeRO stage 3 (see `load_model_and_tokenizer`);
    its ``generation_config.pad_token_id`` is set to `pad_token_id` when it has none."""
    from transformers import AutoModelForCausalLM

    folder = _checkpoint_folder(path)
    hf_ds_config = None
    if is_zero3(ds_config):
        from transformers.integrations import HfDeepSpeedConfig

        hf_ds_config = HfDeepSpeedConfig(ds_config)
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=dtype)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None and generation_config.pad_token_id is None and pad_token_id is not None:
        generation_config.pad_token_id = pad_token_id
    if hf_ds_config is not None:
        model._hf_ds_config_ref = hf_ds_config
    return model


def load_model_and_tokenizer(path: Union[str, os.PathLike], ds_config: Optional[dict] = None,
                             dtype: torch.dtype = torch.float32, rank: Optional[int] = None) -> tuple[Any, Any]:
    """A causal LM and its tokenizer from a local checkpoint folder (nothing is downloaded).

    A tokenizer without a pad token (Llama's, Mistral's, GPT-2's) pads with its eos token, else its unk
    token (``ensure_pad_token``; one log line on rank 0, ``rank`` else the ``RANK`` variable). The model's
    ``generation_config.pad_token_id`` is set to match when it has none, so ``generate`` pads the same way.

    Under ZeRO stage 3 the model is built partitioned through transformers'
    own path; the ``HfDeepSpeedConfig`` that switches this on must outlive the
    model (transformers keeps only a weak reference), so it is kept as
    ``model._hf_ds_config_ref``.
    """
    folder = _checkpoint_folder(path)
    tokenizer = load_tokenizer(folder, rank)
    return load_model(folder, ds_config, dtype, tokenizer.pad_token_id), tokenizer


def _checkpoint_folder(path: Union[str, os.PathLike]) -> Path:
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"model {os.fspath(path)!r} is not a local checkpoint folder (with config.json and "
                                "weights, as written by save_pretrained)")
    return folder
