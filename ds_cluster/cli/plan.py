"""`ds-cluster plan`: build the plan the hook would build, and print what it keeps and schedules."""
from __future__ import annotations

import argparse
import sys

from ds_cluster.cli.common import FORMATTER, add_plan_inputs, build_plan_from_args, input_error, logger

EXAMPLE = """\
examples:
  # the plan of an 8-rank job with the config's micro batch and accumulation:
  ds-cluster plan --analysis runs/demo/analysis --deepspeed ds_configs/zero3.json --world-size 8

  # another batch shape, saved for inspection, as JSON:
  ds-cluster plan --analysis runs/demo/analysis --deepspeed ds_configs/zero3.json \\
      --world-size 2 --micro-batch-size 8 --gradient-accumulation-steps 1 --out runs/plan --json

The world size is --world-size, else the config's train_batch_size / (micro x accumulation)
when the config sets all three numbers, else 1. With num_clusters "auto" (the paper preset)
K is that world size, so give the world size you will launch with. A batch figure the config
says "auto" (Hugging Face Trainer configs) must be given as a flag.
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan", formatter_class=FORMATTER, epilog=EXAMPLE,
        help="build the cluster plan from an analysis and a config, and print what it keeps and schedules",
        description="Build the plan exactly as the DeepSpeed hook would at start-up (no process group,\n"
                    "nothing trained) and print clusters, sizes, kept counts, the weights' range and\n"
                    "effective sample size, steps per epoch, and how many clusters each global step and\n"
                    "each rank's step covers in epoch 0.")
    add_plan_inputs(parser)
    parser.add_argument("--out", default=None, metavar="PLAN_DIR", help="also save the plan there (Plan.save)")
    parser.add_argument("--json", action="store_true", help="print the summary and coverage as JSON instead")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import json

    from ds_cluster.report.summary import format_coverage, plan_table, layout_coverage

    try:
        plan, *_ = build_plan_from_args(args)
    except (ValueError, FileNotFoundError) as err:
        return input_error("plan", err)
    coverage = layout_coverage(plan, epoch=0)
    if args.out:
        plan.save(args.out)
        logger.info("plan saved to %s", args.out)
    if args.json:
        sys.stdout.write(json.dumps({"summary": plan.summary(), "coverage": coverage}, indent=2) + "\n")
    else:
        sys.stdout.write(plan_table(plan) + "\n" + format_coverage(coverage, plan.num_clusters) + "\n")
    return 0
