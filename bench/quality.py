"""Time to quality: CluSTER against full data and a random subset, 2 ranks, ZeRO-2, CPU.

    python bench/quality.py                      # the full benchmark (resumable: finished runs are kept)
    python bench/quality.py --report-only        # rebuild quality.json / quality.md / the plot from finished runs

Every run is a real `deepspeed --num_gpus 2 launch/train.py` job on the same base model
(tiny-base), with the same hyper-parameters and the same number of epochs over its own data, and
every run goes through the same ds_cluster loader: "full data" and "random subset" use a one-cluster
analysis (labels all 0) with budget_mode proportional, selection random and weighting none, so
the only thing that differs between runs is which samples are kept, how they are weighted and
ordered. Each trained model is saved (`--save-model`) and evaluated here, per task family, on the
held-out set: token loss and exact match of greedy answers.

Times: the machine is shared, so wall time drifts with other jobs' load. Every launch is timed in
wall seconds and in CPU seconds (user + sys of the launcher and both ranks, from
``getrusage(RUSAGE_CHILDREN)``); time ratios to full data are computed from CPU seconds. A run's
total = its analysis job (feature extraction + clustering, done once per analysis setting and
charged in full to every run that uses it) + its training job, both whole jobs including start-up.
Runs go seed-major (every setting of seed 0, then seed 1, ...), so load drifts hit settings alike.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.quality_lib import (  # noqa: E402
    BenchSettings,
    build_run_plan,
    prepare_analyses,
    run_all,
    write_report,
)

RESULTS = REPO / "bench" / "results"
WORK = REPO / "runs" / "bench_quality"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=BenchSettings.epochs, help="epochs of every run over its data")
    parser.add_argument("--lr", type=float, default=BenchSettings.learning_rate, help="AdamW learning rate")
    parser.add_argument("--seeds", type=int, default=3, help="seeds of the headline runs (ablations: the first one)")
    parser.add_argument("--work-dir", type=Path, default=WORK, help="runs, analyses and per-run results")
    parser.add_argument("--results-dir", type=Path, default=RESULTS, help="quality.json, quality.md, quality.png")
    parser.add_argument("--only", choices=("all", "headline"), default="all",
                        help="'headline': full, random and CluSTER at the headline ratio only")
    parser.add_argument("--report-only", action="store_true", help="no runs: rebuild the report from finished ones")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = BenchSettings(epochs=args.epochs, learning_rate=args.lr, seeds=tuple(range(args.seeds)),
                             work_dir=args.work_dir, results_dir=args.results_dir)
    analyses = prepare_analyses(settings, run_missing=not args.report_only)
    runs = build_run_plan(settings, analyses, headline_only=args.only == "headline")
    print(f"{len(runs)} runs planned; work dir {settings.work_dir}", flush=True)
    if not args.report_only:
        run_all(settings, analyses, runs)
    report = write_report(settings, analyses, runs)
    print(report["markdown_path"], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
