"""Fixtures shared by the test modules."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.training import make_small_job

# The tests force the CPU explicitly, GPU or not (the library leaves the choice to DeepSpeed): the jobs they
# start get it from tests/launching.py, the processes here from this.
os.environ["DS_ACCELERATOR"] = "cpu"


@pytest.fixture(scope="session")
def small_job(tmp_path_factory) -> Path:
    """A 480-sample slice of the shipped data and a hand-made analysis, built once per test session."""
    return make_small_job(tmp_path_factory.mktemp("small_job"))


@pytest.fixture(scope="session")
def uninterrupted_run(small_job, tmp_path_factory):
    """The uninterrupted 8-step fine-tune of the small job under the deepspeed launcher, fp32, per ZeRO stage:
    started once per session and read by every test that checks or compares against it (the launcher
    matrix, exact resume, resume after a SIGKILL). `uninterrupted_run(stage)` gives its output folder;
    `shm_left.json` there lists the DeepSpeed shm buffers the job left in /dev/shm (none expected)."""
    import json

    from tests.launching import check, run_deepspeed, shm_buffers
    from tests.training import SHARED_RUN_STEPS, train_args

    runs: dict[int, Path] = {}

    def run(stage: int) -> Path:
        if stage not in runs:
            out = tmp_path_factory.mktemp(f"deepspeed_zero{stage}_fp32")
            before = shm_buffers()
            check(run_deepspeed(train_args(small_job, f"zero{stage}.json", out, "--max-steps", str(SHARED_RUN_STEPS)),
                                timeout=300))
            (out / "shm_left.json").write_text(json.dumps(sorted(str(path) for path in shm_buffers() - before)))
            runs[stage] = out
        return runs[stage]

    return run


@pytest.fixture(scope="session")
def job_made_analysis(small_job, tmp_path_factory) -> Path:
    """An analysis made the way the demo's is (launch/demo.sh): by the DeepSpeed hook in a 2-rank training job
    (python -m ds_cluster.train, the recommended preset of ds_configs/recommended.json) from a data file, before
    its first step. Returns the analysis folder."""
    from tests.launching import REPO, check, run_mpirun
    from tests.training import TRAIN

    out = tmp_path_factory.mktemp("job_made_analysis")
    check(run_mpirun([*TRAIN, "--deepspeed", str(REPO / "ds_configs" / "recommended.json"), "--model",
                      str(small_job / "model"), "--data", str(small_job / "train.jsonl"), "--analysis",
                      str(out / "analysis"), "--output-dir", str(out / "run"), "--max-length", "64", "--max-steps",
                      "1"], timeout=300))
    return out / "analysis"


@pytest.fixture(scope="session")
def adaptive_run(small_job, tmp_path_factory) -> Path:
    """The adaptive hook run of tests/test_adaptive_jobs.py, ZeRO-3, under the deepspeed launcher: 9 steps, 3
    windows, with DeepSpeed's CSV monitor on (OUT/monitor/job); read by the adaptive and the monitor tests."""
    import json

    from tests.launching import check, run_deepspeed
    from tests.test_adaptive_jobs import hook_args

    out = tmp_path_factory.mktemp("adaptive_whole")
    args = hook_args(small_job, out, 3)
    config = json.loads((out / "ds_config.json").read_text())
    config["csv_monitor"] = {"enabled": True, "output_path": str(out / "monitor"), "job_name": "job"}
    (out / "ds_config.json").write_text(json.dumps(config))
    check(run_deepspeed(args, timeout=300))
    return out
