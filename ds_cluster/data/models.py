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

    folder = _checkpoint_folder(path)
    base = adapter_base(folder)
    if base is not None and not (folder / "tokenizer_config.json").is_file():
        folder = base  # an adapter folder saved without its tokenizer: the base model's
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    ensure_pad_token(tokenizer, rank)
    return tokenizer


def load_model(path: Union[str, os.PathLike], ds_config: Optional[dict] = None, dtype: torch.dtype = torch.float32,
               pad_token_id: Optional[int] = None) -> Any:
    """A causal LM from a local checkpoint folder, partitioned under ZeRO stage 3 (see `load_model_and_tokenizer`);
    its ``generation_config.pad_token_id`` is set to `pad_token_id` when it has none. A PEFT adapter folder (with
    adapter_config.json, as a PeftModel's save_pretrained writes it) gives its base model with those adapters,
    trainable (`with_saved_adapters`)."""
    from transformers import AutoModelForCausalLM

    folder = _checkpoint_folder(path)
    base = adapter_base(folder)
    if base is not None:
        return with_saved_adapters(load_model(base, ds_config, dtype, pad_token_id), folder)
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


# LoRA on every linear layer of the transformer blocks (attention and MLP projections), not the output layer.
LORA_TARGETS = "all-linear"


def with_lora(model: Any, rank: int, alpha: Optional[float] = None, targets: Any = LORA_TARGETS,
              seed: Optional[int] = None) -> Any:
    """`model` as a `peft` PeftModel with LoRA adapters of rank `rank` (scaling alpha / rank, alpha 2 x rank by
    default; no dropout) on `targets`: only the adapters train. `seed`: the adapters' initialisation, the same in
    every process (torch's default generator starts from another seed in each), drawn without touching the
    caller's generator. ImportError naming the extra when peft is absent."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as err:
        raise ImportError("LoRA needs peft, which is not installed: pip install 'ds_cluster[peft]'") from err
    config = LoraConfig(r=int(rank), lora_alpha=float(alpha if alpha is not None else 2 * rank),
                        target_modules=targets, lora_dropout=0.0, task_type="CAUSAL_LM")
    if seed is None:
        return get_peft_model(model, config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(model, config)


ADAPTER_CONFIG = "adapter_config.json"


def adapter_base(folder: Union[str, os.PathLike]) -> Optional[Path]:
    """The base model folder a PEFT adapter folder names (its adapter_config.json's base_model_name_or_path);
    None for a folder without adapter_config.json. FileNotFoundError when the base is not a local folder: nothing
    is downloaded."""
    import json

    config_path = Path(folder) / ADAPTER_CONFIG
    if not config_path.is_file():
        return None
    base = json.loads(config_path.read_text()).get("base_model_name_or_path")
    if not base or not Path(base).is_dir():
        raise FileNotFoundError(f"the adapter folder {os.fspath(folder)!r} names {base!r} as its base model, which is "
                                f"not a local checkpoint folder: set base_model_name_or_path in its {ADAPTER_CONFIG} "
                                "to the base model's folder (nothing is downloaded)")
    return Path(base)


def with_saved_adapters(model: Any, folder: Union[str, os.PathLike]) -> Any:
    """`model` with the PEFT adapters saved in `folder`, trainable (their gradients are the lora features and a
    job trains them on); ImportError naming the extra when peft is absent."""
    try:
        from peft import PeftModel
    except ImportError as err:
        raise ImportError("the model folder holds PEFT adapters, and peft is not installed: "
                          "pip install 'ds_cluster[peft]'") from err
    return PeftModel.from_pretrained(model, os.fspath(folder), is_trainable=True)
