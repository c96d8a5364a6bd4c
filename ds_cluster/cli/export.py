"""`ds-cluster export`: the kept subset of a plan as data (JSONL or a `datasets` folder) with a manifest."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ds_cluster.cli.common import FORMATTER, add_plan_inputs, build_plan_from_args, input_error

EXAMPLE = """\
examples:
  ds-cluster export --analysis runs/demo/analysis --deepspeed ds_configs/zero3.json \\
      --world-size 2 --data data/train.jsonl --out runs/demo/subset.jsonl --excluded runs/demo/left_out.jsonl
  ds-cluster export --analysis runs/demo/analysis --deepspeed ds_configs/zero3.json \\
      --world-size 2 --data data/train.jsonl --out runs/demo/subset --format datasets

Each kept record is written unchanged, in its original order, plus `cluster` and `weight` fields
(multiply the record's loss by `weight` to keep the full data's mix: docs/export.md shows it with a
plain Hugging Face Trainer), and, when the analysis was made with target examples, `target_score`
(its largest cosine similarity to one of them) and `target_group` (that example's target).
The manifest beside the output (OUT.manifest.json) holds the plan's
fingerprint, its settings and batch shape, and the size and kept count of every cluster.
The batch shape matters: the plan's selection is rounded to whole global batches.
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export", formatter_class=FORMATTER, epilog=EXAMPLE,
        help="write the plan's kept records (plus cluster and weight) as JSONL or a datasets folder",
        description="Build the plan as `ds-cluster plan` does and write the subset it keeps as data, for\n"
                    "training with any tool, with a manifest beside it.")
    add_plan_inputs(parser)
    parser.add_argument("--data", required=True, metavar="DATA",
                        help="the analysed records (JSONL, JSONL.gz or a save_to_disk folder), one per sample")
    parser.add_argument("--out", required=True, metavar="PATH",
                        help="the JSONL file, or the folder for --format datasets")
    parser.add_argument("--format", choices=("jsonl", "datasets"), default="jsonl",
                        help="jsonl (default) or a Hugging Face datasets folder (Dataset.save_to_disk)")
    parser.add_argument("--excluded", default=None, metavar="PATH",
                        help="also write the records left out (weight 0), as JSONL, for audit")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from ds_cluster.data.dataset import read_records
    from ds_cluster.report.export import export_subset, manifest_path, record_scores

    try:
        plan, inputs, target = build_plan_from_args(args)
        scores = (record_scores(inputs.features, target) if target is not None and inputs.features is not None
                  else None)
        manifest = export_subset(plan, read_records(args.data), args.out, export_format=args.format,
                                 excluded=args.excluded, scores=scores,
                                 sources={"analysis": str(Path(args.analysis)), "deepspeed": str(args.deepspeed),
                                          "data": str(args.data)})
    except (ValueError, FileNotFoundError) as err:
        return input_error("export", err)
    sys.stdout.write(f"exported {manifest['num_kept']} of {manifest['num_records']} records to {args.out} "
                     f"(manifest {manifest_path(args.out)})\n")
    return 0
