"""Held-out evaluation per task family: token loss and exact match of greedy answers.

Per-family numbers, not one average, are what cluster-balanced sampling is
judged on: a sampler that starves the small families shows up in the worst
family long before it moves the mean.

Under ZeRO stage 3 every rank must run the same forward passes: call these
on every rank with the same number of records, and pass ``early_stop=False``
to the generation functions.
"""
from __future__ import annotations

import contextlib
import inspect
from collections import defaultdict
from typing import Any, Iterator, Mapping, Sequence

import torch

from ds_cluster.data.instructions import IGNORE_INDEX, InstructionDataset, encode_prompt
from ds_cluster.data.tasks import check_answer


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Eval mode and no autograd inside, the caller's mode restored after."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _mean_by_family(values: Sequence[float], families: Sequence[str]) -> dict[str, float]:
    grouped: dict[str, list[float]] = defaultdict(list)
    for value, family in zip(values, families):
        grouped[family].append(value)
    return {family: sum(v) / len(v) for family, v in sorted(grouped.items())}


def per_sample_loss(model: torch.nn.Module, dataset: InstructionDataset, batch_size: int = 64) -> torch.Tensor:
    """Mean response-token cross-entropy of every sample (NaN where no token is labelled)."""
    device = _device_of(model)
    losses = []
    with _eval_mode(model):
        for start in range(0, len(dataset), batch_size):
            input_ids = dataset.input_ids[start:start + batch_size].to(device)
            attention_mask = dataset.attention_mask[start:start + batch_size].to(device)
            labels = dataset.labels[start:start + batch_size].to(device)
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
            # Position t predicts token t+1.
            targets = labels[:, 1:]
            token_loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].transpose(1, 2), targets, ignore_index=IGNORE_INDEX, reduction="none"
            )
            counts = (targets != IGNORE_INDEX).sum(dim=1)
            losses.append((token_loss.sum(dim=1) / counts).cpu())
    return torch.cat(losses) if losses else torch.zeros(0)


def heldout_loss_by_family(model: torch.nn.Module, dataset: InstructionDataset, batch_size: int = 64) -> dict[str, float]:
    """Mean over each family's samples of the per-sample response-token loss.

    Samples whose response was truncated away (no labelled token) are left out.
    """
    losses = per_sample_loss(model, dataset, batch_size).tolist()
    kept = [(loss, family) for loss, family in zip(losses, dataset.families) if loss == loss]  # drop NaN
    return _mean_by_family([loss for loss, _ in kept], [family for _, family in kept])


def _cache_kwarg(model: torch.nn.Module) -> str:
    """The forward argument that takes the key/value cache: transformers 5.2x renamed it ``cache``."""
    wrapped = getattr(model, "module", model)  # a DeepSpeed engine forwards to .module
    return "cache" if "cache" in inspect.signature(type(wrapped).forward).parameters else "past_key_values"


def _cache_of(output: Any) -> Any:
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def _greedy_batch(
    model: torch.nn.Module, prompts: Sequence[Sequence[int]], pad_id: int, eos_id: int,
    max_new_tokens: int, early_stop: bool,
) -> list[list[int]]:
    """Greedy continuation of left-padded prompts with the key/value cache; tokens before eos."""
    device = _device_of(model)
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.int64)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.int64)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.int64)
        attention_mask[row, width - len(prompt):] = 1
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    # Left padding: positions count real tokens only, so a prompt reads the same in any batch.
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)

    cache_kwarg = _cache_kwarg(model)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True)
    finished = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    generated: list[torch.Tensor] = []
    for step in range(max_new_tokens):
        next_token = out.logits[:, -1].argmax(dim=-1)
        next_token = torch.where(finished, torch.full_like(next_token, pad_id), next_token)
        generated.append(next_token)
        finished |= next_token == eos_id
        if step == max_new_tokens - 1 or (early_stop and bool(finished.all())):
            break
        attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], dim=1)
        position_ids = position_ids[:, -1:] + 1
        out = model(input_ids=next_token[:, None], attention_mask=attention_mask, position_ids=position_ids,
                    use_cache=True, **{cache_kwarg: _cache_of(out)})

    tokens = torch.stack(generated, dim=1).tolist() if generated else [[] for _ in prompts]
    return [row[: row.index(eos_id)] if eos_id in row else row for row in tokens]


def greedy_generate(
    model: torch.nn.Module,
    tokenizer: Any,
    records: Sequence[Mapping[str, str]],
    max_new_tokens: int = 16,
    batch_size: int = 64,
    early_stop: bool = True,
) -> list[str]:
    """The model's greedy answer to every record's prompt (text before ``</s>``), in order."""
    prompts = [encode_prompt(tokenizer, record) for record in records]
    # Batch prompts of similar length together: less padding, same answers.
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    answers: list[str] = [""] * len(prompts)
    with _eval_mode(model):
        for start in range(0, len(order), batch_size):
            chunk = order[start:start + batch_size]
            outputs = _greedy_batch(model, [prompts[i] for i in chunk], tokenizer.pad_token_id,
                                    tokenizer.eos_token_id, max_new_tokens, early_stop)
            for index, ids in zip(chunk, outputs):
                answers[index] = tokenizer.decode(ids, skip_special_tokens=True)
    return answers


def exact_match_by_family(
    model: torch.nn.Module,
    tokenizer: Any,
    records: Sequence[Mapping[str, str]],
    max_new_tokens: int = 16,
    batch_size: int = 64,
    early_stop: bool = True,
) -> dict[str, float]:
    """Fraction of each family's records whose greedy answer passes ``check_answer``."""
    answers = greedy_generate(model, tokenizer, records, max_new_tokens, batch_size, early_stop)
    correct = [float(check_answer(record, answer)) for record, answer in zip(records, answers)]
    return _mean_by_family(correct, [record.get("family", "") for record in records])


def summarize(acc_by_family: Mapping[str, float]) -> dict[str, Any]:
    """Macro average over families, and the worst and best family with their scores."""
    if not acc_by_family:
        raise ValueError("no families to summarize")
    worst = min(acc_by_family, key=lambda f: (acc_by_family[f], f))
    best = max(acc_by_family, key=lambda f: (acc_by_family[f], f))
    return {
        "macro_avg": sum(acc_by_family.values()) / len(acc_by_family),
        "worst_family": worst,
        "worst": acc_by_family[worst],
        "best_family": best,
        "best": acc_by_family[best],
        "num_families": len(acc_by_family),
    }
