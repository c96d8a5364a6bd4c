"""The DeepSpeed hook end to end: real launchers (deepspeed, mpirun), 2 ranks on CPU, ZeRO 0-3, fp32/bf16, exact
resume, and the block disabled (plain DeepSpeed)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from tests.launching import REPO, check, run_deepspeed, run_mpirun, run_single, shm_buffers
from tests.training import (SHARED_RUN_STEPS, TRAIN, assert_run_follows_plan, assert_step_is_the_reference_gradient,
                            read_trace, train_args, write_gradient_job)

pytestmark = pytest.mark.integration


def _stage_precision_matrix(fp32_from_stage: int) -> list:
    """Every ZeRO stage x precision: half of them by default, the other half marked slow (`-m slow`).

    The deepspeed launcher runs fp32 at stages 2 and 3 by default (the session's shared uninterrupted runs,
    which resume and SIGKILL tests compare against) and bf16 at 0 and 1; mpirun the opposite halves. So the
    default suite still runs every stage under both launchers, both precisions under both, and every stage
    with both precisions across the two."""
    return [pytest.param(stage, precision,
                         marks=() if (precision == "fp32") == (stage >= fp32_from_stage) else pytest.mark.slow)
            for stage in (0, 1, 2, 3) for precision in ("fp32", "bf16")]


def _bf16_or_own_run(small_job, tmp_path, stage, precision, uninterrupted_run) -> Path:
    """The shared uninterrupted fp32 run of this stage, else a run of its own (bf16, or fp32 with -m slow)."""
    if precision == "fp32" and stage >= 2:
        return uninterrupted_run(stage)
    before = shm_buffers()
    check(run_deepspeed(train_args(small_job, f"zero{stage}.json", tmp_path, "--max-steps", str(SHARED_RUN_STEPS),
                                   *(["--bf16"] if precision == "bf16" else [])), timeout=300))
    (tmp_path / "shm_left.json").write_text(json.dumps(sorted(str(path) for path in shm_buffers() - before)))
    return tmp_path


@pytest.mark.parametrize("stage,precision", _stage_precision_matrix(2))
def test_deepspeed_launcher_trains_on_the_plan(small_job, tmp_path, stage, precision, uninterrupted_run):
    out = _bf16_or_own_run(small_job, tmp_path, stage, precision, uninterrupted_run)
    assert_run_follows_plan(out)
    # DeepSpeed's CPU shm all-reduce leaks ~66 MB of /dev/shm per rank and job; ds_cluster unlinks it.
    assert json.loads((out / "shm_left.json").read_text()) == []


@pytest.mark.parametrize("stage,precision", [pytest.param(*p.values, marks=() if p.marks else pytest.mark.slow)
                                             for p in _stage_precision_matrix(2)])
def test_mpirun_trains_on_the_plan(small_job, tmp_path, stage, precision):
    extra = ["--max-steps", str(SHARED_RUN_STEPS)] + (["--bf16"] if precision == "bf16" else [])
    before = shm_buffers()
    result = check(run_mpirun(train_args(small_job, f"zero{stage}.json", tmp_path, *extra), timeout=300))
    assert_run_follows_plan(tmp_path)
    # The plan's k-means (the analysis holds features only) ran in a child: rank 0 keeps no scikit-learn imports.
    assert "in a child process (scikit-learn's imports stay out of this rank)" in result.stdout + result.stderr
    # DeepSpeed's CPU shm all-reduce leaks ~66 MB of /dev/shm per rank and job; ds_cluster unlinks it.
    assert shm_buffers() - before == set()


def test_zero3_offload_config_trains(small_job, tmp_path):
    result = check(run_single(train_args(small_job, "zero3_offload.json", tmp_path, "--max-steps", "3"), timeout=300))
    assert "done: 3 steps" in result.stdout + result.stderr


# With -m slow: a clean stop and resume at ZeRO-2 and 3 (by default, exact resume is tests/test_faults.py's ZeRO-3
# run resumed after a SIGKILL, against the same shared run). The uninterrupted run is the session's shared one
# (deepspeed launcher); the interrupted one and its resumption go through mpirun: the checkpoint, not the launcher,
# carries the sequence.
@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_resume_continues_the_exact_sequence(small_job, tmp_path, stage, uninterrupted_run):
    config, steps = f"zero{stage}.json", ("--max-steps", str(SHARED_RUN_STEPS))
    whole, parts = uninterrupted_run(stage), tmp_path / "parts"
    # Stopped after 3 steps and their checkpoint (constant learning rate: the run's length changes nothing else).
    check(run_mpirun(train_args(small_job, config, parts, "--max-steps", "3", "--save-every", "3"), timeout=300))
    check(run_mpirun(train_args(small_job, config, parts, *steps, "--resume"), timeout=300))
    for rank in range(2):
        expected, resumed = read_trace(whole, rank), read_trace(parts, rank)
        assert [r["indices"] for r in resumed] == [r["indices"] for r in expected]
        assert np.allclose([r["loss"] for r in resumed], [r["loss"] for r in expected], rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def gradient_jobs(tmp_path_factory) -> dict:
    """One optimizer step per loss reduction, both in one 2-rank launch (grad_worker.py)."""
    roots = {reduction: tmp_path_factory.mktemp(f"grad_{reduction}") for reduction in ("sample", "token")}
    for reduction, root in roots.items():
        write_gradient_job(root, reduction)
    outs = [arg for root in roots.values() for arg in ("--out", str(root))]
    check(run_mpirun([str(REPO / "tests" / "workers" / "grad_worker.py"), *outs], timeout=300))
    return roots


@pytest.mark.parametrize("reduction", ["sample", "token"])
def test_weighted_loss_gradient_is_the_stratified_full_data_estimate(gradient_jobs, reduction):
    """One step of 2 ranks x 3 accumulation steps = the whole kept subset, against the gradient by hand.

    "sample": sum_c (n_c / N) mean over c's kept samples of their mean token loss; "token": the weighted
    token losses summed over the global batch's response tokens, over their number.
    """
    assert_step_is_the_reference_gradient(gradient_jobs[reduction], reduction)


def _failing_run(small_job: Path, tmp_path: Path, mutate) -> str:
    config = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    mutate(config)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(config))
    out = tmp_path / "out"
    args = train_args(small_job, "zero2.json", out, "--max-steps", "2")
    args[args.index("--deepspeed") + 1] = str(path)
    result = run_mpirun(args, timeout=240)
    assert result.returncode != 0
    assert not (out / "checkpoints").exists() and not (out / "trace").exists(), "a failed start wrote files"
    return result.stdout + result.stderr


def test_curriculum_and_cluster_sampling_together_fail_on_every_rank(small_job, tmp_path):
    def enable_curriculum(config):
        config["data_efficiency"]["data_sampling"]["curriculum_learning"] = {"enabled": True}

    output = _failing_run(small_job, tmp_path, enable_curriculum)
    assert output.count("curriculum_learning and cluster_sampling are both enabled") >= 2, output[-3000:]


def test_analysis_of_other_data_fails_on_every_rank(small_job, tmp_path):
    other = tmp_path / "other_analysis"
    other.mkdir()
    np.save(other / "features.npy", np.ones((17, 4), dtype=np.float32))

    def point_elsewhere(config):
        config["data_efficiency"]["data_sampling"]["cluster_sampling"]["analysis_path"] = str(other)

    # --analysis on the command line wins over the config, so drop it for this run.
    config = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    point_elsewhere(config)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(config))
    args = [*TRAIN, "--deepspeed", str(path), "--model", str(small_job / "model"),
            "--data", str(small_job / "train.jsonl"),
            "--output-dir", str(tmp_path / "out"), "--max-length", "64"]
    result = run_mpirun(args, timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert output.count("has 17 rows but the training dataset has") >= 2, output[-3000:]
    assert not (tmp_path / "out").exists()


def test_global_batch_larger_than_kept_subset_fails_before_training(small_job, tmp_path):
    def huge_batch(config):
        config["train_micro_batch_size_per_gpu"] = 512

    output = _failing_run(small_job, tmp_path, huge_batch)
    assert output.count("smaller than one global batch") >= 2, output[-3000:]


def test_without_the_block_deepspeed_is_unchanged(small_job, tmp_path):
    config = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    del config["data_efficiency"]
    path = tmp_path / "plain.json"
    path.write_text(json.dumps(config))
    script = tmp_path / "plain.py"
    script.write_text(
        "import json, sys, torch, deepspeed, ds_cluster\n"
        "from deepspeed.runtime.dataloader import DeepSpeedDataLoader\n"
        "ds_cluster.install()\n"
        "model = torch.nn.Linear(4, 2)\n"
        "data = [(torch.randn(4), torch.tensor(0)) for _ in range(32)]\n"
        f"engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), "
        f"training_data=data, config=json.load(open({str(path)!r})))\n"
        "assert isinstance(loader, DeepSpeedDataLoader), type(loader)\n"
        "print('PLAIN-OK')\n"
    )
    result = check(run_single([str(script)], timeout=240))
    assert "PLAIN-OK" in result.stdout


def test_training_script_with_the_block_disabled_is_plain_deepspeed(small_job, tmp_path):
    """The run a user makes first, to compare: the same script and config with `"enabled": false` trains on
    DeepSpeed's own loader (every record once per epoch, split over the ranks), with no analysis and no plan."""
    config = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    config["data_efficiency"]["data_sampling"]["cluster_sampling"]["enabled"] = False
    path = tmp_path / "disabled.json"
    path.write_text(json.dumps(config))
    out = tmp_path / "out"
    args = train_args(small_job, "zero2.json", out, "--epochs", "1")
    args[args.index("--deepspeed") + 1] = str(path)
    args[args.index("--analysis") + 1] = str(tmp_path / "analysis")
    check(run_deepspeed(args, timeout=300))
    records = len((small_job / "train.jsonl").read_text().splitlines())
    micro_batches = math.ceil(math.ceil(records / 2) / config["train_micro_batch_size_per_gpu"])  # DistributedSampler's
    steps = micro_batches // config["gradient_accumulation_steps"]
    summaries = [json.loads((out / f"summary_rank{rank}.json").read_text()) for rank in range(2)]
    assert [summary["steps"] for summary in summaries] == [steps, steps]
    assert summaries[0]["parameter_digest"] == summaries[1]["parameter_digest"]
    assert summaries[0]["analysis_timings"] == {}
    assert not (out / "plan").exists() and not (tmp_path / "analysis").exists()
    for rank in range(2):
        trace = read_trace(out, rank)
        assert len(trace) == steps * config["gradient_accumulation_steps"]
        assert all(record["indices"] is None for record in trace), "a batch carried ds_cluster's sample_index"
        losses = [record["loss"] for record in trace]
        assert np.mean(losses[-4:]) < np.mean(losses[:4]), losses
