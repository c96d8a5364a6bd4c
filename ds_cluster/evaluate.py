"""Held-out evaluation of a fine-tuned model, per task group: answer loss, and exact match where answers are labels.

    python -m ds_cluster.evaluate --model runs/train/model --data heldout.jsonl --max-length 272

The primary number is each record's answer loss: the mean negative log-likelihood of its reference
answer's tokens given the prompt (the closing end token left out: it says where an answer stops, not
what it says), averaged per task group (a record's ``category``, else its ``family``), then summarised
as the macro mean over groups and the worst group. A subset that starves a small group shows up in the
worst group first.

Exact match of greedy answers is computed only for groups whose answers are short labels (few
distinct answers, such as "positive" / "negative" or a topic name): for free text (summaries,
generated sentences) a small model almost never matches word for word, and the number would say
nothing. ``categorical_groups`` picks those groups from the reference answers themselves.

Batches are records of similar length, cut to their longest record: real prompts vary from tens to
hundreds of tokens, and a batch padded to the longest record of the whole set would spend most of
its time on padding. Forward only. Under ZeRO stage 3 every rank must run the same forward passes: call
these on every rank with the same records, and pass ``synced_gpus=True`` to the generation functions
(Hugging Face's own switch for that case).
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence, Union

import torch
from tqdm.auto import tqdm

from ds_cluster.data.dataset import (IGNORE_INDEX, InstructionDataset, encode_example, encode_prompt, read_records,
                                     task_group)
from ds_cluster.fileio import write_json_atomic

logger = logging.getLogger(__name__)

# A group's answers are labels when its records hold at most this fraction of distinct reference answers
# (T0's held-out: topic 0.03, paraphrase 0.08, sentiment 0.17; closed-book QA 0.50, generated sentences and
# summaries 0.61 and 0.63, multiple choice 0.89).
CATEGORICAL_MAX_DISTINCT_FRACTION = 0.25
# New tokens allowed beyond a batch's longest reference answer: the end token and stray whitespace.
ANSWER_MARGIN_TOKENS = 4


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Eval mode and no autograd inside; the caller's mode restored after."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def record_group(record: Mapping[str, Any]) -> str:
    """A record's task group (`ds_cluster.data.dataset.task_group`: its ``category``, else its ``family``)."""
    return task_group(record)


def mean_by_group(values: Sequence[float], groups: Sequence[str]) -> dict[str, float]:
    """The mean of ``values`` per group, groups sorted by name; NaN values (records without answer) left out."""
    grouped: dict[str, list[float]] = defaultdict(list)
    for value, group in zip(values, groups):
        if value == value:  # NaN is the one value not equal to itself
            grouped[group].append(float(value))
    return {group: sum(v) / len(v) for group, v in sorted(grouped.items()) if v}


def _length_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Indices in batches of similar length (sorted by length, then by index, so the order is deterministic)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    return [order[start:start + batch_size] for start in range(0, len(order), batch_size)]


def answer_nll(model: torch.nn.Module, dataset: InstructionDataset, batch_size: int = 32,
               include_eos: bool = False) -> torch.Tensor:
    """Every record's mean answer-token NLL, in the dataset's order: float (N,), NaN where a record has no answer token.

    ``include_eos`` counts the closing end token too (the training loss does; left out by default).
    A record cut by the dataset's ``max_length`` is scored on what is left of it.
    """
    device = next(model.parameters()).device
    lengths = dataset.attention_mask.sum(dim=1).tolist()
    result = torch.full((len(dataset),), float("nan"))
    batches = _length_batches(lengths, batch_size)
    with eval_mode(model):
        for rows in tqdm(batches, desc="answer loss", unit="batch", disable=None):
            width = max(max(lengths[i] for i in rows), 2)
            index = torch.tensor(rows)
            input_ids = dataset.input_ids[index, :width].to(device)
            attention_mask = dataset.attention_mask[index, :width].to(device)
            targets = dataset.labels[index, 1:width].to(device)  # position t predicts token t + 1
            answered = targets != IGNORE_INDEX
            if not include_eos:
                # The last labelled token of each row is its end token.
                last = answered & (answered.cumsum(dim=1) == answered.sum(dim=1, keepdim=True))
                targets = targets.masked_fill(last, IGNORE_INDEX)
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
            token_nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets,
                                                          ignore_index=IGNORE_INDEX, reduction="none")
            counts = (targets != IGNORE_INDEX).sum(dim=1)
            # 0 / 0 gives NaN: a record without answer tokens stays out of the means.
            result[index] = (token_nll.sum(dim=1) / counts).cpu()
    return result


