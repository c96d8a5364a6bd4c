"""Start real DeepSpeed jobs from tests: the deepspeed launcher, mpirun, or one process.

Every process binds to loopback only (MASTER_ADDR=127.0.0.1, GLOO_SOCKET_IFNAME=lo,
Open MPI restricted to lo and shared memory) and runs under a timeout.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterable, Optional

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


from ds_cluster.distributed import free_port  # noqa: E402 - re-exported for the tests


def job_env(extra: Optional[dict] = None) -> dict:
    env = os.environ.copy()
    env.update(
        DS_ACCELERATOR="cpu",
        MASTER_ADDR="127.0.0.1",
        GLOO_SOCKET_IFNAME="lo",
        TORCH_EXTENSIONS_DIR=str(REPO / ".torch_extensions"),
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}",
    )
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(var, None)
    if extra:
        env.update(extra)
    return env


def _run(cmd: list[str], timeout: float, env_extra: Optional[dict], cwd: Optional[Path]) -> subprocess.CompletedProcess:
    result = subprocess.run(
        cmd, cwd=cwd or REPO, env=job_env(env_extra), capture_output=True, text=True, timeout=timeout
    )
    return result


def run_deepspeed(script_args: Iterable[str], nproc: int = 2, timeout: float = 300,
                  env_extra: Optional[dict] = None, cwd: Optional[Path] = None) -> subprocess.CompletedProcess:
    """`deepspeed --num_gpus N --master_port P script args...` (num_gpus is required on CPU).

    Arguments for python (`-m MODULE ...`) become the launcher's `--module MODULE ...`.
    """
    launcher = shutil.which("deepspeed", path=str(BIN)) or "deepspeed"
    script_args = list(script_args)
    if script_args[:1] == ["-m"]:
        script_args[0] = "--module"
    cmd = [launcher, "--num_gpus", str(nproc), "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), *script_args]
    return _run(cmd, timeout, env_extra, cwd)


def run_mpirun(script_args: Iterable[str], nproc: int = 2, timeout: float = 300,
               env_extra: Optional[dict] = None, cwd: Optional[Path] = None) -> subprocess.CompletedProcess:
    """`mpirun -np N` on loopback and shared memory, the script started with this venv's python."""
    port = str(free_port())
    forwarded = ["GLOO_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT", "DS_ACCELERATOR", "TORCH_EXTENSIONS_DIR",
                 "OMP_NUM_THREADS", "PATH", "PYTHONPATH", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE",
                 "TOKENIZERS_PARALLELISM", "PYTHONUNBUFFERED"]
    for key in (env_extra or {}):
        if key not in forwarded:
            forwarded.append(key)
    cmd = ["mpirun", "-np", str(nproc), "--allow-run-as-root", "--oversubscribe",
           "--mca", "btl", "self,vader", "--mca", "oob_tcp_if_include", "lo"]
    for var in forwarded:
        cmd += ["-x", var]
    cmd += [sys.executable, *script_args]
    extra = {"MASTER_PORT": port, **(env_extra or {})}
    return _run(cmd, timeout, extra, cwd)


def run_single(script_args: Iterable[str], timeout: float = 300, env_extra: Optional[dict] = None,
               cwd: Optional[Path] = None) -> subprocess.CompletedProcess:
    """One process with RANK=0 WORLD_SIZE=1 set, so DeepSpeed does not try MPI discovery."""
    extra = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_PORT": str(free_port()), **(env_extra or {})}
    return _run([sys.executable, *script_args], timeout, extra, cwd)


def check(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """Fail with the job's output when it did not exit 0."""
    if result.returncode != 0:
        raise AssertionError(
            f"job exited {result.returncode}\n--- stdout ---\n{result.stdout[-6000:]}\n--- stderr "
            f"---\n{result.stderr[-6000:]}"
        )
    return result


def shm_buffers() -> set:
    """DeepSpeed's CPU shm all-reduce buffers now in /dev/shm (each ~66 MB; none may outlive its job)."""
    return set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*"))
