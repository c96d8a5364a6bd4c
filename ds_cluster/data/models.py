"""Loading a Hugging Face causal LM and its tokenizer from a local folder, for any ZeRO stage."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Union

import torch

from ds_cluster.data.special_tokens import ensure_pad_token


def is_zero3(ds_config: Optional[dict]) -> bool:
    return bool(ds_config) and int((ds_config.get("zero_optimization") or {}).get("stage", 0)) == 3


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
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"model {os.fspath(path)!r} is not a local checkpoint folder (with config.json and "
                                "weights, as written by save_pretrained)")
    hf_ds_config = None
    if is_zero3(ds_config):
        from transformers.integrations import HfDeepSpeedConfig

        hf_ds_config = HfDeepSpeedConfig(ds_config)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    ensure_pad_token(tokenizer, rank)
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=dtype)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None and generation_config.pad_token_id is None:
        generation_config.pad_token_id = tokenizer.pad_token_id
    if hf_ds_config is not None:
        model._hf_ds_config_ref = hf_ds_config
    return model, tokenizer