def answer_loss_by_group(model: torch.nn.Module, dataset: InstructionDataset, batch_size: int = 32,
                         include_eos: bool = False) -> dict[str, float]:
    """Mean answer NLL of each group's records (``answer_nll``), groups sorted by name."""
    losses = answer_nll(model, dataset, batch_size, include_eos).tolist()
    return mean_by_group(losses, [record_group(r) for r in dataset.records])


def categorical_groups(records: Sequence[Mapping[str, Any]],
                       max_distinct_fraction: float = CATEGORICAL_MAX_DISTINCT_FRACTION) -> list[str]:
    """The groups whose reference answers are labels: at most ``max_distinct_fraction`` of their records'
    answers are distinct (stripped). Sorted by name."""
    answers: dict[str, list[str]] = defaultdict(list)
    for record in records:
        answers[record_group(record)].append(str(record.get("output", "")).strip())
    return sorted(group for group, texts in answers.items()
                  if len(set(texts)) <= max_distinct_fraction * len(texts))


def answer_token_count(tokenizer: Any, record: Mapping[str, Any]) -> int:
    """Tokens of the record's reference answer (its "output", without the end token); 0 when it has none."""
    if "output" not in record:
        return 0
    return len(tokenizer(str(record["output"]), add_special_tokens=False)["input_ids"])


def generation_budget(tokenizer: Any, records: Sequence[Mapping[str, Any]],
                      max_new_tokens: Optional[int] = None) -> int:
    """New tokens to generate for one batch: its longest reference answer + ``ANSWER_MARGIN_TOKENS``.

    ``max_new_tokens``, when given, is a floor (records without a reference get that many), never a cut: a
    fixed budget below an answer's length would score every long answer wrong, however well it was learnt.
    """
    longest = max((answer_token_count(tokenizer, record) for record in records), default=0)
    return max(longest + ANSWER_MARGIN_TOKENS, max_new_tokens or 0)


def greedy_answers(model: torch.nn.Module, tokenizer: Any, records: Sequence[Mapping[str, Any]],
                   batch_size: int = 32, max_new_tokens: Optional[int] = None, synced_gpus: bool = False
                   ) -> list[str]:
    """The model's greedy answer to every record's prompt (the text before its end token), in order.

    Left-padded prompts of similar length are generated together; each batch runs to
    ``generation_budget`` new tokens (its longest reference answer plus a margin), so a right answer is
    never cut. Under ZeRO-3 with ``synced_gpus`` the ranks' budgets may differ: generate keeps the
    finished ranks stepping.
    """
    prompts = [encode_prompt(tokenizer, record, index) for index, record in enumerate(records)]
    answers = [""] * len(records)
    device = next(model.parameters()).device
    with eval_mode(model):
        for rows in tqdm(_length_batches([len(p) for p in prompts], batch_size), desc="greedy answers",
                         unit="batch", disable=None):
            width = max(len(prompts[i]) for i in rows)
            input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.int64)
            attention_mask = torch.zeros((len(rows), width), dtype=torch.int64)
            for row, index in enumerate(rows):
                input_ids[row, width - len(prompts[index]):] = torch.tensor(prompts[index])
                attention_mask[row, width - len(prompts[index]):] = 1
            budget = generation_budget(tokenizer, [records[i] for i in rows], max_new_tokens)
            generated = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                       do_sample=False, max_new_tokens=budget, synced_gpus=synced_gpus,
                                       pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            for index, new_tokens in zip(rows, generated[:, width:].tolist()):
                if tokenizer.eos_token_id in new_tokens:
                    new_tokens = new_tokens[:new_tokens.index(tokenizer.eos_token_id)]
                answers[index] = tokenizer.decode(new_tokens, skip_special_tokens=True)
    return answers


def check_answer(record: Mapping[str, Any], prediction: str) -> bool:
    """Exact match of a prediction with the record's reference answer, surrounding whitespace ignored, case kept."""
    return prediction.strip() == str(record.get("output", "")).strip()


