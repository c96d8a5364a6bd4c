"""The tiny Llama used on CPU and its pretrained base checkpoint.

Nothing is downloaded: the tiny model is built from a config, and the base
model was pretrained here on generic copy-heavy text
(bench.toy.pretraining), so that fine-tuning starts from a model that
can copy and knows the prompt template but has never seen the tasks.

The base weights (3.5 MB) ship in ``bench/toy/base_model``
(base_model_path()): pretraining them takes about 4.5 minutes on two cores,
too long to repeat inside a test or a benchmark. ``python -m
bench.toy.models --out DIR`` rebuilds them with the same recipe.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import math
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import torch
from tqdm.auto import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from bench.toy.tokenizer import build_tokenizer

logger = logging.getLogger(__name__)


# The recipe of the base model; a change here must bump MANIFEST_VERSION and
# rebuild the shipped weights.
MANIFEST_VERSION = 2
MANIFEST_NAME = "ds_cluster_manifest.json"
PRETRAIN_STEPS = 2500
PRETRAIN_BATCH_SIZE = 32
PRETRAIN_MAX_LENGTH = 96
PRETRAIN_LR = 3e-3
PRETRAIN_WARMUP = 150
PRETRAIN_FINAL_LR_FRACTION = 0.05
PRETRAIN_WEIGHT_DECAY = 0.01
SHIPPED_BASE_MODEL = Path(__file__).resolve().parent / "base_model"


def tiny_llama_config(
    vocab_size: int,
    hidden_size: int = 128,
    layers: int = 4,
    heads: int = 4,
    intermediate: int = 384,
    max_position: int = 128,
) -> LlamaConfig:
    """A Llama of 0.88 M parameters (defaults, 104-token vocabulary): fast on two CPU cores."""
    # Token ids follow build_tokenizer(): <pad>=0, <s>=1, </s>=2.
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_position,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )


@contextlib.contextmanager
def _seeded_torch(seed: int) -> Iterator[None]:
    """Seed torch's CPU RNG inside the block only, leaving the caller's RNG state as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[PreTrainedModel, Any]:
    """A freshly initialised tiny Llama (seeded) and the character tokenizer."""
    tokenizer = build_tokenizer()
    with _seeded_torch(seed):
        model = LlamaForCausalLM._from_config(tiny_llama_config(len(tokenizer)), dtype=dtype)
    return model, tokenizer


def save_tiny_model(folder: Union[str, os.PathLike], seed: int = 0) -> str:
    """Write a fresh tiny Llama and its tokenizer as a checkpoint folder (what ``--model`` takes)."""
    model, tokenizer = tiny_model(seed)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return os.fspath(folder)


def default_cache_root() -> Path:
    """``$DS_CLUSTER_CACHE``, else ``<repo>/.cache`` for a source checkout, else ``~/.cache/ds_cluster``."""
    if os.environ.get("DS_CLUSTER_CACHE"):
        return Path(os.environ["DS_CLUSTER_CACHE"])
    repo = Path(__file__).resolve().parents[2]
    if (repo / "setup.py").is_file():
        return repo / ".cache"
    return Path.home() / ".cache" / "ds_cluster"


def base_model_path() -> str:
    """The folder of the shipped pretrained base model (a plain Hugging Face checkpoint)."""
    return str(SHIPPED_BASE_MODEL)


def _recipe(seed: int, steps: int) -> dict[str, Any]:
    config = tiny_llama_config(len(build_tokenizer()))
    return {
        "version": MANIFEST_VERSION,
        "seed": seed,
        "steps": steps,
        "batch_size": PRETRAIN_BATCH_SIZE,
        "max_length": PRETRAIN_MAX_LENGTH,
        "lr": PRETRAIN_LR,
        "warmup": PRETRAIN_WARMUP,
        "final_lr_fraction": PRETRAIN_FINAL_LR_FRACTION,
        "weight_decay": PRETRAIN_WEIGHT_DECAY,
        "config": {k: getattr(config, k) for k in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "max_position_embeddings")},
    }


