"""The `ds-cluster` command line: one function per subcommand, registered in SUBCOMMANDS.

Adding a subcommand = writing `add_<name>_parser(subparsers)` that calls
`subparsers.add_parser(...)`, declares its options and sets `handler=`, and
appending it to SUBCOMMANDS.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Sequence

if TYPE_CHECKING:  # the CLI imports the heavy modules only inside the command that needs them
    from ds_cluster.integrations.deepspeed import PlanInputs
    from ds_cluster.plan import Plan

logger = logging.getLogger(__name__)

_FORMATTER = argparse.RawDescriptionHelpFormatter


def _add_launcher_options(parser: argparse.ArgumentParser, default: object) -> None:
    # The deepspeed launcher passes --local_rank=N before the subcommand; accept it anywhere.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=default,
                        help="set by the deepspeed launcher; not needed by hand")


# --------------------------------------------------------------------------- analyze
ANALYZE_EXAMPLE = """\
examples:
  # 2 ranks, ZeRO-3, the tiny model on a JSONL file of Alpaca records:
  deepspeed --num_gpus 2 $(which ds-cluster) analyze --deepspeed ds_configs/zero3.json \\
      --model tiny --data data/train.jsonl --out runs/analysis

  # the same under Open MPI:
  mpirun -np 2 python $(which ds-cluster) analyze --deepspeed ds_configs/zero3.json \\
      --model tiny --data data/train.jsonl --out runs/analysis --kind lm_head --dim 1024

