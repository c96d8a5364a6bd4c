"""Replay an adaptive run's schedule log through the automatic budget's stopping signals (training data only).

    python bench/replay_auto.py bench/results/real/auto_t0_s0.schedule.jsonl

For each signal of ds_cluster/planning/auto.py (its defaults, patience 3 for the relative rule and 2 for the
fitted ones, as bench/candidates.json's "auto_signal" list declares them), the step each cluster would have
stopped at on this log's per-cluster window losses; and every 20 steps, each cluster's learning curve (a power
law over its last 8 windows): how much lower its loss would be after as many steps again. What the thresholds
of the declared candidates were set from; the choice itself is made on validation.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ds_cluster.planning.auto import AutoState, auto_step, fitted_curve  # noqa: E402
from ds_cluster.settings import ScheduleSettings  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log", type=Path, help="a schedule log (one JSON line per window)")
    args = parser.parse_args(argv)
    lines = [json.loads(line) for line in args.log.read_text().splitlines() if line.strip()]
    num_clusters = len(lines[0]["train_loss"])
    for signal, patience in (("relative", 3), ("curve", 2), ("floor", 2)):
        rule, state = ScheduleSettings(signal=signal, patience=patience), AutoState.empty(num_clusters)
        for line in lines:
            losses = np.array([np.nan if value is None else value for value in line["train_loss"]])
            state, _ = auto_step(state, losses, line["step"], rule)
        print(f"{signal:9s} stops at steps {[None if stop is None else stop['step'] for stop in state.stops]}")
    history: list[list] = [[] for _ in range(num_clusters)]
    print("step  learning curve: relative fall after as many steps again, per cluster")
    for line in lines:
        row = []
        for cluster, loss in enumerate(line["train_loss"]):
            if loss is not None:
                history[cluster] = (history[cluster] + [[line["step"], loss]])[-8:]
            curve = fitted_curve(history[cluster]) if len(history[cluster]) == 8 else None
            row.append("   .  " if curve is None else f"{1 - 2 ** curve[1]:+.2f}")
        if line["step"] % 20 == 0:
            print(f"{line['step']:4d}  " + " ".join(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