def _cached_manifest(path: Path, recipe: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The manifest of a complete checkpoint made by ``recipe``, else None."""
    try:
        manifest = json.loads((path / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None
    complete = all((path / name).is_file() for name in ("config.json", "tokenizer.json"))
    complete = complete and any(path.glob("*.safetensors"))
    if not complete or {k: manifest.get(k) for k in recipe} != recipe:
        return None
    return manifest


def _pretraining_batches(texts: list[str], tokenizer) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(input_ids, attention_mask, labels) batches of ``<s> text </s>``, cut to PRETRAIN_MAX_LENGTH, padded to the
    longest.

    The mask comes from each row's length, not from the pad id, so a tokenizer that pads with its eos
    token still attends to the real eos.
    """
    for start in range(0, len(texts), PRETRAIN_BATCH_SIZE):
        rows = [
            ([tokenizer.bos_token_id] + tokenizer(t, add_special_tokens=False)["input_ids"]
             + [tokenizer.eos_token_id])[:PRETRAIN_MAX_LENGTH]
            for t in texts[start:start + PRETRAIN_BATCH_SIZE]
        ]
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.int64)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.int64)
        labels = torch.full((len(rows), width), -100, dtype=torch.int64)
        for i, row in enumerate(rows):
            input_ids[i, : len(row)] = torch.tensor(row)
            attention_mask[i, : len(row)] = 1
            labels[i, : len(row)] = torch.tensor(row)
        yield input_ids, attention_mask, labels


# Not ds_cluster.loader.lr_schedules.warmup_cosine: this one (fixed warm-up steps, a floor, the end at step
# total - 1) is the schedule the shipped weights were trained with, kept so they can be rebuilt exactly.
def warmup_cosine(total_steps: int, warmup_steps: int, final_fraction: float = 0.0) -> Callable[[int], float]:
    """Learning-rate factor: linear warm-up, then a cosine that reaches ``final_fraction`` at the last step."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min((step - warmup_steps) / max(total_steps - 1 - warmup_steps, 1), 1.0)
        return final_fraction + (1 - final_fraction) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def pretrain_base_model(seed: int, steps: int = PRETRAIN_STEPS) -> tuple[PreTrainedModel, Any, float]:
    """Pretrain the tiny model on the copy-heavy corpus; returns (model, tokenizer, final loss).

    Plain single-process torch: AdamW (0.9, 0.95), gradient clipping 1.0,
    warm-up then cosine to PRETRAIN_FINAL_LR_FRACTION. The final loss is the
    mean of the last 5% of steps (one step is noisy).
    """
    from bench.toy.pretraining import generate_pretraining_corpus

    model, tokenizer = tiny_model(seed)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=PRETRAIN_LR, betas=(0.9, 0.95),
                                  weight_decay=PRETRAIN_WEIGHT_DECAY)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(steps, min(PRETRAIN_WARMUP, steps), PRETRAIN_FINAL_LR_FRACTION))
    texts, _ = generate_pretraining_corpus(seed, steps * PRETRAIN_BATCH_SIZE)
    losses: list[float] = []
    batches = _pretraining_batches(texts, tokenizer)
    with _seeded_torch(seed), tqdm(batches, total=steps, desc="pretrain base model", disable=None) as bar:
        for input_ids, attention_mask, labels in bar:
            loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    tail = losses[-max(len(losses) // 20, 1):]
    model.eval()
    return model, tokenizer, sum(tail) / len(tail)


def ensure_base_model(
    cache_dir: Optional[Union[str, os.PathLike]] = None,
    seed: int = 0,
    steps: int = PRETRAIN_STEPS,
) -> str:
    """The folder of the pretrained tiny base model for ``seed``, pretraining it on first use.

    Cached as ``<cache_dir>/base_model_seed<seed>`` (``cache_dir`` defaults
    to default_cache_root(); a non-default ``steps`` gets its own folder).
    The folder is written under a temporary name and renamed when complete,
    and a file lock makes concurrent callers (e.g. every rank of a job) wait
    for one pretraining instead of each running their own.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    name = f"base_model_seed{seed}" + ("" if steps == PRETRAIN_STEPS else f"_steps{steps}")
    target = root / name
    recipe = _recipe(seed, steps)
    if _cached_manifest(target, recipe) is not None:
        return str(target)

    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _cached_manifest(target, recipe) is not None:  # another process built it while we waited
            return str(target)
        logger.info("pretraining the tiny base model (seed %d, %d steps) into %s", seed, steps, target)
        started = time.perf_counter()
        model, tokenizer, final_loss = pretrain_base_model(seed, steps)
        seconds = time.perf_counter() - started
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be shared
        try:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            manifest = dict(recipe, final_loss=final_loss, seconds=round(seconds, 1), torch=torch.__version__)
            (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
            if target.exists():  # a stale or different recipe's checkpoint
                shutil.rmtree(target)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        logger.info("base model ready in %.1f s, final loss %.4f: %s", seconds, final_loss, target)
    return str(target)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description="Pretrain (or find cached) the tiny base model.")
    parser.add_argument("--out", default=None, help="cache folder (default: $DS_CLUSTER_CACHE or <repo>/.cache)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=PRETRAIN_STEPS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path = ensure_base_model(args.out, seed=args.seed, steps=args.steps)
    logger.info("%s", path)


if __name__ == "__main__":
    main()
