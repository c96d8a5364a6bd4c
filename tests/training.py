"""Helpers for tests that run the training script (python -m ds_cluster.train): arguments, traces, checks."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from ds_cluster import Plan
from ds_cluster.dataset import read_jsonl, write_jsonl
from ds_cluster.toy.models import base_model_path
from ds_cluster.toy.tasks import DEFAULT_DATA
from tests.launching import REPO

# What python runs (`python -m ds_cluster.train`); tests/launching.py turns it into the launchers' forms.
TRAIN = ["-m", "ds_cluster.train"]


def make_small_job(root: Path) -> Path:
    """A small slice of the shipped data (every family), a hand-made analysis (features by family) and a
    copy of the shipped base model as a checkpoint folder (`root/model`, what --model takes). The base
    model, not a fresh one: on these letter tasks a fresh model's loss barely moves in the few steps a
    test trains, and the tests check that it falls."""
    shutil.copytree(base_model_path(), root / "model")
    records = read_jsonl(DEFAULT_DATA / "train.jsonl")
    by_family: dict[str, list] = {}
    for record in records:
        by_family.setdefault(record["family"], []).append(record)
    subset = [r for family in sorted(by_family) for r in by_family[family][: max(20, len(by_family[family]) // 7)]]
    write_jsonl(subset, root / "train.jsonl")
    families = sorted(by_family)
    family_ids = np.array([families.index(r["family"]) for r in subset])
    rng = np.random.default_rng(0)
    centres = rng.normal(0, 3, (len(families), 16))
    (root / "analysis").mkdir()
    np.save(root / "analysis" / "features.npy",
            (centres[family_ids] + rng.normal(0, 1, (len(subset), 16))).astype(np.float32))
    return root


def train_args(job: Path, config: str, out: Path, *extra: str) -> list[str]:
    return [*TRAIN, "--deepspeed", str(REPO / "ds_configs" / config), "--model", str(job / "model"),
            "--data", str(job / "train.jsonl"), "--analysis", str(job / "analysis"),
            "--output-dir", str(out), "--max-length", "64", "--trace", *extra]


def read_trace(out: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (out / "trace" / f"rank{rank}.jsonl").read_text().splitlines()]


def assert_run_follows_plan(out: Path, world: int = 2) -> None:
    """Each rank trained on exactly its plan indices, step by step; the loss fell; ranks agree."""
    plan = Plan.load(out / "plan")
    schedules: dict[int, np.ndarray] = {}
    for rank in range(world):
        trace = read_trace(out, rank)
        assert trace, f"rank {rank} trained on nothing"
        for record in trace:
            schedule = schedules.setdefault(record["epoch"], plan.schedule(record["epoch"]))
            step, micro = divmod(record["micro"], plan.gradient_accumulation_steps)
            assert record["indices"] == schedule[step, rank, micro].tolist()
        losses = [r["loss"] for r in trace]
        assert np.mean(losses[-4:]) < np.mean(losses[:4]) - 0.1, losses
    digests = {json.loads((out / f"summary_rank{r}.json").read_text())["parameter_digest"] for r in range(world)}
    assert len(digests) == 1, "ranks ended with different parameters"
