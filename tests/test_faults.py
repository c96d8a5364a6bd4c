"""Faults on 2 ranks on CPU: a rank killed mid-training, ranks given different inputs, a full or read-only disk.

A SIGKILL of one rank during feature extraction, then a rerun that computes only
the unfinished shards, is tests/test_features_distributed.py
::test_killed_run_resumes_only_unfinished_shards (not repeated here).
Faults are injected by tests/workers/fault_worker.py around the training script (ds_cluster.train);
the library and the training script have no test-only code paths.
"""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from ds_cluster.analysis.folder import AnalysisDir
from ds_cluster.data.dataset import read_jsonl, write_jsonl
from ds_cluster.planning.plan import Plan
from tests.launching import REPO, check, run_deepspeed, run_mpirun
from tests.test_bad_inputs import assert_failed_on_every_rank, snapshot
from tests.training import SHARED_RUN_STEPS, read_trace, train_args
from tests.workers.fault_worker import KILL_AFTER_SHARD_VAR, KILL_AFTER_STEP_VAR, KILL_RANK_VAR, RANK_ARGS_VAR

WORKER = str(REPO / "tests" / "workers" / "fault_worker.py")
# A mismatch between ranks must end the job on every rank within this, not hang until a collective times out.
DISAGREE_WITHIN_S = 60.0


def worker_args(small_job: Path, out: Path, *extra: str, config: str = "zero2.json") -> list[str]:  # noqa: F811
    """train.py's arguments for the small job, started through the fault-injecting wrapper."""
    args = train_args(small_job, config, out, *extra)
    return [WORKER, *args[2:]]  # in place of `-m ds_cluster.train`


def _timed(args: list[str], launcher=run_mpirun, **options: Any) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    result = launcher(args, **options)
    return result, time.monotonic() - started


# ------------------------------------------------------------------------------------------ SIGKILL, then resume
@pytest.mark.integration
def test_rank_killed_after_a_checkpoint_resumes_to_the_uninterrupted_run(small_job, tmp_path,  # noqa: F811
                                                                          uninterrupted_run):
    """ZeRO-3 (its partitioned state is the hardest to resume): the uninterrupted run is the session's shared one
    (the deepspeed launcher); this is also the default suite's exact-resume test (tests/test_hook.py's clean stop
    and resume runs with -m slow)."""
    whole, parts, steps = uninterrupted_run(3), tmp_path / "parts", ("--max-steps", str(SHARED_RUN_STEPS))

    # Rank 1 dies (SIGKILL) right after optimizer step 3; the last checkpoint is step 2's. The deepspeed launcher
    # must then end the other rank.
    killed, elapsed = _timed(worker_args(small_job, parts, *steps, "--save-every", "2", config="zero3.json"),
                             launcher=run_deepspeed, timeout=300, env_extra={KILL_AFTER_STEP_VAR: "3"})
    assert killed.returncode != 0, killed.stdout[-3000:]
    assert elapsed < 120, f"the surviving rank was left running for {elapsed:.0f} s"
    assert (parts / "checkpoints" / "latest").read_text().strip() == "global_step2"
    gas = Plan.load(parts / "plan").gradient_accumulation_steps
    micro_steps_saved = 2 * gas
    lines_before = {rank: len(read_trace(parts, rank)) for rank in range(2)}
    assert all(count >= micro_steps_saved for count in lines_before.values()), lines_before

    # Relaunched (through mpirun: the checkpoint, not the launcher, carries the sequence).
    check(run_mpirun(train_args(small_job, "zero3.json", parts, *steps, "--save-every", "2", "--resume"),
                     timeout=300))
    for rank in range(2):
        expected, trace = read_trace(whole, rank), read_trace(parts, rank)
        # What the checkpoint holds, then what the resumed run appended (the killed run's extra micro-steps,
        # past the checkpoint, are lost work and are redone).
        replayed = trace[:micro_steps_saved] + trace[lines_before[rank]:]
        assert [r["indices"] for r in replayed] == [r["indices"] for r in expected], f"rank {rank}"
        assert np.allclose([r["loss"] for r in replayed], [r["loss"] for r in expected], rtol=0, atol=1e-6)
    summaries = [json.loads((parts / f"summary_rank{rank}.json").read_text()) for rank in range(2)]
    whole_summary = json.loads((whole / "summary_rank0.json").read_text())
    assert {s["parameter_digest"] for s in summaries} == {whole_summary["parameter_digest"]}


