"""Helpers for tests that run the training script (python -m ds_cluster.train): arguments, traces, checks."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from ds_cluster import Plan
from ds_cluster.data.dataset import read_jsonl, write_jsonl
from bench.toy.models import base_model_path
from bench.toy.tasks import DEFAULT_DATA
from tests.launching import REPO

# What python runs (`python -m ds_cluster.train`); tests/launching.py turns it into the launchers' forms.
TRAIN = ["-m", "ds_cluster.train"]
# Optimizer steps of the session's shared uninterrupted runs (conftest.uninterrupted_run) and of the runs
# compared with them.
SHARED_RUN_STEPS = 8


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


def assert_run_follows_plan(out: Path, world: int = 2, loss_falls: bool = True) -> None:
    """Each rank trained on exactly its plan indices, step by step; the loss fell; ranks agree."""
    plan = Plan.load(out / "plan")
    schedules: dict[int, np.ndarray] = {}
    for rank in range(world):
        trace = read_trace(out, rank)
        assert trace, f"rank {rank} trained on nothing"
        for record in trace:
            schedule = schedules.setdefault(record["epoch"], plan.epoch_layout(record["epoch"]))
            step, micro = divmod(record["micro"], plan.gradient_accumulation_steps)
            assert record["indices"] == schedule[step, rank, micro].tolist()
        losses = [r["loss"] for r in trace]
        if loss_falls:
            assert np.mean(losses[-4:]) < np.mean(losses[:4]) - 0.1, losses
    digests = {json.loads((out / f"summary_rank{r}.json").read_text())["parameter_digest"] for r in range(world)}
    assert len(digests) == 1, "ranks ended with different parameters"


# --------------------------------------------------------------------------- one step's gradient
def write_gradient_job(root: Path, reduction: str) -> None:
    """`root/ds_config.json` and `root/analysis` for the one-step gradient workers (grad_worker.py through
    the DeepSpeed hook, hf_grad_worker.py through ClusterTrainer): 24 samples in clusters of 12/8/4, a
    "min" budget keeping 12 = one global batch of 2 ranks x micro 2 x 3 accumulation steps, SGD at lr 1
    and no clipping, so the step is the raw gradient."""
    (root / "analysis").mkdir()
    np.save(root / "analysis" / "labels.npy", GRADIENT_JOB_LABELS)
    # DeepSpeed clips gradients at 1.0 by default; off here so the step is the raw gradient.
    config = {"gradient_clipping": 0.0, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
              "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "SGD", "params": {"lr": 1.0}},
              "data_efficiency": {"enabled": True, "data_sampling": {
                  "enabled": True, "cluster_sampling": gradient_job_block(root, reduction)}}}
    (root / "ds_config.json").write_text(json.dumps(config))


GRADIENT_JOB_LABELS = np.repeat([0, 1, 2], [12, 8, 4])


def gradient_job_block(root: Path, reduction: str) -> dict:
    return {"enabled": True, "budget_mode": "min", "selection": "random", "allocation": "stratified",
            "weighting": "cluster", "analysis_path": str(root / "analysis"), "seed": 3, "loss_reduction": reduction}


def assert_step_is_the_reference_gradient(root: Path, reduction: str) -> None:
    """The saved step (`root/delta.npz`, parameters before minus after) equals the gradient by hand.

    "sample": sum_c (n_c / N) mean over c's kept samples of their mean token loss; "token": the weighted
    token losses summed over the global batch's response tokens, over their number.
    """
    import torch

    from ds_cluster import ClusterSamplingConfig
    from tests.planning import plan_of
    from ds_cluster.loader.loss import token_loss_sums
    from tests.workers.feature_fixtures import tiny_llama, token_dataset

    delta = np.load(root / "delta.npz")
    plan = plan_of(None, ClusterSamplingConfig.from_dict(gradient_job_block(root, reduction)), world_size=2,
                      micro_batch_size=2, gradient_accumulation_steps=3, labels=GRADIENT_JOB_LABELS)
    assert plan.num_kept == plan.global_batch_size == 12
    model = tiny_llama(seed=0)
    data = token_dataset(len(GRADIENT_JOB_LABELS), seed=1)
    selected = plan.selected
    batch = {k: torch.stack([data[i][k] for i in selected]) for k in ("input_ids", "attention_mask", "labels")}
    sums, counts = token_loss_sums(model(input_ids=batch["input_ids"],
                                         attention_mask=batch["attention_mask"]).logits, batch["labels"])
    weights = torch.tensor(plan.weights[selected], dtype=torch.float32)
    assert len(set(counts.tolist())) > 1  # answers of different lengths: the two reductions differ
    if reduction == "sample":
        ((sums / counts) * weights).mean().backward()
    else:
        ((sums * weights).sum() / counts.sum()).backward()
    for name, param in model.named_parameters():
        assert np.allclose(delta[name], param.grad.numpy(), rtol=0, atol=1e-5), name


def assert_trainer_follows_plan(out: Path, plan: Plan, max_steps: int, world: int = 2) -> None:
    """A Trainer run's traces (one record per micro-batch) are each rank's plan batches, step by step,
    across epoch boundaries."""
    accumulation = plan.gradient_accumulation_steps
    micro_per_epoch = plan.steps_per_epoch * accumulation
    schedules = {epoch: plan.epoch_layout(epoch) for epoch in range(max_steps // plan.steps_per_epoch + 1)}
    for rank in range(world):
        trace = read_trace(out, rank)
        assert len(trace) == max_steps * accumulation, f"rank {rank} trained {len(trace)} micro-batches"
        for number, record in enumerate(trace):
            epoch, in_epoch = divmod(number, micro_per_epoch)
            step, micro = divmod(in_epoch, accumulation)
            assert record["indices"] == schedules[epoch][step, rank, micro].tolist(), (rank, number)
            assert record["step"] == number // accumulation
