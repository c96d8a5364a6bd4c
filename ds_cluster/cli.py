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
from typing import Callable, Optional, Sequence

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


# --------------------------------------------------------------------------- entry point
SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [add_analyze_parser]


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