# ------------------------------------------------------------------------------------------ ranks that disagree
def _reversed_data(small_job: Path, tmp_path: Path) -> Path:  # noqa: F811
    """The same records in reverse order: the same N, so only a content check can tell."""
    path = tmp_path / "reversed.jsonl"
    write_jsonl(list(reversed(read_jsonl(small_job / "train.jsonl"))), path)
    return path


def _other_seed_config(small_job: Path, tmp_path: Path) -> Path:  # noqa: F811
    config = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    config["data_efficiency"]["data_sampling"]["cluster_sampling"]["seed"] = 99
    path = tmp_path / "other_seed.json"
    path.write_text(json.dumps(config))
    return path


@pytest.mark.integration
@pytest.mark.parametrize("option,make_value,phrase", [
    ("--data", _reversed_data, "ranks disagree on the training data"),
    ("--deepspeed", _other_seed_config, "ranks disagree on the cluster plan fingerprint"),
], ids=["other data on rank 1", "other cluster_sampling seed on rank 1"])
def test_rank_given_different_input_fails_every_rank_instead_of_hanging(
        small_job, tmp_path, option, make_value, phrase):  # noqa: F811
    per_rank = {"1": {option: str(make_value(small_job, tmp_path))}}
    out = tmp_path / "out"
    result, elapsed = _timed(worker_args(small_job, out, "--max-steps", "2"), timeout=DISAGREE_WITHIN_S + 60,
                             env_extra={RANK_ARGS_VAR: json.dumps(per_rank)})
    output = assert_failed_on_every_rank(result, phrase, elapsed)
    assert elapsed < DISAGREE_WITHIN_S, f"took {elapsed:.0f} s"
    assert "ranks [1] differ from rank 0" in output and "Every rank must see the same data" in output
    assert not out.exists(), "a failed start wrote files"


# ------------------------------------------------------------------------------------------ full / read-only disk
def _mount_tmpfs(folder: Path, options: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()}); needs root in a mount-capable container")


@pytest.fixture
def small_disk(tmp_path) -> Iterator[Path]:
    """A 128 KiB filesystem: room for a small previous analysis, not for a new one beside it."""
    folder = tmp_path / "disk"
    _mount_tmpfs(folder, "size=128k")
    yield folder
    subprocess.run(["umount", "-l", str(folder)], check=False)


def _previous_analysis(folder: Path) -> Path:
    analysis = folder / "analysis"
    analysis.mkdir()
    np.save(analysis / "features.npy", np.ones((100, 16), np.float32))
    (analysis / "manifest.json").write_text(json.dumps({"format_version": 1, "note": "the previous analysis"}))
    return analysis


@pytest.mark.integration
def test_full_disk_while_writing_the_analysis_keeps_the_previous_one(small_job, small_disk, tmp_path):  # noqa: F811
    previous = _previous_analysis(small_disk)
    before = snapshot(small_disk)
    # The feature store lives elsewhere, so the disk fills exactly while the analysis directory is written.
    args = ["-m", "ds_cluster.cli", "analyze", "--deepspeed", str(REPO / "ds_configs" / "zero2.json"),
            "--model", str(small_job / "model"), "--data", str(small_job / "train.jsonl"), "--out", str(previous),
            "--store", str(tmp_path / "store"), "--kind", "proxy", "--batch-size", "32", "--max-length", "64",
            "--no-progress"]
    result, elapsed = _timed(args, timeout=240)
    assert_failed_on_every_rank(result, "No space left on device", elapsed)
    assert snapshot(small_disk) == before, "the previous analysis changed, or a partial one was left behind"


