"""`ds-cluster train`: run the training script (`python -m ds_cluster.train`) under a launcher."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ds_cluster.cli.common import FORMATTER, input_error

TRAIN_MODULE = "ds_cluster.train"
EXAMPLE = """\
examples:
  # 2 ranks on this node with the deepspeed launcher:
  ds-cluster train --deepspeed ds_configs/zero3.json --nproc 2 -- \\
      --model MODEL_DIR --data data/train.jsonl --analysis runs/analysis --output-dir runs/train --epochs 1

  # the same under mpirun, printed only:
  ds-cluster train --deepspeed ds_configs/zero3.json --launcher mpirun --nproc 2 --dry-run -- --model MODEL

  # one process, no launcher:
  ds-cluster train --deepspeed ds_configs/zero2.json --launcher none -- --model MODEL --max-steps 10

Everything after `--` goes to the training script (`python -m ds_cluster.train --help` lists it). On
one node the ranks talk over loopback (MASTER_ADDR 127.0.0.1, GLOO_SOCKET_IFNAME lo, Open MPI on lo
and shared memory). With --hostfile the loopback settings are left out: set MASTER_ADDR,
GLOO_SOCKET_IFNAME and the Open MPI interface options for your network, or use
launch/run_deepspeed.sh / launch/run_mpi.sh, which do.
"""
# Variables every mpirun rank needs (mpirun forwards only what -x names).
MPI_FORWARD = ("MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "DS_ACCELERATOR", "PATH", "PYTHONPATH",
               "TORCH_EXTENSIONS_DIR", "OMP_NUM_THREADS", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train", formatter_class=FORMATTER, epilog=EXAMPLE,
        help="run the training script (python -m ds_cluster.train) under the deepspeed launcher, mpirun, or alone",
        description="Build the launch command for the training script, print it, and run it; the exit\n"
                    "code is the job's. --dry-run prints the command only.")
    parser.add_argument("--deepspeed", required=True, metavar="CONFIG",
                        help="DeepSpeed config with a cluster_sampling block (passed to the script)")
    parser.add_argument("--launcher", choices=("deepspeed", "mpirun", "none"), default="deepspeed",
                        help="deepspeed (default): `deepspeed --num_gpus N`; mpirun: `mpirun -np N`; "
                             "none: one process")
    parser.add_argument("--nproc", type=int, default=None, metavar="N",
                        help="ranks on this node (default 2; with --hostfile: the hostfile's slots unless given)")
    parser.add_argument("--hostfile", default=None, metavar="FILE",
                        help="hosts and slots for a multi-node job (deepspeed: --launcher openmpi; mpirun: --hostfile)")
    parser.add_argument("--master-addr", default=None, metavar="ADDR",
                        help="rank 0's address (default 127.0.0.1 on one node; from MPI with --hostfile)")
    parser.add_argument("--master-port", type=int, default=None, metavar="PORT",
                        help="rank 0's port (default: a free port on one node, 29500 with --hostfile)")
    parser.add_argument("--script", default=None, metavar="PY",
                        help="your own training script instead of the module ds_cluster.train")
    parser.add_argument("--dry-run", action="store_true", help="print the command and do not run it")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="-- SCRIPT_ARGS",
                        help="arguments of the training script, after --")
    parser.set_defaults(handler=run)


def build_train_command(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """The command line and the environment additions for `ds-cluster train`."""
    from ds_cluster.distributed import free_port

    if args.script is not None and not Path(args.script).is_file():
        raise FileNotFoundError(f"--script {args.script} not found")
    script_args = list(args.script_args or [])
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    script_args = ["--deepspeed", str(args.deepspeed), *script_args]
    multinode = args.hostfile is not None
    nproc = args.nproc if args.nproc is not None else (None if multinode else 2)
    port = args.master_port or (29500 if multinode else free_port())
    env: dict[str, str] = {"MASTER_PORT": str(port)}
    if not multinode:
        # One node: everything on loopback, nothing leaves the machine.
        env.update(MASTER_ADDR=args.master_addr or "127.0.0.1", GLOO_SOCKET_IFNAME="lo")
    elif args.master_addr:
        env["MASTER_ADDR"] = args.master_addr
    # The accelerator is DeepSpeed's own choice (a GPU where there is one, else the CPU), or DS_ACCELERATOR.
    # The script as python runs it: a file, or the module.
    python_target = [args.script] if args.script else ["-m", TRAIN_MODULE]
    if args.launcher == "deepspeed":
        command = [_venv_tool("deepspeed")]
        if multinode:
            command += ["--hostfile", args.hostfile, "--launcher", "openmpi"]
        if nproc is not None:
            command += ["--num_gpus", str(nproc)]  # required on CPU: the device count would be the NUMA nodes
        if "MASTER_ADDR" in env:
            command += ["--master_addr", env["MASTER_ADDR"]]
        command += ["--master_port", str(port)]
        command += [args.script] if args.script else ["--module", TRAIN_MODULE]
        command += script_args
    elif args.launcher == "mpirun":
        # By name, not by full path: a full path puts its folder first on the ranks' PATH.
        command = ["mpirun"]
        if nproc is not None:
            command += ["-np", str(nproc)]
        if multinode:
            command += ["--hostfile", args.hostfile]
        else:
            command += ["--oversubscribe", "--mca", "btl", "self,vader", "--mca", "oob_tcp_if_include", "lo"]
        if os.geteuid() == 0:
            command += ["--allow-run-as-root"]
        names = {*env, *(name for name in MPI_FORWARD if name in os.environ)}
        for name in [n for n in MPI_FORWARD if n in names]:
            command += ["-x", name]
        command += [sys.executable, *python_target, *script_args]
    else:
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        command = [sys.executable, *python_target, *script_args]
    return command, env


def _venv_tool(name: str) -> str:
    # The launcher next to this Python (the venv's), else whatever PATH has.
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def run(args: argparse.Namespace) -> int:
    import shlex
    import subprocess

    try:
        command, env_additions = build_train_command(args)
    except FileNotFoundError as err:
        return input_error("train", err)
    shown_env = " ".join(f"{key}={shlex.quote(value)}" for key, value in sorted(env_additions.items()))
    sys.stdout.write(f"{shown_env} {shlex.join(command)}\n")
    sys.stdout.flush()
    if args.dry_run:
        return 0
    env = {**os.environ, **env_additions}
    if args.launcher == "mpirun" and os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return subprocess.run(command, env=env).returncode