A rerun reuses the finished feature shards in OUT/.feature_store (or --store);
a rerun with other settings stops with an error naming them unless --recompute.
"""


def add_analyze_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "analyze", formatter_class=_FORMATTER, epilog=ANALYZE_EXAMPLE,
        help="extract per-sample gradient features with DeepSpeed, cluster them, write an analysis directory",
        description="Run on every rank (deepspeed launcher or mpirun): the ranks share one forward pass\n"
                    "over the data under the config's ZeRO stage; rank 0 clusters the features (K from the\n"
                    "config's cluster_sampling block, 'auto' = world size) and writes OUT atomically:\n"
                    "features.npy, labels.npy, centroids.npy, distances.npy, empty_mask.npy,\n"
                    "manifest.json, summary.json.")
    parser.add_argument("--deepspeed", required=True, metavar="CONFIG.json",
                        help="DeepSpeed JSON config; its ZeRO stage shards the model, its "
                             "data_efficiency.data_sampling.cluster_sampling block sets K, seed and features")
    parser.add_argument("--model", required=True, metavar="PATH_OR_TINY",
                        help="'tiny' (fresh seeded tiny Llama), 'tiny-base' (the cached pretrained tiny base) "
                             "or a local Hugging Face checkpoint folder")
    parser.add_argument("--data", required=True, metavar="DATA",
                        help="Alpaca-style JSONL file (instruction, input, output[, family]) or a "
                             "datasets save_to_disk folder")
    parser.add_argument("--out", required=True, metavar="DIR", help="analysis directory to write (replaced atomically)")
    parser.add_argument("--kind", choices=("proxy", "lm_head", "layers"), default=None,
                        help="feature: 'proxy' = mean (p_t - 1) h_t (the paper's, d = hidden size), 'lm_head' = "
                             "the exact output-layer gradient randomly projected to --dim (default: the config's "
                             "feature_kind)")
    parser.add_argument("--dim", type=int, default=None,
                        help="projected dimension for --kind lm_head (default: config feature_dim, else 1024)")
    parser.add_argument("--batch-size", type=int, default=8, help="samples per forward pass on each rank (default 8)")
    parser.add_argument("--max-length", type=int, default=None,
                        help="tokens per sample, longer ones are truncated (default: the dataset loader's)")
    parser.add_argument("--store", default=None, metavar="DIR",
                        help="feature store folder, visible to every rank (default OUT/.feature_store)")
    parser.add_argument("--shard-size", type=int, default=None,
                        help="samples per store shard: the work lost by a crash (default 512)")
    parser.add_argument("--recompute", action="store_true",
                        help="discard the feature store and recompute every feature")
    parser.add_argument("--model-seed", type=int, default=0, help="seed of --model tiny / tiny-base (default 0)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_launcher_options(parser, argparse.SUPPRESS)
    parser.set_defaults(handler=run_analyze_command)


def run_analyze_command(args: argparse.Namespace) -> int:
    from ds_cluster.analysis import run_analysis
    from ds_cluster.distributed import get_rank, init_distributed, shutdown
    from ds_cluster.features.store import DEFAULT_SHARD_SIZE

    init_distributed()
    try:
        summary = run_analysis(args.deepspeed, args.model, args.data, args.out, kind=args.kind, dim=args.dim,
                               batch_size=args.batch_size, max_length=args.max_length, store_dir=args.store,
                               recompute=args.recompute, shard_size=args.shard_size or DEFAULT_SHARD_SIZE,
                               model_seed=args.model_seed, show_progress=not args.no_progress)
    except (ValueError, FileNotFoundError) as err:
        # Bad input (config, data, a store made with other settings): a message, not a traceback.
        logger.error("analyze failed: %s", err)
        return 2
    finally:
        shutdown()
    if get_rank() == 0:
        purity = f", family purity {summary['purity']:.3f}" if "purity" in summary else ""
        logger.info("%s: %d samples (%d without response tokens), %s d=%d, cluster sizes %s%s", args.out,
                    summary["num_samples"], summary["num_empty"], summary["kind"], summary["dim"],
                    summary["cluster_sizes"], purity)
    return 0


# --------------------------------------------------------------------------- plan and report: shared inputs
def _add_plan_inputs(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--analysis", required=True, metavar="DIR",
                        help="analysis directory (features.npy and/or labels.npy), e.g. from `ds-cluster analyze`; "
                             "it replaces the config's cluster_sampling.analysis_path")
    parser.add_argument("--deepspeed", required=True, metavar="CONFIG.json",
                        help="DeepSpeed JSON config: its cluster_sampling block, micro batch and accumulation steps")
    parser.add_argument("--world-size", type=int, default=None, metavar="W",
                        help="data-parallel ranks (default: the config's train_batch_size / (micro x accumulation) "
                             "when it sets all three, else 1); num_clusters 'auto' means K = W")
    parser.add_argument("--micro-batch-size", type=int, default=None, metavar="M",
                        help="samples per rank and micro-step (default: the config's train_micro_batch_size_per_gpu, "
                             "else 1)")
    parser.add_argument("--gradient-accumulation-steps", type=int, default=None, metavar="G",
                        help="micro-steps per optimizer step (default: the config's gradient_accumulation_steps, "
                             "else 1)")


def _config_int(config: dict, key: str) -> Optional[int]:
    # Hugging Face configs say "auto" for values the Trainer fills in: not a number here.
    value = config.get(key)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def resolve_batch_shape(config: dict, world_size: Optional[int], micro: Optional[int],
                        accumulation: Optional[int]) -> tuple[int, int, int]:
    """(world size, micro batch, accumulation steps): the flags, else the DeepSpeed config, else 1."""
    micro = micro or _config_int(config, "train_micro_batch_size_per_gpu") or 1
    accumulation = accumulation or _config_int(config, "gradient_accumulation_steps") or 1
    if world_size is None:
        total = _config_int(config, "train_batch_size")
        if total is not None and _config_int(config, "train_micro_batch_size_per_gpu") and \
                _config_int(config, "gradient_accumulation_steps"):
            if total % (micro * accumulation):
                raise ValueError(f"train_batch_size {total} is not a multiple of micro batch {micro} x "
                                 f"accumulation {accumulation}: pass --world-size")
            world_size = total // (micro * accumulation)
        else:
            world_size = 1
    return world_size, micro, accumulation


def analysis_size(folder: Path) -> int:
    """Number of samples of an analysis directory, from the first rows of features.npy or labels.npy."""
    import numpy as np

    if not folder.is_dir():
        raise FileNotFoundError(f"analysis directory {folder} does not exist; run `ds-cluster analyze` first")
    for name in ("features.npy", "labels.npy"):
        path = folder / name
        if path.exists():
            return int(np.load(path, mmap_mode="r", allow_pickle=False).shape[0])
    raise FileNotFoundError(f"{folder} holds neither features.npy nor labels.npy; run `ds-cluster analyze` first")


def build_plan_from_args(args: argparse.Namespace) -> tuple["Plan", "PlanInputs"]:
    """The plan the hook would build for this analysis, config and batch shape (pure: no process group)."""
    from ds_cluster.config import ClusterSamplingConfig, load_ds_config
    from ds_cluster.integrations.deepspeed import load_plan_inputs
    from ds_cluster.plan import build_plan

    config_dict, source = load_ds_config(args.deepspeed)
    settings = ClusterSamplingConfig.from_ds_config(config_dict)
    if not settings.enabled:
        logger.warning("%s: cluster_sampling is not enabled; showing the plan it would build", source)
    settings.analysis_path = str(args.analysis)
    world_size, micro, accumulation = resolve_batch_shape(config_dict, args.world_size, args.micro_batch_size,
                                                          args.gradient_accumulation_steps)
    inputs = load_plan_inputs(settings, analysis_size(Path(args.analysis)))
    plan = build_plan(inputs.features, settings, world_size=world_size, micro_batch_size=micro,
                      gradient_accumulation_steps=accumulation, labels=inputs.labels, exclude=inputs.exclude)
    return plan, inputs


def _input_error(command: str, err: Exception) -> int:
    # Bad input (config, analysis, batch shape): a message, not a traceback.
    logger.error("%s failed: %s", command, err)
    return 2


# --------------------------------------------------------------------------- plan
PLAN_EXAMPLE = """\
examples:
  # the plan of an 8-rank job with the config's micro batch and accumulation:
  ds-cluster plan --analysis runs/demo/analysis --deepspeed ds_configs/zero3.json --world-size 8

  # another batch shape, saved for inspection, as JSON:
  ds-cluster plan --analysis runs/demo/analysis --deepspeed ds_configs/zero3.json \\
      --world-size 2 --micro-batch-size 8 --gradient-accumulation-steps 1 --out runs/plan --json

