"""What the subcommands share: the launcher's --local_rank, the plan inputs, and how bad input is reported."""
from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from ds_cluster.analysis.folder import AnalysedTarget
    from ds_cluster.clustering.samples import PlanInputs
    from ds_cluster.planning.plan import Plan

logger = logging.getLogger("ds_cluster.cli")

FORMATTER = argparse.RawDescriptionHelpFormatter
# The flags that give a batch figure, by what they give (for "pass --flag" errors).
BATCH_FLAGS = {"world_size": "--world-size", "micro_batch_size": "--micro-batch-size",
               "gradient_accumulation_steps": "--gradient-accumulation-steps"}


def add_launcher_options(parser: argparse.ArgumentParser, default: object) -> None:
    # The deepspeed launcher passes --local_rank=N before the subcommand; accept it anywhere.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=default,
                        help="set by the deepspeed launcher; not needed by hand")


def input_error(command: str, err: Exception) -> int:
    """Bad input (config, analysis, batch shape): a message and exit status 2, not a traceback."""
    logger.error("%s failed: %s", command, err)
    return 2


def add_plan_inputs(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--analysis", required=True, metavar="DIR",
                        help="analysis directory (features.npy and/or labels.npy), e.g. from `ds-cluster analyze`; "
                             "it replaces the config's cluster_sampling.analysis_path")
    parser.add_argument("--deepspeed", required=True, metavar="CONFIG",
                        help="DeepSpeed config (JSON or HJSON): its cluster_sampling block, micro batch and "
                             "accumulation steps")
    parser.add_argument("--world-size", type=int, default=None, metavar="W",
                        help="data-parallel ranks (default: the config's train_batch_size / (micro x accumulation) "
                             "when it sets all three, else 1); num_clusters 'auto' means K = W")
    parser.add_argument("--micro-batch-size", type=int, default=None, metavar="M",
                        help="samples per rank and micro-step (default: the config's train_micro_batch_size_per_gpu)")
    parser.add_argument("--gradient-accumulation-steps", type=int, default=None, metavar="G",
                        help="micro-steps per optimizer step (default: the config's gradient_accumulation_steps)")


def build_plan_from_args(args: argparse.Namespace) -> tuple["Plan", "PlanInputs", Optional["AnalysedTarget"]]:
    """The plan the hook would build for this analysis, config and batch shape (pure: no process group), the
    analysis's inputs, and its target examples (None when it was made without). A targeted selection reads the
    analysis's target, which must be the config's `target` (same examples, same targets)."""
    from ds_cluster.analysis.folder import AnalysisDir
    from ds_cluster.batching import batch_shape_from_config
    from ds_cluster.config import ClusterSamplingConfig
    from ds_cluster.ds_config import read_ds_config
    from ds_cluster.clustering.samples import cluster_samples
    from ds_cluster.data.target import read_target_fingerprint
    from ds_cluster.planning.plan import build_plan

    config_dict, source = read_ds_config(args.deepspeed)
    settings = ClusterSamplingConfig.from_ds_config(config_dict)
    if not settings.enabled:
        logger.warning("%s: cluster_sampling is not enabled; showing the plan it would build", source)
    shape = batch_shape_from_config(config_dict, source, world_size=args.world_size,
                                    micro_batch_size=args.micro_batch_size,
                                    gradient_accumulation_steps=args.gradient_accumulation_steps, flags=BATCH_FLAGS)
    analysis = AnalysisDir(args.analysis)
    inputs = analysis.load_inputs(analysis.num_samples())
    target = analysis.load_target()
    stages = settings.stages()
    configured = stages.selection.target
    if configured is not None:
        fingerprint = read_target_fingerprint(configured.data, group_field=configured.group_field,
                                              groups=configured.groups)
        if target is None or target.fingerprint != fingerprint:
            held = "no target" if target is None else f"the target set {target.fingerprint}"
            raise ValueError(f"{args.analysis} holds {held}, not the config's cluster_sampling.target "
                             f"{configured.data} ({fingerprint}): rerun `ds-cluster analyze --target "
                             f"{configured.data}` (its other target keys from the same config)")
    plan = build_plan(cluster_samples(inputs, stages.clustering, shape.world_size), stages, shape,
                      target=target if configured is not None else None)
    return plan, inputs, target
