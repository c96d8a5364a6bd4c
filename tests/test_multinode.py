"""Multi-node for real: two test hosts on one machine (tests/multinode.py), one rank on each, CPU, ZeRO-3.

Jobs start on h0 through the user-facing wrappers launch/run_mpi.sh and
launch/run_deepspeed.sh with a hostfile naming h0 and h1; h1's rank is started
over the ssh stand-in with a clean environment, so everything it needs must be
forwarded the way a real multi-node job forwards it. The "shared filesystem" is
the machine's own: both hosts see the same folders, except where a test hides
one from h1.
"""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import pytest

from ds_cluster.data.dataset import read_jsonl, write_jsonl
from tests.launching import BIN, REPO, check, job_env
from tests.multinode import TwoHosts, cannot_make_hosts, make_two_hosts
from tests.training import assert_run_follows_plan, read_trace, train_args

pytestmark = [pytest.mark.multinode, pytest.mark.integration]

RUN_MPI = REPO / "launch" / "run_mpi.sh"
RUN_DEEPSPEED = REPO / "launch" / "run_deepspeed.sh"
LAUNCHERS = {"mpirun": RUN_MPI, "deepspeed": RUN_DEEPSPEED}
JOB_TIMEOUT_S = 240.0
FAILURE_LIMIT_S = 60.0  # a broken multi-node start must fail within this, not hang
STEPS = 8


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory) -> TwoHosts:
    reason = cannot_make_hosts()
    if reason:
        pytest.skip(reason)
    hosts = make_two_hosts(tmp_path_factory.mktemp("two_hosts"))
    yield hosts
    hosts.teardown()


def launch_on_h0(hosts: TwoHosts, launcher: str, script_args: Sequence[str], hostfile: Optional[Path] = None,
                 timeout: float = JOB_TIMEOUT_S) -> tuple[subprocess.CompletedProcess, float]:
    """`launch/run_<launcher>.sh --hostfile F --script SCRIPT ARGS...` started on h0; (result, seconds)."""
    if script_args[0] == "-m":
        target, args = ["--module", script_args[1]], list(script_args[2:])
    else:
        target, args = ["--script", str(script_args[0])], list(script_args[1:])
    command = ["bash", str(LAUNCHERS[launcher]), "--hostfile", str(hostfile or hosts.hostfile()), *target, *args]
    start = time.monotonic()
    result = hosts.run("h0", command, timeout=timeout)
    return result, time.monotonic() - start


def output_of(result: subprocess.CompletedProcess) -> str:
    return result.stdout + result.stderr


def test_hosts_reach_each_other_and_nothing_else(two_hosts):
    probe = ("hostname; ip -o link show | awk -F': ' '{print $2}' | cut -d@ -f1 | sort | tr '\\n' ' '; echo; "
             "ip route get 10.77.0.2 >/dev/null && echo peer-reachable; "
             "ip route get 8.8.8.8 2>&1; ip route show default | wc -l; ssh -o BatchMode=yes h1 hostname")
    result = two_hosts.run("h0", ["sh", "-c", probe], timeout=30)
    lines = result.stdout.splitlines()
    assert lines[0] == "h0" and lines[1].split() == ["lo", "mnv"], result.stdout
    assert "peer-reachable" in lines and "Network is unreachable" in result.stdout
    assert lines[-2:] == ["0", "h1"], result.stdout  # no default route; h1 has its own hostname


