"""What the near-duplicate threshold does to a targeted analysis's `round_robin` pick, replayed on its saved features.

    python bench/near_duplicate_replay.py runs/bench_smollm2_smoke_targeted_smollm2 \
        k_feature_kindhidden_num_clusters8_s0_aqua --group aqua

Reads a targeted run's analysis folder (features.npy, target_features.npy, labels.npy, written with keep_features)
and the run's data/train.jsonl (each record's `family`), and prints: the largest dimension's mean |value| against
the median one's (how anisotropic the rows are), the target group's own pairs (median cosine, share at or above
each threshold), the share of the target group among the 10 records nearest each target example, and the target
group's share of the library's `round_robin` pick at each threshold, plain and with `dedup_centre` (the test on the
rows less the pool's mean unit row; the budget: the run's record of it). The
figures docs/targeted.md gives for SmolLM2's hidden features ("Near-duplicates") come from this command.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ds_cluster.planning.targeted import round_robin, unit_rows  # noqa: E402

THRESHOLDS = (0.95, 0.99, 1.0)
NEAREST = 10


def replay(work: Path, analysis: str, group: str) -> dict:
    folder = work / "analyses" / analysis
    features = unit_rows(np.load(folder / "features.npy"))
    examples = unit_rows(np.load(folder / "target_features.npy"))
    labels = np.load(folder / "labels.npy")
    groups = np.array([json.loads(line)["family"] for line in (work / "data" / "train.jsonl").open()])
    budget = json.loads((work / "targets" / "draws.json").read_text())["budget"]
    mine = features[groups == group]
    pairs = (mine @ mine.T)[np.triu_indices(len(mine), 1)]
    nearest = np.argsort(-(examples @ features.T), axis=1)[:, :NEAREST]
    magnitude = np.abs(features).mean(axis=0)
    rows = np.flatnonzero(labels >= 0)
    target = SimpleNamespace(features=examples, groups=np.zeros(len(examples), dtype=np.int64))
    def share(threshold: float, centre: bool) -> float:
        pick = round_robin(features, rows, target, budget, threshold, clusters=labels[rows], dedup_centre=centre)
        return float((groups[pick] == group).mean())

    picks = {threshold: share(threshold, False) for threshold in THRESHOLDS}
    centred = {threshold: share(threshold, True) for threshold in THRESHOLDS}
    return {"largest_dimension": float(magnitude.max()), "median_dimension": float(np.median(magnitude)),
            "pairs_median_cosine": float(np.median(pairs)),
            "pairs_at_or_above": {t: float((pairs >= t).mean()) for t in THRESHOLDS},
            "nearest_share": float((groups[nearest] == group).mean()), "budget": budget,
            "round_robin_share": picks, "round_robin_share_dedup_centre": centred}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("work", type=Path, help="a targeted run's work folder")
    parser.add_argument("analysis", help="its targeted analysis folder's name, under analyses/")
    parser.add_argument("--group", required=True, help="the target's task group")
    args = parser.parse_args()
    print(json.dumps(replay(args.work, args.analysis, args.group), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
