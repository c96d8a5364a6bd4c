"""Held-out evaluation per task family: answer-token loss and exact match of greedy answers.

Per-family numbers, not one average, are what cluster-balanced sampling is
judged on: a sampler that starves the small families shows up in the worst
family long before it moves the mean.

Under ZeRO stage 3 every rank must run the same forward passes: call these on
every rank with the same records, and pass ``synced_gpus=True`` to the
generation functions (Hugging Face's own switch for that case).
"""
from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any, Mapping, Optional, Sequence

import torch

from ds_cluster.dataset import IGNORE_INDEX, InstructionDataset, encode_prompt
# The evaluation pieces both worlds share: the answer margin and the eval-mode context.
from ds_cluster.real.evaluate import ANSWER_MARGIN_TOKENS, eval_mode

logger = logging.getLogger(__name__)

def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def mean_by_family(values: Sequence[float], families: Sequence[str]) -> dict[str, float]:
    """The mean of `values` per family, families sorted by name."""
    grouped: dict[str, list[float]] = defaultdict(list)
    for value, family in zip(values, families):
        grouped[family].append(value)
    return {family: sum(v) / len(v) for family, v in sorted(grouped.items())}


def answer_loss(model: torch.nn.Module, dataset: InstructionDataset, batch_size: int = 64,
                include_eos: bool = False) -> torch.Tensor:
    """Mean cross-entropy of every sample's answer tokens: (N,), NaN where a sample has none.

    By default the closing end-of-sequence token is left out: it measures
    where an answer stops, not what it says, and it is the easiest token.
    """
    device = _device_of(model)
    losses = []
    with eval_mode(model):
        for start in range(0, len(dataset), batch_size):
            input_ids = dataset.input_ids[start:start + batch_size].to(device)
            attention_mask = dataset.attention_mask[start:start + batch_size].to(device)
            targets = dataset.labels[start:start + batch_size, 1:].to(device)  # position t predicts token t+1
            if not include_eos:
                last = (targets != IGNORE_INDEX).cumsum(dim=1) == (targets != IGNORE_INDEX).sum(dim=1, keepdim=True)
                targets = torch.where(last & (targets != IGNORE_INDEX), torch.full_like(targets, IGNORE_INDEX),
                                      targets)
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
            token_loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets,
                                                           ignore_index=IGNORE_INDEX, reduction="none")
            counts = (targets != IGNORE_INDEX).sum(dim=1)
            losses.append((token_loss.sum(dim=1) / counts).cpu())
    return torch.cat(losses) if losses else torch.zeros(0)


def answer_loss_by_family(model: torch.nn.Module, dataset: InstructionDataset, batch_size: int = 64,
                          include_eos: bool = False) -> dict[str, float]:
    """Mean over each family's samples of the answer loss; samples without answer tokens are left out."""
    losses = answer_loss(model, dataset, batch_size, include_eos).tolist()
    kept = [(loss, family) for loss, family in zip(losses, dataset.families) if loss == loss]  # drop NaN
    return mean_by_family([loss for loss, _ in kept], [family for _, family in kept])


def answer_token_count(tokenizer: Any, record: Mapping[str, Any]) -> int:
    """Tokens of the record's reference answer (its "output", without the end token); 0 when it has none."""
    if "output" not in record:
        return 0
    return len(tokenizer(str(record["output"]), add_special_tokens=False)["input_ids"])


def generation_budget(tokenizer: Any, records: Sequence[Mapping[str, Any]],
                      max_new_tokens: Optional[int] = None) -> int:
    """New tokens to generate for one batch: its longest reference answer + ANSWER_MARGIN_TOKENS.

    `max_new_tokens`, when given, is a floor (records without a reference get
    that many), never a cut: a fixed budget below an answer's length scored
    every long answer wrong, however well the model had learnt it.
    """
    longest = max((answer_token_count(tokenizer, record) for record in records), default=0)
    return max(longest + ANSWER_MARGIN_TOKENS, max_new_tokens or 0)


def greedy_answers(model: torch.nn.Module, tokenizer: Any, records: Sequence[Mapping[str, Any]],
                   max_new_tokens: Optional[int] = None, batch_size: int = 64, synced_gpus: bool = False
                   ) -> list[str]:
    """The model's greedy answer to every record's prompt (text before the end token), in order.

    `model.generate(do_sample=False)` on left-padded prompts; prompts of
    similar length are batched together (less padding, the same answers).
    Each batch generates until the end token or `generation_budget` new
    tokens: its longest reference answer plus a margin (at least
    `max_new_tokens` when given). Under ZeRO-3 with `synced_gpus` the ranks'
    budgets may differ: generate keeps the finished ranks stepping.
    """
    prompts = [encode_prompt(tokenizer, record) for record in records]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    answers: list[str] = [""] * len(prompts)
    device = _device_of(model)
    with eval_mode(model):
        for start in range(0, len(order), batch_size):
            chunk = order[start:start + batch_size]
            width = max(len(prompts[i]) for i in chunk)
            input_ids = torch.full((len(chunk), width), tokenizer.pad_token_id, dtype=torch.int64)
            attention_mask = torch.zeros((len(chunk), width), dtype=torch.int64)
            for row, index in enumerate(chunk):
                input_ids[row, width - len(prompts[index]):] = torch.tensor(prompts[index])
                attention_mask[row, width - len(prompts[index]):] = 1
            budget = generation_budget(tokenizer, [records[i] for i in chunk], max_new_tokens)
            logger.debug("greedy answers: batch of %d, %d new tokens at most", len(chunk), budget)
            generated = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                       do_sample=False, max_new_tokens=budget, synced_gpus=synced_gpus,
                                       pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            for index, row in zip(chunk, generated[:, width:].tolist()):
                if tokenizer.eos_token_id in row:
                    row = row[:row.index(tokenizer.eos_token_id)]
                answers[index] = tokenizer.decode(row, skip_special_tokens=True)
    return answers


def check_answer(record: Mapping[str, Any], prediction: str) -> bool:
    """Exact match of the prediction with the gold output, ignoring surrounding whitespace."""
    return prediction.strip() == str(record["output"]).strip()


def exact_match_by_family(model: torch.nn.Module, tokenizer: Any, records: Sequence[Mapping[str, Any]],
                          max_new_tokens: Optional[int] = None, batch_size: int = 64, synced_gpus: bool = False
                          ) -> dict[str, float]:
    """Fraction of each family's records whose greedy answer is exactly the gold output.

    Generation runs to each batch's longest gold answer plus a margin (`generation_budget`).
    """
    return score_answers(records, greedy_answers(model, tokenizer, records, max_new_tokens, batch_size, synced_gpus))


def score_answers(records: Sequence[Mapping[str, Any]], answers: Sequence[str]) -> dict[str, float]:
    """Per family, the fraction of answers that are exactly the record's output."""
    correct = [float(check_answer(record, answer)) for record, answer in zip(records, answers)]
    return mean_by_family(correct, [str(record.get("family", "")) for record in records])


def summarize(by_family: Mapping[str, float], higher_is_better: bool = True) -> dict[str, Any]:
    """Macro average over families, and the worst family with its score."""
    if not by_family:
        raise ValueError("no families to summarize")
    pick = min if higher_is_better else max
    worst = pick(by_family, key=lambda f: (by_family[f], f))
    return {"macro": sum(by_family.values()) / len(by_family), "worst_family": worst, "worst": by_family[worst],
            "num_families": len(by_family)}
