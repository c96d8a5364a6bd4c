"""The targeted selections' diagnostics that need no training, read from the run's targeted analyses (the pool's
features, their clusters and the target examples' features, as the job wrote them) with the library's own
`round_robin`:

- K = 8: the selection from the first 8 examples of each group of the same draw, beside the K = 32 one the arm
  trained on (the target's share of each, and how much of the K = 32 selection the K = 8 one repeats);
- retrieval: the target examples injected into the pool must be the first records taken (RDS+'s sanity check).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from bench.harness.arms import Arm
from ds_cluster.analysis.folder import AnalysisDir
from ds_cluster.planning.targeted import round_robin

SMALL_K = 8
DEDUP_SIMILARITY = 0.95  # the candidates' (the block's default)


@dataclass(frozen=True)
class _Rows:
    features: np.ndarray
    groups: np.ndarray


def first_per_group(groups: np.ndarray, count: int) -> np.ndarray:
    """Indices of the first `count` examples of every group (the draw's order)."""
    chosen = [np.flatnonzero(groups == group)[:count] for group in np.unique(groups)]
    return np.sort(np.concatenate(chosen))


def targeted_diagnostics(arms: Sequence[Arm], results: Mapping[str, dict], analyses: Mapping[str, Any],
                         pool_groups: np.ndarray, target_groups: Mapping[str, Sequence[str]]) -> list[dict]:
    """One row per round_robin arm: the target's share of its K = 32 selection and of the K = 8 one, their overlap,
    and the share of injected target examples taken first."""
    rows = []
    for arm in arms:
        block = arm.cluster_sampling
        if block.get("selection") != "round_robin" or arm.name not in results or arm.target is None:
            continue
        folder = AnalysisDir(Path(analyses[arm.analysis].path))
        target = folder.load_target()
        if target is None:
            continue
        inputs = folder.load_inputs(int(pool_groups.size))
        features = np.asarray(inputs.features)
        taking_part = np.flatnonzero(~inputs.exclude) if inputs.exclude is not None else np.arange(features.shape[0])
        clusters = np.asarray(inputs.labels)[taking_part] if inputs.labels is not None else None
        budget = int(block["budget_samples"])
        trained = np.asarray(results[arm.name]["selected"], dtype=np.int64)
        small = first_per_group(target.groups, SMALL_K)
        small_rows = _Rows(target.features[small], target.groups[small])
        picked = round_robin(features, taking_part, small_rows, budget, DEDUP_SIMILARITY, clusters)
        wanted = list(target_groups[arm.target])
        injected = np.vstack([features, target.features])
        new_rows = np.arange(features.shape[0], injected.shape[0])
        first = round_robin(injected, np.concatenate([taking_part, new_rows]), _Rows(target.features, target.groups),
                            new_rows.size, 1.01, None)  # no near-duplicate test: the examples themselves
        rows.append({"arm": arm.name, "method": arm.method, "target": arm.target, "seed": arm.seed,
                     "share_k32": float(np.isin(pool_groups[trained], wanted).mean()),
                     "share_k8": float(np.isin(pool_groups[picked], wanted).mean()),
                     "k8_in_k32": float(np.isin(picked, trained).mean()),
                     "retrieved_first": float(np.isin(new_rows, first).mean())})
    return rows


def diagnostics_table(rows: Sequence[dict]) -> list[str]:
    """Per method, averaged over targets and seeds."""
    lines = ["| method | arms | target's share, K = 32 | target's share, K = 8 | K = 8 selection also in K = 32's | "
             "injected target examples taken first |", "|---|---|---|---|---|---|"]
    for method in sorted({row["method"] for row in rows}):
        mine = [row for row in rows if row["method"] == method]
        mean = {key: float(np.mean([row[key] for row in mine]))
                for key in ("share_k32", "share_k8", "k8_in_k32", "retrieved_first")}
        lines.append(f"| {method} | {len(mine)} | {mean['share_k32']:.3f} | {mean['share_k8']:.3f} | "
                     f"{mean['k8_in_k32']:.3f} | {mean['retrieved_first']:.3f} |")
    return lines
