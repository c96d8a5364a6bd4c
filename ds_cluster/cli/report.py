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
column, clusters against categories with their purity; and what
each cluster holds: its size, kept count, weight and category mix, the words of its prompts that set it
apart from the other clusters (TF-IDF), and the three prompts nearest its centre, cut short. --no-text
leaves every record's text (words and prompts) out of the page. With an adaptive run's schedule log
(--schedule-log, or schedule.jsonl beside the analysis), the sampling shares and per-cluster loss of
every window over the optimizer steps. With an analysis made with target examples (docs/targeted.md),
each cluster's affinity to the target: the target examples nearest its centre and their targets, the
mean similarity of its records to the target, and what the plan kept of it.

The records come from --data, else from where the analysis says they were read (its manifest's
data_source, recorded by `ds-cluster analyze`, the hook's in-job analysis and the Trainers), as long as
that file still holds the bytes the analysis was made of; otherwise the page says why they are missing.
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
                             "field (default: the file the analysis records it was made of, if it is unchanged)")
    parser.add_argument("--schedule-log", default=None, metavar="JSONL",
                        help="an adaptive run's schedule log, for its shares and per-cluster loss over the steps "
                             "(default: schedule.jsonl beside the analysis folder, when there is one)")
    parser.add_argument("--no-text", action="store_true",
                        help="leave the records' text (distinguishing words, example prompts) out of the report")
    parser.add_argument("--max-points", type=int, default=4000,
                        help="samples drawn for the 2-D projection (default 4000; a seeded random subset)")
    parser.set_defaults(handler=run)


def read_records_of(analysis: Path, data: Optional[str], num_samples: int
                    ) -> tuple[Optional[list[dict]], str]:
    """(the analysed records, where they were read) from --data, else from the file the analysis records it was
    made of; or (None, why not): the analysis records no file, the file is gone or has changed since, or its
    records are not the analysis's one for one. The reason is logged and shown on the page."""
    from ds_cluster.data.dataset import read_records

    if data is None:
        data, why_not = recorded_source(analysis)
        if data is None:
            logger.warning("%s", why_not)
            return None, str(why_not)
    if not Path(data).exists():
        why_not = f"the data {data} was not found: pass --data with the analysed records"
        logger.warning("%s", why_not)
        return None, why_not
    records = read_records(data)
    if len(records) != num_samples:
        why_not = f"{data} has {len(records)} records but the analysis {num_samples} samples: not the analysed data"
        logger.warning("%s", why_not)
        return None, why_not
    return records, str(data)


def recorded_source(analysis: Path) -> tuple[Optional[str], Optional[str]]:
    """(the data file the analysis was made of, None) when it is still there with the same bytes, else (None, why
    it is not used). Analyses made before 0.6.0 record only `ds-cluster analyze`'s data path (used as it is)."""
    from ds_cluster.analysis.folder import AnalysisDir
    from ds_cluster.data.dataset import source_fingerprint

    manifest = AnalysisDir(analysis).manifest() or {}
    source = manifest.get("data_source")
    if source is None:
        if manifest.get("data"):
            return str(manifest["data"]), None
        return None, (f"{analysis} does not record the data it was made of (records built in memory, or an analysis "
                      "made before 0.6.0): pass --data with the analysed records")
    path = Path(source["path"])
    if not path.exists():
        return None, (f"{analysis} was made of {path}, which is not there any more: pass --data with the analysed "
                      "records")
    now = source_fingerprint(path)
    if now != source["fingerprint"]:
        return None, (f"{path} has changed since {analysis} was made of it (content fingerprint {now}, the "
                      f"analysis's {source['fingerprint']}): its records may not be the analysed ones; pass --data "
                      "to use them anyway")
    return str(path), None


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
    from ds_cluster.report.page import ReportInputs, write_report

    analysis = Path(args.analysis)
    try:
        plan, inputs, target = build_plan_from_args(args)
        records, records_from = read_records_of(analysis, args.data, plan.num_samples)
        prompts = None if records is None else [prompt_text(record, i) for i, record in enumerate(records)]
        schedule_lines = read_schedule_log(analysis, args.schedule_log)
    except (ValueError, FileNotFoundError) as err:
        return input_error("report", err)
    index = write_report(args.out, plan, ReportInputs(
        features=inputs.features, categories=categories_of(records), prompts=prompts, include_text=not args.no_text,
        schedule_lines=schedule_lines, records_note=None if records is not None else records_from,
        title=f"ds_cluster report: {analysis}",
        sources={"analysis": str(analysis), "DeepSpeed config": str(args.deepspeed),
                 "records": records_from if records is not None else "none"},
        max_projection_points=args.max_points, target=target))
    sys.stdout.write(f"report: {index}\n")
    return 0
