"""Stage 5a, the budget: how many samples each cluster keeps (s_c kept of n_c, S kept of N).

Pure numpy. Each rule is an object in `BUDGETS` (the `budget_mode` key):
- "min" (paper): every cluster keeps floor(r * m), m the smallest cluster.
- "proportional": S = budget_samples or round(r * N); every cluster keeps
  floor or ceil of its share S * n_c / N (largest remainder), and at least 1.
- "equal": S filled evenly, smallest cluster first (water-filling: clusters
  below the level keep everything, the others share what is left).
- "neyman": one per cluster, the rest in proportion to n_c * sigma_c (sigma_c
  the cluster's feature spread), capped at n_c: the minimum-variance
  stratified allocation.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import ClassVar, Optional, Union

import numpy as np

from ds_cluster.registry import Registry


class BudgetRule(ABC):
    """How a budget is shared among clusters of given sizes."""

    name: ClassVar[str]
    # Whether the rule reads each cluster's feature spread (so the plan must compute it from the distances).
    needs_spreads: ClassVar[bool] = False

    @abstractmethod
    def kept_sizes(self, sizes: np.ndarray, ratio: float, total: int, spreads: Optional[np.ndarray]) -> np.ndarray:
        """Kept count per cluster for checked `sizes` (all >= 1); `total` is S, already checked against K."""

    # Whether S is budget_samples or r x N (min ignores both: it reads r and the smallest cluster).
    uses_total: ClassVar[bool] = True


class MinBudget(BudgetRule):
    """The paper's: every cluster keeps floor(r x the smallest cluster)."""

    name = "min"
    uses_total = False

    def kept_sizes(self, sizes: np.ndarray, ratio: float, total: int, spreads: Optional[np.ndarray]) -> np.ndarray:
        per_cluster = math.floor(ratio * int(sizes.min()) + 1e-9)
        if per_cluster < 1:
            raise ValueError(
                f"budget_mode 'min' keeps floor(budget_ratio {ratio} x smallest cluster {int(sizes.min())}) = 0 "
                "samples per cluster, leaving every cluster with no sample; raise budget_ratio or lower num_clusters"
            )
        return np.full(sizes.shape, per_cluster, dtype=np.int64)


class ProportionalBudget(BudgetRule):
    """Each cluster keeps its share of S, within one (largest remainder), at least 1."""

    name = "proportional"

    def kept_sizes(self, sizes: np.ndarray, ratio: float, total: int, spreads: Optional[np.ndarray]) -> np.ndarray:
        return _proportional(sizes, total)


class EqualBudget(BudgetRule):
    """S filled evenly, smallest cluster first (water-filling)."""

    name = "equal"

    def kept_sizes(self, sizes: np.ndarray, ratio: float, total: int, spreads: Optional[np.ndarray]) -> np.ndarray:
        return _water_fill(sizes, total)


class NeymanBudget(BudgetRule):
    """One per cluster, the rest in proportion to n_c x sigma_c: the minimum-variance stratified allocation."""

    name = "neyman"
    needs_spreads = True

    def kept_sizes(self, sizes: np.ndarray, ratio: float, total: int, spreads: Optional[np.ndarray]) -> np.ndarray:
        if total == int(sizes.sum()):
            return sizes.copy()  # everything kept: the spreads cannot change anything, so none are needed
        if spreads is None:
            raise ValueError("budget_mode 'neyman' needs features (the clusters' spreads) and there are none "
                             "(labels only); set budget_mode 'proportional', 'equal' or 'min', or pass the features")
        priority = sizes * np.asarray(spreads, dtype=np.float64)
        if not np.isfinite(priority).all() or priority.sum() <= 0:
            priority = sizes.astype(np.float64)  # every cluster is a single point: spread says nothing
        # One sample per cluster first, so no cluster is dropped; the rest by priority.
        return 1 + apportion(total - sizes.size, priority, sizes - 1)


BUDGETS: Registry[BudgetRule] = Registry(
    "budget_mode", (MinBudget(), ProportionalBudget(), EqualBudget(), NeymanBudget()))