def score_answers(records: Sequence[Mapping[str, Any]], answers: Sequence[str]) -> dict[str, float]:
    """Per group, the fraction of answers that are exactly the record's reference answer."""
    correct = [float(check_answer(record, answer)) for record, answer in zip(records, answers)]
    return mean_by_group(correct, [record_group(record) for record in records])


def exact_match_by_group(model: torch.nn.Module, tokenizer: Any, records: Sequence[Mapping[str, Any]],
                         groups: Optional[Sequence[str]] = None, batch_size: int = 32,
                         max_new_tokens: Optional[int] = None, synced_gpus: bool = False) -> dict[str, float]:
    """Per group, the fraction of records whose greedy answer is the reference answer (``check_answer``).

    Only the records of ``groups`` are generated (default: ``categorical_groups``, the groups whose answers
    are labels; pass every group for data whose answers can all be checked exactly).
    """
    wanted = set(categorical_groups(records) if groups is None else groups)
    chosen = [record for record in records if record_group(record) in wanted]
    return score_answers(chosen, greedy_answers(model, tokenizer, chosen, batch_size, max_new_tokens, synced_gpus))


def summarize(by_group: Mapping[str, float], higher_is_better: bool = False) -> dict[str, Any]:
    """Macro mean over groups and the worst group: {"macro", "worst", "worst_group", "num_groups"}.

    Lower is better by default (a loss); pass ``higher_is_better=True`` for exact match.
    """
    if not by_group:
        raise ValueError("no groups to summarize")
    pick = min if higher_is_better else max
    worst = pick(by_group, key=lambda group: (by_group[group], group))
    return {"macro": sum(by_group.values()) / len(by_group), "worst": by_group[worst], "worst_group": worst,
            "num_groups": len(by_group)}


def evaluate_model(model: torch.nn.Module, tokenizer: Any, records: Sequence[Mapping[str, Any]], max_length: int,
                   exact_match_groups: Optional[Sequence[str]] = None, batch_size: int = 32) -> dict[str, Any]:
    """Answer loss per group for every record, exact match per group for the label groups, and both summaries."""
    dataset = InstructionDataset(records, tokenizer, max_length=max_length, rank=0)
    cut = sum(len(encode_example(tokenizer, record, sys.maxsize, index)[0]) > max_length
              for index, record in enumerate(dataset.records))
    if cut:
        logger.warning("%d of %d records are longer than max_length %d: they are scored on what is left of them",
                       cut, len(dataset), max_length)
    loss = answer_loss_by_group(model, dataset, batch_size)
    groups = categorical_groups(records) if exact_match_groups is None else list(exact_match_groups)
    exact = exact_match_by_group(model, tokenizer, records, groups, batch_size) if groups else {}
    return {"answer_loss": loss, "answer_loss_summary": summarize(loss),
            "exact_match": exact, "exact_match_summary": summarize(exact, higher_is_better=True) if exact else None,
            "num_records": len(dataset)}


def evaluate_checkpoint(path: Union[str, os.PathLike], records: Sequence[Mapping[str, Any]], max_length: int,
                        exact_match_groups: Optional[Sequence[str]] = None, batch_size: int = 32) -> dict[str, Any]:
    """``evaluate_model`` on a local checkpoint folder (model and tokenizer, loaded on the CPU in float32)."""
    from ds_cluster.data.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(path, rank=0)
    return evaluate_model(model, tokenizer, records, max_length, exact_match_groups, batch_size)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", required=True, help="checkpoint folder (repeat for several)")
    parser.add_argument("--data", required=True, help="held-out records: JSONL, optionally gzipped")
    parser.add_argument("--max-length", type=int, required=True, help="tokens per record, prompt and answer")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out", help="write every model's results to this JSON file")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    records = read_records(args.data)
    groups = categorical_groups(records)
    logger.info("%d records; exact match for the label groups %s", len(records), groups)
    results = {}
    for model_dir in args.model:
        results[model_dir] = evaluate_checkpoint(model_dir, records, args.max_length, groups, args.batch_size)
        loss, exact = results[model_dir]["answer_loss_summary"], results[model_dir]["exact_match_summary"]
        logger.info("%s: answer loss macro %.4f, worst %.4f (%s)%s", model_dir, loss["macro"], loss["worst"],
                    loss["worst_group"], f"; exact match macro {exact['macro']:.3f}" if exact else "")
    if args.out:
        write_json_atomic(Path(args.out), results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