@pytest.fixture(scope="module")
def mpirun_run(two_hosts, small_job, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """One uninterrupted two-host ZeRO-3 fine-tune through launch/run_mpi.sh (also the resume reference)."""
    out = tmp_path_factory.mktemp("mpirun_two_hosts")
    result, _ = launch_on_h0(two_hosts, "mpirun", train_args(small_job, "zero3.json", out, "--max-steps", str(STEPS)))
    return out, result


def test_mpirun_hostfile_zero3_trains_on_the_plan(mpirun_run):
    out, result = mpirun_run
    check(result)
    assert_run_follows_plan(out)
    # Rank 0's address came from MPI discovery on the hosts' link, not loopback.
    assert "master 10.77.0.1:" in output_of(result), output_of(result)[-3000:]


@pytest.fixture(scope="module")
def resumed_run(two_hosts, small_job, mpirun_run, tmp_path_factory):
    """The same fine-tune stopped after a checkpoint (launch/run_mpi.sh --max-steps N/2 --save-every N/2), then
    relaunched with --resume through launch/run_deepspeed.sh: the checkpoint, not the launcher, carries the sequence.

    The relaunch is also this module's deepspeed-launcher run (one two-host job less on a 2-core machine)."""
    out = tmp_path_factory.mktemp("resumed_two_hosts")
    steps = ("--max-steps", str(STEPS))
    stopped, _ = launch_on_h0(two_hosts, "mpirun",
                              train_args(small_job, "zero3.json", out, "--max-steps", str(STEPS // 2), "--save-every",
                                         str(STEPS // 2)))
    check(stopped)
    resumed, _ = launch_on_h0(two_hosts, "deepspeed", train_args(small_job, "zero3.json", out, *steps, "--resume"))
    return out, resumed


def test_deepspeed_launcher_hostfile_zero3_trains_on_the_plan(resumed_run):
    out, resumed = resumed_run
    check(resumed)
    output = output_of(resumed)
    assert "cmd = mpirun" in output, output[-3000:]  # the launcher's openmpi backend started the ranks
    assert f"resumed at step {STEPS // 2}" in output, output[-3000:]
    assert_run_follows_plan(out)


def test_resume_across_hosts_continues_the_exact_sequence(mpirun_run, resumed_run):
    (whole, _), (parts, resumed) = mpirun_run, resumed_run
    check(resumed)
    for rank in range(2):
        expected, continued = read_trace(whole, rank), read_trace(parts, rank)
        assert [r["indices"] for r in continued] == [r["indices"] for r in expected], f"rank {rank}"
        assert np.allclose([r["loss"] for r in continued], [r["loss"] for r in expected], rtol=0, atol=1e-6)


def _analyze_available() -> Optional[str]:
    """Why `ds-cluster analyze` cannot be tested yet, or None."""
    if not (BIN / "ds-cluster").exists():
        return "the ds-cluster console script is not installed in this venv"
    help_run = subprocess.run([str(BIN / "ds-cluster"), "analyze", "--help"], capture_output=True, text=True,
                              timeout=60, env=job_env())
    return None if help_run.returncode == 0 else f"`ds-cluster analyze` is not available: {help_run.stderr[-500:]}"


def test_feature_extraction_split_across_hosts_matches_one_host(two_hosts, small_job, tmp_path):
    reason = _analyze_available()
    if reason:
        pytest.skip(reason)
    records = read_jsonl(small_job / "train.jsonl")
    write_jsonl(records[::8][:64], tmp_path / "data.jsonl")  # every family, 64 samples
    config = json.loads((REPO / "ds_configs" / "zero3.json").read_text())
    config["data_efficiency"]["data_sampling"]["cluster_sampling"] = {
        "enabled": True, "num_clusters": "auto", "kmeans_n_init": 2, "seed": 5}
    (tmp_path / "zero3.json").write_text(json.dumps(config))

    def analyze_args(out: Path) -> list[str]:
        return [str(BIN / "ds-cluster"), "analyze", "--deepspeed", str(tmp_path / "zero3.json"),
                "--model", str(small_job / "model"),
                "--data", str(tmp_path / "data.jsonl"), "--out", str(out), "--kind", "proxy", "--batch-size", "8",
                "--shard-size", "16", "--no-progress"]

    # One host, two ranks, through the same wrapper on loopback.
    one_host, two = tmp_path / "one_host", tmp_path / "two_hosts"
    script, *args = analyze_args(one_host)
    check(subprocess.run(["bash", str(RUN_MPI), "-np", "2", "--script", script, *args], cwd=REPO,
                         env=job_env(), capture_output=True, text=True, timeout=JOB_TIMEOUT_S))
    check(launch_on_h0(two_hosts, "mpirun", analyze_args(two))[0])
    summary = json.loads((two / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["zero_stage"] == 3
    np.testing.assert_allclose(np.load(two / "features.npy"), np.load(one_host / "features.npy"), rtol=0, atol=1e-6)
    for name in ("labels.npy", "empty_mask.npy"):
        np.testing.assert_array_equal(np.load(two / name), np.load(one_host / name), err_msg=name)


@pytest.mark.parametrize("launcher", ["mpirun", "deepspeed"])
def test_hostfile_naming_a_missing_host_fails_fast(two_hosts, small_job, tmp_path, launcher):
    hostfile = two_hosts.hostfile(("h0", "nosuchhost"), name="bad_hostfile")
    result, elapsed = launch_on_h0(two_hosts, launcher, train_args(small_job, "zero3.json", tmp_path),
                                   hostfile=hostfile, timeout=FAILURE_LIMIT_S + 30)
    output = output_of(result)
    assert result.returncode != 0, output[-3000:]
    assert elapsed < FAILURE_LIMIT_S, f"took {elapsed:.0f} s"
    assert "Could not resolve hostname nosuchhost" in output, output[-3000:]
    assert not (tmp_path / "trace").exists()


def test_rank_that_cannot_see_the_shared_folder_fails_on_every_rank(two_hosts, small_job, tmp_path):
    shared = tmp_path / "shared"
    (shared / "analysis").mkdir(parents=True)
    np.save(shared / "analysis" / "features.npy", np.load(small_job / "analysis" / "features.npy"))
    args = train_args(small_job, "zero3.json", tmp_path / "out", "--max-steps", "2")
    args[args.index("--analysis") + 1] = str(shared / "analysis")
    with two_hosts.hide("h1", shared):
        result, elapsed = launch_on_h0(two_hosts, "mpirun", args, timeout=FAILURE_LIMIT_S + 60)
    output = output_of(result)
    assert result.returncode != 0, output[-3000:]
    assert elapsed < FAILURE_LIMIT_S, f"took {elapsed:.0f} s"
    message = f"{shared} is not shared between the ranks: rank 1 on host h1 cannot see the file rank 0 (host h0)"
    assert output.count(message) >= 2, output[-3000:]  # raised on both ranks, neither left waiting
    assert not (tmp_path / "out" / "trace").exists()
    assert not list(shared.glob(".ds_cluster_shared_check.*")), "the token file was left behind"
