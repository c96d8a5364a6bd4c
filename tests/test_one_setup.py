"""One set-up for every trainer: no job failing at plan time leaves DeepSpeed's shared memory behind (2 ranks,
ZeRO-3, CPU). ClusterTrainer computing a missing analysis in its job as the hook does, and the hook and
ClusterTrainer training on the same sequence, are in tests/test_hf_trainer.py, beside the Trainer run they read."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launching import REPO, run_mpirun, shm_buffers
from tests.training import TRAIN

pytestmark = pytest.mark.integration

HF_WORKER = REPO / "tests" / "workers" / "hf_trainer_worker.py"
HOOK_WORKER = REPO / "tests" / "workers" / "hook_user_init_worker.py"
MAX_STEPS = 7  # 4 steps per epoch at budget 0.2: the sequence crosses an epoch boundary


def _config(job: Path, folder: Path, **block_keys) -> Path:
    """zero3.json with the block's analysis_path and budget set (as tests/test_hf_trainer.py's run)."""
    config = json.loads((REPO / "ds_configs" / "zero3.json").read_text())
    block = config["data_efficiency"]["data_sampling"]["cluster_sampling"]
    block.update(analysis_path=str(job / "analysis"), budget_ratio=0.2)
    block.update(block_keys)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "ds_config.json"
    path.write_text(json.dumps(config))
    return path


def _trainer(job: Path, config: Path, out: Path, max_steps: int = MAX_STEPS):
    return run_mpirun([str(HF_WORKER), "--deepspeed", str(config), "--model", str(job / "model"),
                          "--data", str(job / "train.jsonl"), "--out", str(out), "--max-steps", str(max_steps),
                          "--save-steps", "1000"], timeout=300)


def _hook(job: Path, config: Path, out: Path, max_steps: int = MAX_STEPS):
    return run_mpirun([*TRAIN, "--deepspeed", str(config), "--model", str(job / "model"),
                       "--data", str(job / "train.jsonl"), "--output-dir", str(out), "--max-length", "64",
                       "--trace", "--max-steps", str(max_steps), "--epochs", "3"], timeout=300)


@pytest.mark.parametrize("path", ["ds_cluster.train", "a user's hook script", "ClusterTrainer"])
def test_a_job_failing_at_plan_time_leaves_no_shared_memory(small_job: Path, tmp_path: Path, path: str):  # noqa: F811
    # 8 clusters of the slice keeping 4 samples in all: some cluster keeps none, an error at plan time.
    config = _config(small_job, tmp_path, budget_samples=4, num_clusters=8, allocation="stratified",
                     budget_mode="proportional", selection="random")
    before = shm_buffers()
    if path == "ds_cluster.train":
        result = _hook(small_job, config, tmp_path / "out")
    elif path == "ClusterTrainer":
        result = _trainer(small_job, config, tmp_path / "out")
    else:
        result = run_mpirun([str(HOOK_WORKER), "--deepspeed", str(config), "--model", str(small_job / "model"),
                             "--data", str(small_job / "train.jsonl")], timeout=300)
    assert result.returncode != 0
    assert "leaves some of the 8 clusters with no sample" in result.stdout + result.stderr  # the planner's error
    assert shm_buffers() - before == set()