The world size is --world-size, else the config's train_batch_size / (micro x accumulation)
when the config sets all three numbers, else 1. With num_clusters "auto" (the paper preset)
K is that world size, so give the world size you will launch with.
"""


def add_plan_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan", formatter_class=_FORMATTER, epilog=PLAN_EXAMPLE,
        help="build the cluster plan from an analysis and a config, and print what it keeps and schedules",
        description="Build the plan exactly as the DeepSpeed hook would at start-up (no process group,\n"
                    "nothing trained) and print clusters, sizes, kept counts, the weights' range and\n"
                    "effective sample size, steps per epoch, and how many clusters each global step and\n"
                    "each rank's step covers in epoch 0.")
    _add_plan_inputs(parser)
    parser.add_argument("--out", default=None, metavar="PLAN_DIR", help="also save the plan there (Plan.save)")
    parser.add_argument("--json", action="store_true", help="print the summary and coverage as JSON instead")
    parser.set_defaults(handler=run_plan_command)


def run_plan_command(args: argparse.Namespace) -> int:
    import json

    from ds_cluster.report import format_coverage, plan_table, schedule_coverage

    try:
        plan, _ = build_plan_from_args(args)
    except (ValueError, FileNotFoundError) as err:
        return _input_error("plan", err)
    coverage = schedule_coverage(plan, epoch=0)
    if args.out:
        plan.save(args.out)
        logger.info("plan saved to %s", args.out)
    if args.json:
        sys.stdout.write(json.dumps({"summary": plan.summary(), "coverage": coverage}, indent=2) + "\n")
    else:
        sys.stdout.write(plan_table(plan) + "\n" + format_coverage(coverage, plan.num_clusters) + "\n")
    return 0


# --------------------------------------------------------------------------- report
REPORT_EXAMPLE = """\
examples:
  ds-cluster report --analysis runs/demo/analysis --deepspeed ds_configs/zero3.json \\
      --world-size 2 --out runs/demo/report
  # then open runs/demo/report/index.html (no network, no script needed)

