"""The instrument's power: how wide a paired 95% interval a run's differences would have with more seeds.

    python -m bench.harness.power bench/results/real/quality_smollm2_power_b8_slice7_e3.json [--seeds 8]

A pilot run of a few paired seeds gives each paired difference's interval; its standard deviation over the seeds
(half-width x sqrt(n) / t(n-1)) projects the half-width a run of `--seeds` seeds would have (t(m-1) x sd / sqrt(m)).
bench/candidates.json's "smollm2_power" rule chooses the SmolLM2 instrument's recipe on this projection of its
validation intervals; the goal itself is read on the grid's own held-out intervals, never on a projection (an sd
from 4 seeds is itself uncertain).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from bench.harness.summary import T_975

# Issue 42's bound on the paired 95% half-width of held-out macro answer loss at 30% kept.
INTERVAL_GOAL = 0.03
# The differences the bound is on: (setting, its paired partner), at the headline fraction.
POWER_PAIRS = (("full_cut", "vs_random"), ("recommended_small", "vs_random"))


def projected_half_width(half_width: float, seeds: int, target_seeds: int) -> float:
    """The 95% half-width a mean over `target_seeds` paired seeds would have, from one over `seeds` seeds."""
    if seeds < 2 or target_seeds < 2:
        raise ValueError(f"an interval needs at least 2 seeds (got {seeds} and {target_seeds})")
    spread = half_width * math.sqrt(seeds) / T_975.get(seeds - 1, 1.96)
    return T_975.get(target_seeds - 1, 1.96) * spread / math.sqrt(target_seeds)


def power_rows(summary: Mapping[str, Any], fraction: float = 0.3, target_seeds: int = 8,
               goal: float = INTERVAL_GOAL, pairs: Sequence[tuple[str, str]] = POWER_PAIRS) -> list[dict[str, Any]]:
    """For each of `pairs` in a split's summary (the report's JSON "summaries"[split]): the measured difference,
    its half-width over the run's seeds, the half-width projected to `target_seeds`, and whether that is within
    `goal`. A pair the run did not measure is left out."""
    rows = []
    for method, partner in pairs:
        entry = summary["settings"].get(f"{method}_f{fraction:g}", {}).get(partner, {}).get("loss_macro")
        if entry is None or entry["n"] < 2:
            continue
        projected = projected_half_width(entry["ci"], entry["n"], target_seeds)
        rows.append({"setting": f"{method}_f{fraction:g}", "partner": partner, "mean": entry["mean"],
                     "ci": entry["ci"], "seeds": entry["n"], "projected_ci": projected,
                     "target_seeds": target_seeds, "within_goal": projected <= goal})
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, help="a quality run's JSON (bench/results/real/NAME.json)")
    parser.add_argument("--seeds", type=int, default=8, help="the seeds to project to (default 8)")
    parser.add_argument("--split", default="validation", choices=("validation", "heldout"))
    parser.add_argument("--goal", type=float, default=INTERVAL_GOAL)
    args = parser.parse_args(argv)
    report = json.loads(args.results.read_text())
    rows = power_rows(report["summaries"][args.split], target_seeds=args.seeds, goal=args.goal)
    if not rows:
        sys.stderr.write(f"{args.results}: no {', '.join(m for m, _ in POWER_PAIRS)} rows against random\n")
        return 1
    gate = report.get("gate", {})
    sys.stdout.write(f"{args.results.name} ({args.split}; calibration gate "
                     f"{'passed' if gate.get('passed') else 'NOT passed'})\n")
    for row in rows:
        sys.stdout.write(f"  {row['setting']} {row['partner']}: {row['mean']:+.3f} ± {row['ci']:.3f} over "
                         f"{row['seeds']} seeds -> ± {row['projected_ci']:.3f} at {row['target_seeds']} "
                         f"({'within' if row['within_goal'] else 'outside'} ± {args.goal:g})\n")
    sys.stdout.write(f"all within the goal: {'yes' if all(r['within_goal'] for r in rows) else 'no'}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