def test_read_only_disk_while_writing_the_analysis_keeps_the_previous_one(tmp_path):
    disk = tmp_path / "disk"
    _mount_tmpfs(disk, "size=256k")
    try:
        previous = _previous_analysis(disk)
        before = snapshot(disk)
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        with pytest.raises(OSError, match="Read-only file system"):
            AnalysisDir(previous).write({"features.npy": np.zeros((4, 2), np.float32)}, {}, {}, tmp_path / "store")
        assert snapshot(disk) == before
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_full_disk_in_publish_names_the_space_needed_and_keeps_the_previous_one(small_disk, tmp_path):
    previous = _previous_analysis(small_disk)
    before = snapshot(small_disk)
    with pytest.raises(OSError, match=r"No space left on device: \d+ bytes free in .*needs about 400000.*"
                                      r"choose another --out\. The previous analysis there, if any, is unchanged"):
        AnalysisDir(previous).write({"features.npy": np.zeros((1000, 100), np.float32)}, {}, {},
                                    tmp_path / "store")
    assert snapshot(small_disk) == before


# ------------------------------------------------------------------------------------------ selection in one launch
@pytest.mark.integration
def test_selection_in_the_training_job_resumes_after_a_kill_and_is_reused(small_job, tmp_path):  # noqa: F811
    """analysis_path with no analysis: the job computes it with its own engine; a kill mid-extraction resumes
    only the unfinished shards, and a later job reads the analysis instead of computing it."""
    config = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    analysis = tmp_path / "analysis"
    config["data_efficiency"]["data_sampling"]["cluster_sampling"].update(analysis_path=str(analysis),
                                                                          budget_ratio=0.5)
    config_path = tmp_path / "ds.json"
    config_path.write_text(json.dumps(config))

    def job(out: Path, *extra: str) -> list[str]:
        args = train_args(small_job, "zero2.json", out, "--max-steps", "2", *extra)
        args[args.index("--deepspeed") + 1] = str(config_path)
        del args[args.index("--analysis"):args.index("--analysis") + 2]  # the config's analysis_path
        return args

    # Rank 0 dies right after its first finished shard (the small job is one shard of 512 samples).
    killed, _ = _timed([WORKER, *job(tmp_path / "killed")[2:]], timeout=300,
                       env_extra={KILL_AFTER_SHARD_VAR: "1", KILL_RANK_VAR: "0"})
    assert killed.returncode != 0
    store_markers = sorted((analysis / ".feature_store" / "shards").glob("*.done.json"))
    assert store_markers, "no shard was finished before the kill"
    assert not (analysis / "features.npy").exists()

    check(run_mpirun(job(tmp_path / "first"), timeout=300))
    summary = json.loads((tmp_path / "first" / "summary_rank0.json").read_text())
    analysis_summary = json.loads((analysis / "summary.json").read_text())
    assert summary["analysis_timings"]["wall"] > 0 and summary["analysis_timings"]["extract"] > 0
    # The finished shard is read back, not computed again.
    assert analysis_summary["reused_shards"] == [0] and analysis_summary["computed_shards"] == []
    assert Plan.load(tmp_path / "first" / "plan").num_kept < Plan.load(tmp_path / "first" / "plan").num_samples

    check(run_mpirun(job(tmp_path / "second"), timeout=300))
    assert json.loads((tmp_path / "second" / "summary_rank0.json").read_text())["analysis_timings"] == {}
    assert Plan.load(tmp_path / "second" / "plan").fingerprint() == Plan.load(tmp_path / "first" / "plan").fingerprint()


# ------------------------------------------------------------------------------------------ rendezvous
@pytest.mark.integration
def test_a_taken_rendezvous_port_under_mpirun_stops_every_rank_at_once(small_job, tmp_path):  # noqa: F811
    # Rank 0 cannot listen on MASTER_PORT (EADDRINUSE): without an abort, rank 1 waits out the rendezvous timeout
    # and rank 0 blocks in MPI's finalize (a suite run once hung 300 s on such a port).
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result, elapsed = _timed(train_args(small_job, "zero2.json", tmp_path, "--max-steps", "2"), timeout=300,
                                 env_extra={"MASTER_PORT": str(port)})
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert elapsed < DISAGREE_WITHIN_S, f"took {elapsed:.0f} s to stop"
    assert f"could not start the process group (MASTER_ADDR 127.0.0.1, MASTER_PORT {port})" in output
