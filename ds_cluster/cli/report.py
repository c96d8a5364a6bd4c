"""`ds-cluster report`: an HTML page with plots of a plan, its schedule and the features."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

from ds_cluster.cli.common import FORMATTER, add_plan_inputs, build_plan_from_args, input_error, logger

EXAMPLE = """\
examples:
  ds-cluster report --analysis runs/demo/analysis --deepspeed ds_configs/zero3.json \\
      --world-size 2 --out runs/demo/report
  # then open runs/demo/report/index.html (no network, no script needed)

The folder holds index.html and PNG plots: cluster sizes against kept sizes, the weight
distribution, the samples of each cluster per rank and step of epoch 0, a 2-D PCA projection of
the features coloured by cluster, and, when the analysed data has a `category` (or `family`)
column (the manifest's data path, or --data), clusters against categories with their purity; and what
each cluster holds: its size, kept count, weight and category mix, the words of its prompts that set it
apart from the other clusters (TF-IDF), and the three prompts nearest its centre, cut short. --no-text
leaves every record's text (words and prompts) out of the page. With an adaptive run's schedule log
(--schedule-log, or schedule.jsonl beside the analysis), the sampling shares and per-cluster loss of
every window over the optimizer steps.
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "report", formatter_class=FORMATTER, epilog=EXAMPLE,
        help="write an HTML report (index.html + PNG plots) of the plan built from an analysis",
        description="Build the plan as `ds-cluster plan` does and write a self-contained HTML page\n"
                    "with plots of what it keeps, weights and schedules, and of the features.")
    add_plan_inputs(parser)
    parser.add_argument("--out", required=True, metavar="DIR", help="folder for index.html and the PNG files")
    parser.add_argument("--data", default=None, metavar="DATA",
                        help="the analysed records, one per sample, for their prompts and `category` (or `family`) "
                             "field (default: the data path in the analysis's manifest.json)")
    parser.add_argument("--schedule-log", default=None, metavar="JSONL",
                        help="an adaptive run's schedule log, for its shares and per-cluster loss over the steps "
                             "(default: schedule.jsonl beside the analysis folder, when there is one)")
    parser.add_argument("--no-text", action="store_true",
                        help="leave the records' text (distinguishing words, example prompts) out of the report")
    parser.add_argument("--max-points", type=int, default=4000,
                        help="samples drawn for the 2-D projection (default 4000; a seeded random subset)")
    parser.set_defaults(handler=run)


def read_records_of(analysis: Path, data: Optional[str], num_samples: int) -> Optional[list[dict]]:
    """The analysed records (--data, else the manifest's data path), or None when they are not there or do not
    match the analysis one for one."""
    from ds_cluster.analysis.folder import AnalysisDir
    from ds_cluster.data.dataset import read_records

    if data is None:
        manifest = AnalysisDir(analysis).manifest()
        data = manifest.get("data") if manifest else None
    if not data or not Path(data).exists():
        if data:
            logger.warning("data %s not found: the report has no cluster-versus-category table", data)
        return None
    records = read_records(data)
    if len(records) != num_samples:
        logger.warning("%s has %d records but the analysis %d samples: no category table, no prompts", data,
                       len(records), num_samples)
        return None
    return records


def read_schedule_log(analysis: Path, given: Optional[str]) -> Optional[list[dict]]:
    """The lines of an adaptive run's schedule log (--schedule-log, else schedule.jsonl beside the analysis)."""
    path = Path(given) if given else analysis.absolute().parent / "schedule.jsonl"
    if not path.is_file():
        if given:
            raise FileNotFoundError(f"--schedule-log {given} does not exist")
        return None
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def categories_of(records: Optional[list[dict]]) -> Optional[list[str]]:
    """Every record's task group (`data.dataset.task_group`: its `category`, else `family`), or None when none has
    one."""
    from ds_cluster.data.dataset import task_group

    if records is None:
        return None
    categories = [task_group(record) for record in records]
    return categories if any(categories) else None


def run(args: argparse.Namespace) -> int:
    from ds_cluster.data.dataset import prompt_text
    from ds_cluster.report.page import write_report

    analysis = Path(args.analysis)
    try:
        plan, inputs = build_plan_from_args(args)
        records = read_records_of(analysis, args.data, plan.num_samples)
        prompts = None if records is None else [prompt_text(record, i) for i, record in enumerate(records)]
        schedule_lines = read_schedule_log(analysis, args.schedule_log)
    except (ValueError, FileNotFoundError) as err:
        return input_error("report", err)
    index = write_report(args.out, plan, features=inputs.features, categories=categories_of(records),
                         prompts=prompts, include_text=not args.no_text, schedule_lines=schedule_lines,
                         title=f"ds_cluster report: {analysis}",
                         sources={"analysis": str(analysis), "DeepSpeed config": str(args.deepspeed)},
                         max_projection_points=args.max_points)
    sys.stdout.write(f"report: {index}\n")
    return 0
