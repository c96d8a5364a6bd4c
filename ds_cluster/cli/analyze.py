"""`ds-cluster analyze`: gradient features with a DeepSpeed engine, k-means, and an analysis folder."""
from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any, Optional

from ds_cluster.cli.common import FORMATTER, add_launcher_options, input_error, logger
from ds_cluster.features.kinds import FEATURE_KINDS

EXAMPLE = """\
examples:
  # 2 ranks, ZeRO-3, a local checkpoint on a JSONL file of Alpaca records:
  deepspeed --num_gpus 2 --module ds_cluster.cli analyze --deepspeed ds_configs/zero3.json \\
      --model MODEL_DIR --data data/train.jsonl --out runs/analysis

  # the same under Open MPI:
  mpirun -np 2 python -m ds_cluster.cli analyze --deepspeed ds_configs/zero3.json \\
      --model MODEL_DIR --data data/train.jsonl --out runs/analysis --kind lm_head --dim 1024

  # with target examples (docs/targeted.md): their features are recorded beside the records':
  mpirun -np 2 python -m ds_cluster.cli analyze --deepspeed ds_configs/zero3.json \
      --model MODEL_DIR --data data/train.jsonl --out runs/analysis --kind hidden --target data/target.jsonl

A rerun reuses the finished feature shards in OUT/.feature_store (or --store);
a rerun with other settings stops with an error naming them unless --recompute.
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "analyze", formatter_class=FORMATTER, epilog=EXAMPLE,
        help="extract per-sample gradient features with DeepSpeed, cluster them, write an analysis directory",
        description="Run on every rank (deepspeed launcher or mpirun): the ranks share one forward pass\n"
                    "over the data under the config's ZeRO stage; rank 0 clusters the features (K from the\n"
                    "config's cluster_sampling block, 'auto' = world size) and writes OUT atomically:\n"
                    "features.npy, labels.npy, centroids.npy, distances.npy, empty_mask.npy,\n"
                    "manifest.json, summary.json.")
    parser.add_argument("--deepspeed", required=True, metavar="CONFIG",
                        help="DeepSpeed config (JSON or HJSON); its ZeRO stage shards the model, its "
                             "data_efficiency.data_sampling.cluster_sampling block sets K, seed and features")
    parser.add_argument("--model", required=True, metavar="PATH",
                        help="a local Hugging Face causal-LM checkpoint folder (config, weights, tokenizer)")
    parser.add_argument("--data", required=True, metavar="DATA",
                        help="records as JSONL (.jsonl or .jsonl.gz) or a datasets save_to_disk folder: Alpaca "
                             "(instruction, input, output[, category]), chat (messages or conversations) or "
                             "prompt/completion; docs/data.md")
    parser.add_argument("--out", required=True, metavar="DIR", help="analysis directory to write (replaced atomically)")
    parser.add_argument("--kind", choices=FEATURE_KINDS.names, default=None,
                        help="feature: "
                             + "; ".join(f"'{kind.name}' = {kind.summary}" for kind in FEATURE_KINDS.values())
                             + " (default: the config's feature_kind)")
    parser.add_argument("--dim", type=int, default=None,
                        help="dimension of a projected kind (lm_head; default: config feature_dim, else 1024)")
    parser.add_argument("--feature-model", default=None, metavar="PATH",
                        help="a checkpoint folder used only for the features, with its own tokenizer (default: the "
                             "config's feature_model, else --model itself); --model then only gives the tokenizer "
                             "of the data the analysis is for")
    parser.add_argument("--target", default=None, metavar="PATH",
                        help="target examples (any record format --data takes; docs/targeted.md): their features are "
                             "computed too, tokenized like --data, and recorded with their fingerprint; replaces the "
                             "config's cluster_sampling.target.data (its other target keys apply)")
    parser.add_argument("--batch-size", type=int, default=8, help="samples per forward pass on each rank (default 8)")
    parser.add_argument("--max-length", type=int, default=None,
                        help="tokens per sample, longer ones are truncated (default: the dataset loader's, 96)")
    parser.add_argument("--store", default=None, metavar="DIR",
                        help="feature store folder, visible to every rank (default OUT/.feature_store)")
    parser.add_argument("--shard-size", type=int, default=None,
                        help="samples per store shard: the work lost by a crash (default 512)")
    parser.add_argument("--recompute", action="store_true",
                        help="discard the feature store and recompute every feature")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_launcher_options(parser, argparse.SUPPRESS)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import os

    from ds_cluster.analysis.compute import AnalysedData, AnalysisOptions, analyze
    from ds_cluster.config import ClusterSamplingConfig
    from ds_cluster.data.dataset import DEFAULT_MAX_LENGTH, load_instruction_dataset
    from ds_cluster.data.models import load_tokenizer
    from ds_cluster.distributed import collectives, get_rank, init_distributed, shutdown
    from ds_cluster.ds_config import read_ds_config
    from ds_cluster.features.source import feature_source
    from ds_cluster.features.store import DEFAULT_SHARD_SIZE

    started = time.perf_counter()
    init_distributed()
    try:
        ds_config, source = read_ds_config(args.deepspeed)
        settings = ClusterSamplingConfig.from_ds_config(ds_config)
        if args.feature_model:
            settings.feature_model = args.feature_model
        stages = settings.stages()
        # --kind and --dim choose the features instead of the config's keys.
        stages = dataclasses.replace(stages, features=dataclasses.replace(
            stages.features, kind=args.kind or stages.features.kind,
            dim=args.dim if args.dim is not None else stages.features.dim))
        max_length = args.max_length or DEFAULT_MAX_LENGTH
        # The data as the training job tokenizes it (the trained model's tokenizer); the features from --model's
        # forward-only engine, or from a separate feature model's on its own re-encoding of the same records.
        tokenizer = load_tokenizer(args.model)
        dataset = load_instruction_dataset(args.data, tokenizer, max_length=max_length)
        # Read on every rank; a bad target file is an error on every rank, before any engine is built.
        target = collectives().run_agreed(
            "reading the target examples",
            lambda: configured_target(stages.selection.target, args.target, tokenizer, max_length),
            errors=(ValueError, FileNotFoundError))
        with feature_source(stages.features, dataset, ds_config=ds_config, model=args.model) as features:
            loaded = time.perf_counter()
            options = AnalysisOptions(
                target=target.encoded_with(features.encode) if target is not None else None,
                batch_size=args.batch_size, store_dir=args.store, recompute=args.recompute,
                shard_size=args.shard_size or DEFAULT_SHARD_SIZE, show_progress=not args.no_progress,
                of_data=AnalysedData(dataset),
                provenance={"model": os.fspath(args.model), "data": os.fspath(args.data),
                            "feature_model": stages.features.model, "max_length": max_length, "ds_config": source,
                            "zero_stage": int((ds_config.get("zero_optimization") or {}).get("stage", 0))})
            summary = analyze(features.engine, features.dataset, args.out, stages, options, collectives()).summary
    except (ValueError, FileNotFoundError) as err:
        # Bad input (config, data, a store made with other settings): a message, not a traceback.
        return input_error("analyze", err)
    finally:
        shutdown()
    if get_rank() == 0:
        purity = f", family purity {summary['purity']:.3f}" if "purity" in summary else ""
        logger.info("%s: %d samples (%d without response tokens), %s d=%d, cluster sizes %s%s; load %.1f s, "
                    "total %.1f s", args.out, summary["num_samples"], summary["num_empty"], summary["kind"],
                    summary["dim"], summary["cluster_sizes"], purity, loaded - started,
                    time.perf_counter() - started)
    return 0


def configured_target(settings: Any, path: Optional[str], tokenizer: Any, max_length: int) -> Any:
    """The target examples of --target (else of the config's cluster_sampling.target), tokenized like the data; None
    without either."""
    from ds_cluster.data.target import read_target
    from ds_cluster.settings import TargetSettings

    if path is not None:
        settings = TargetSettings(data=path) if settings is None else dataclasses.replace(settings, data=path)
    if settings is None:
        return None
    return read_target(settings.data, tokenizer, max_length, group_field=settings.group_field,
                       min_examples=settings.min_examples, groups=settings.groups)
