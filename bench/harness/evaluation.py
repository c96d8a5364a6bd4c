"""The job's clocks, its small collectives, and how a model is evaluated: answer loss per family and greedy exact
match on the label families, the records shared out over the ranks."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from ds_cluster import distributed
from ds_cluster.data.dataset import InstructionDataset

EVALUATION_BATCH = 32


class Clock:
    """Wall seconds and this process's CPU seconds since it was made."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def read(self) -> dict[str, float]:
        return {"wall": time.perf_counter() - self.wall, "cpu": time.process_time() - self.cpu}


def summed(timing: Mapping[str, float]) -> dict[str, float]:
    """Over the ranks: wall is the slowest rank's, CPU the sum of every rank's (collective)."""
    every = distributed.all_gather_object(timing)
    return {"wall": max(t["wall"] for t in every), "cpu": sum(t["cpu"] for t in every)}


def barrier() -> None:
    distributed.all_gather_object(None)


def exists_on_rank0(path: Path) -> bool:
    """Whether rank 0 sees `path` (collective): every rank then takes the same branch, even when rank 0
    writes the file before a slower rank has looked."""
    return bool(distributed.all_gather_object(path.exists() if distributed.get_rank() == 0 else None)[0])


def evaluate(model: torch.nn.Module, tokenizer: Any, records: list[dict], spec: Any,
             exact_match_families: Sequence[str]) -> dict[str, Any]:
    """Answer loss per family, and greedy exact match per family of `exact_match_families`, the records
    shared out over the ranks (collective). Generation runs to each batch's longest reference answer plus a
    margin (ds_cluster.evaluate.greedy_answers); under bf16 autocast when the arms train in it."""
    with torch.autocast(next(model.parameters()).device.type, dtype=torch.bfloat16,
                        enabled=spec.precision != "fp32"):  # as the arms train
        return _evaluate(model, tokenizer, records, spec, exact_match_families)


def _evaluate(model: torch.nn.Module, tokenizer: Any, records: list[dict], spec: Any,
              exact_match_families: Sequence[str]) -> dict[str, Any]:
    from ds_cluster.evaluate import answer_nll, greedy_answers, mean_by_group

    rank, world = distributed.get_rank(), distributed.get_world_size()
    mine = records[rank::world]
    losses = (answer_nll(model, InstructionDataset(mine, tokenizer, max_length=spec.max_length, rank=rank),
                         batch_size=EVALUATION_BATCH).tolist() if mine else [])
    wanted = set(exact_match_families)
    scored = [r for r in mine if r["family"] in wanted]
    answers = greedy_answers(model, tokenizer, scored, batch_size=EVALUATION_BATCH) if scored else []
    gathered = distributed.all_gather_object(([r["family"] for r in mine], losses,
                                              [(r["family"], str(r["output"]).strip()) for r in scored], answers))
    families = [family for part in gathered for family in part[0]]
    result: dict[str, Any] = {"loss": mean_by_group([loss for part in gathered for loss in part[1]], families)}
    if getattr(spec, "per_record", False):  # every record's answer loss, in the split's order
        per_record = [0.0] * len(records)
        for rank_of, part in enumerate(gathered):
            per_record[rank_of::world] = part[1]
        result["record_loss"] = per_record
    if wanted:
        references = [reference for part in gathered for reference in part[2]]
        correct = [float(answer.strip() == text) for (_, text), answer
                   in zip(references, [answer for part in gathered for answer in part[3]])]
        result["exact_match"] = mean_by_group(correct, [family for family, _ in references])
    return result


def copy_probe(model: torch.nn.Module, tokenizer: Any, spec: Any) -> float:
    """The synthetic base model's greedy exact match copying strings of 3 to 8 random letters (collective)."""
    from bench.toy.pretraining import copy_probe_records

    records = copy_probe_records(count=spec.copy_probe_records, seed=spec.copy_probe_seed)
    result = evaluate(model, tokenizer, [dict(r, family="copy") for r in records], spec, ["copy"])
    return result["exact_match"]["copy"]