def cluster_budgets(
    cluster_sizes: np.ndarray,
    mode: Union[str, BudgetRule],
    ratio: float,
    budget_samples: Optional[int] = None,
    cluster_spreads: Optional[np.ndarray] = None,
) -> np.ndarray:
    """Kept count per cluster (int64, K), each between 1 and the cluster's size, by the rule `mode` names."""
    rule = BUDGETS.get_rule(mode)
    sizes = np.asarray(cluster_sizes, dtype=np.int64)
    if sizes.size == 0 or (sizes < 1).any():
        empty = np.flatnonzero(sizes < 1).tolist()
        raise ValueError(f"every cluster needs at least one sample; clusters {empty} are empty")
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"budget_ratio must be in (0, 1], got {ratio}")
    total = budget_total(sizes, ratio, budget_samples)
    if rule.uses_total and total < sizes.size:
        raise ValueError(
            f"a budget of {total} samples leaves some of the {sizes.size} clusters with no sample; "
            "raise budget_ratio / budget_samples or lower num_clusters"
        )
    return rule.kept_sizes(sizes, ratio, total, cluster_spreads)


def budget_total(cluster_sizes: np.ndarray, ratio: float, budget_samples: Optional[int] = None) -> int:
    """S: `budget_samples`, else round(r x N), at most N (the samples taking part)."""
    available = int(np.asarray(cluster_sizes, dtype=np.int64).sum())
    total = int(budget_samples) if budget_samples is not None else int(round(ratio * available))
    return min(total, available)


def _proportional(sizes: np.ndarray, total: int) -> np.ndarray:
    """Each cluster floor or ceil of total * n_c / N (largest remainders get the ceiling), at least 1.

    A cluster whose share is below 1 keeps 1 (within one of its share), so the
    sum can exceed `total` by at most the number of such clusters.
    """
    shares = total * sizes / sizes.sum()
    kept = np.maximum(np.floor(shares + 1e-9).astype(np.int64), 1)
    leftover = total - int(kept.sum())
    if leftover > 0:
        remainders = np.where(kept < shares, shares - kept, -1.0)
        order = np.lexsort((np.arange(sizes.size), -remainders))
        kept[order[:leftover]] += 1
    return np.minimum(kept, sizes)


def apportion(total: int, priority: np.ndarray, caps: np.ndarray) -> np.ndarray:
    """Integers x <= caps summing to min(total, sum caps), proportional to priority (largest remainder)."""
    caps = np.asarray(caps, dtype=np.int64)
    priority = np.asarray(priority, dtype=np.float64)
    total = min(int(total), int(caps.sum()))
    result = np.zeros(caps.shape, dtype=np.int64)
    saturated = caps <= 0
    while True:
        open_ = ~saturated & (priority > 0)
        remaining = total - int(caps[saturated].sum())
        if not open_.any() or remaining <= 0:
            break
        ideal = remaining * priority * open_ / priority[open_].sum()
        newly = open_ & (ideal >= caps)
        if not newly.any():
            base = np.floor(ideal + 1e-9).astype(np.int64)
            base = np.minimum(base, caps) * open_
            leftover = remaining - int(base.sum())
            remainders = np.where(open_ & (base < caps), ideal - base, -1.0)
            order = np.lexsort((np.arange(caps.size), -remainders))
            base[order[:max(leftover, 0)]] += 1
            result = np.where(saturated, caps, base)
            return _fill_shortfall(result, caps, total)
        saturated |= newly
    result = np.where(saturated, caps, 0)
    return _fill_shortfall(result, caps, total)


def _fill_shortfall(result: np.ndarray, caps: np.ndarray, total: int) -> np.ndarray:
    # Zero-priority clusters with room take any units the proportional rule could not place.
    shortfall = total - int(result.sum())
    for index in range(caps.size):
        if shortfall <= 0:
            break
        extra = min(shortfall, int(caps[index] - result[index]))
        result[index] += extra
        shortfall -= extra
    return result


def _water_fill(sizes: np.ndarray, total: int) -> np.ndarray:
    """Even fill, smallest first: the highest level L with sum(min(n_c, L)) <= S, then +1 by index."""
    low, high = 0, int(sizes.max())
    while low < high:
        level = (low + high + 1) // 2
        if int(np.minimum(sizes, level).sum()) <= total:
            low = level
        else:
            high = level - 1
    kept = np.minimum(sizes, low)
    leftover = total - int(kept.sum())
    room = np.flatnonzero(kept < sizes)
    kept[room[:leftover]] += 1
    return kept


def cluster_spreads(distances: np.ndarray, labels: np.ndarray, num_clusters: int) -> np.ndarray:
    """sigma_c: root mean squared distance of a cluster's members to its centroid."""
    counts = np.bincount(labels, minlength=num_clusters)
    sums = np.bincount(labels, weights=np.asarray(distances, dtype=np.float64) ** 2, minlength=num_clusters)
    return np.sqrt(sums / np.maximum(counts, 1))