The folder holds index.html and PNG plots: cluster sizes against kept sizes, the weight
distribution, the samples of each cluster per rank and step of epoch 0, a 2-D PCA projection of
the features coloured by cluster, and, when the analysed data has a `family` column (the
manifest's data path, or --data), clusters against families with their purity.
"""


def add_report_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "report", formatter_class=_FORMATTER, epilog=REPORT_EXAMPLE,
        help="write an HTML report (index.html + PNG plots) of the plan built from an analysis",
        description="Build the plan as `ds-cluster plan` does and write a self-contained HTML page\n"
                    "with plots of what it keeps, weights and schedules, and of the features.")
    _add_plan_inputs(parser)
    parser.add_argument("--out", required=True, metavar="DIR", help="folder for index.html and the PNG files")
    parser.add_argument("--data", default=None, metavar="DATA",
                        help="records with a `family` field, one per analysed sample (default: the data path in "
                             "the analysis's manifest.json)")
    parser.add_argument("--max-points", type=int, default=4000,
                        help="samples drawn for the 2-D projection (default 4000; a seeded random subset)")
    parser.set_defaults(handler=run_report_command)


def read_families(analysis: Path, data: Optional[str], num_samples: int) -> Optional[list[str]]:
    """The `family` of every analysed sample, or None when the data has none (or cannot be found)."""
    import json

    from ds_cluster.data.instructions import _read_records

    if data is None:
        manifest = analysis / "manifest.json"
        if not manifest.exists():
            return None
        data = json.loads(manifest.read_text()).get("data")
    if not data or not Path(data).exists():
        logger.warning("data %s not found: the report has no cluster-versus-family table", data)
        return None
    families = [str(record.get("family", "")) for record in _read_records(data)]
    if len(families) != num_samples:
        logger.warning("%s has %d records but the analysis %d samples: no family table", data, len(families),
                       num_samples)
        return None
    return families if any(families) else None


def run_report_command(args: argparse.Namespace) -> int:
    from ds_cluster.report import write_report

    analysis = Path(args.analysis)
    try:
        plan, inputs = build_plan_from_args(args)
        families = read_families(analysis, args.data, plan.num_samples)
    except (ValueError, FileNotFoundError) as err:
        return _input_error("report", err)
    index = write_report(args.out, plan, features=inputs.features, families=families,
                         title=f"ds_cluster report: {analysis}",
                         sources={"analysis": str(analysis), "DeepSpeed config": str(args.deepspeed)},
                         max_projection_points=args.max_points)
    sys.stdout.write(f"report: {index}\n")
    return 0


# --------------------------------------------------------------------------- train
TRAIN_EXAMPLE = """\
examples:
  # 2 ranks on this node with the deepspeed launcher:
  ds-cluster train --deepspeed ds_configs/zero3.json --nproc 2 -- \\
      --model tiny-base --analysis runs/demo/analysis --output-dir runs/train --epochs 1

  # the same under mpirun, printed only:
  ds-cluster train --deepspeed ds_configs/zero3.json --launcher mpirun --nproc 2 --dry-run -- --model tiny

  # one process, no launcher:
  ds-cluster train --deepspeed ds_configs/zero2.json --launcher none -- --model tiny --max-steps 10

Everything after `--` goes to the training script (launch/train.py --help lists it). On one node
the ranks talk over loopback (MASTER_ADDR 127.0.0.1, GLOO_SOCKET_IFNAME lo, Open MPI on lo and
shared memory). With --hostfile the loopback settings are left out: set MASTER_ADDR,
GLOO_SOCKET_IFNAME and the Open MPI interface options for your network, or use
launch/run_deepspeed.sh / launch/run_mpi.sh, which do.
"""
# Variables every mpirun rank needs (mpirun forwards only what -x names).
_MPI_FORWARD = ("MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "DS_ACCELERATOR", "PATH", "PYTHONPATH",
                "TORCH_EXTENSIONS_DIR", "OMP_NUM_THREADS", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def add_train_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train", formatter_class=_FORMATTER, epilog=TRAIN_EXAMPLE,
        help="run launch/train.py with a config under the deepspeed launcher, mpirun, or as one process",
        description="Build the launch command for the training script, print it, and run it; the exit\n"
                    "code is the job's. --dry-run prints the command only.")
    parser.add_argument("--deepspeed", required=True, metavar="CONFIG.json",
                        help="DeepSpeed JSON config with a cluster_sampling block (passed to the script)")
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
                        help="training script (default launch/train.py of this checkout)")
    parser.add_argument("--dry-run", action="store_true", help="print the command and do not run it")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="-- SCRIPT_ARGS",
                        help="arguments of the training script, after --")
    parser.set_defaults(handler=run_train_command)


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def default_train_script() -> Path:
    script = Path(__file__).resolve().parents[1] / "launch" / "train.py"
    if not script.is_file():
        raise FileNotFoundError(f"{script} not found (ds_cluster installed without its launch/ folder): "
                                "pass --script PATH")
    return script


def build_train_command(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """The command line and the environment additions for `ds-cluster train`."""
    script = args.script or str(default_train_script())
    script_args = list(args.script_args or [])
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    script_args = ["--deepspeed", str(args.deepspeed), *script_args]
    multinode = args.hostfile is not None
    nproc = args.nproc if args.nproc is not None else (None if multinode else 2)
    port = args.master_port or (29500 if multinode else _free_port())
    env: dict[str, str] = {"MASTER_PORT": str(port)}
    if not multinode:
        # One node: everything on loopback, nothing leaves the machine.
        env.update(MASTER_ADDR=args.master_addr or "127.0.0.1", GLOO_SOCKET_IFNAME="lo")
    elif args.master_addr:
        env["MASTER_ADDR"] = args.master_addr
    if "DS_ACCELERATOR" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            env["DS_ACCELERATOR"] = "cpu"  # DeepSpeed would otherwise look for a GPU

    if args.launcher == "deepspeed":
        command = [_venv_tool("deepspeed")]
        if multinode:
            command += ["--hostfile", args.hostfile, "--launcher", "openmpi"]
        if nproc is not None:
            command += ["--num_gpus", str(nproc)]  # required on CPU: the device count would be the NUMA nodes
        if "MASTER_ADDR" in env:
            command += ["--master_addr", env["MASTER_ADDR"]]
        command += ["--master_port", str(port), script, *script_args]
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
        names = {*env, *(name for name in _MPI_FORWARD if name in os.environ)}
        for name in [n for n in _MPI_FORWARD if n in names]:
            command += ["-x", name]
        command += [sys.executable, script, *script_args]
    else:
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        command = [sys.executable, script, *script_args]
    return command, env


def _venv_tool(name: str) -> str:
    # The launcher next to this Python (the venv's), else whatever PATH has.
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def run_train_command(args: argparse.Namespace) -> int:
    import shlex
    import subprocess

    try:
        command, env_additions = build_train_command(args)
    except FileNotFoundError as err:
        return _input_error("train", err)
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


# --------------------------------------------------------------------------- entry point
SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    add_analyze_parser, add_plan_parser, add_report_parser, add_train_parser]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ds-cluster", formatter_class=_FORMATTER,
        description="CluSTER cluster-balanced sampling for DeepSpeed fine-tuning.",
        epilog="Run `ds-cluster COMMAND --help` for a command's options and an example.")
    _add_launcher_options(parser, None)
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_parser in SUBCOMMANDS:
        add_parser(subparsers)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    rank = os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == "0" else logging.WARNING,
                        format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
