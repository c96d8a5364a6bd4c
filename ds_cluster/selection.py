"""Stage 3: how many samples each cluster keeps, which ones, and their loss weights.

Pure numpy. Budget rules (s_c kept of n_c, S kept of N):
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
from typing import Literal, Optional

import numpy as np

BudgetMode = Literal["min", "proportional", "equal", "neyman"]
Strategy = Literal["peripheral", "core", "random", "mix", "norm", "spread", "kcenter"]


def cluster_budgets(
    cluster_sizes: np.ndarray,
    mode: BudgetMode,
    ratio: float,
    budget_samples: Optional[int] = None,
    cluster_spreads: Optional[np.ndarray] = None,
) -> np.ndarray:
    """Kept count per cluster (int64, K), each between 1 and the cluster's size."""
    sizes = np.asarray(cluster_sizes, dtype=np.int64)
    if sizes.size == 0 or (sizes < 1).any():
        empty = np.flatnonzero(sizes < 1).tolist()
        raise ValueError(f"every cluster needs at least one sample; clusters {empty} are empty")
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"budget_ratio must be in (0, 1], got {ratio}")
    if mode == "min":
        per_cluster = math.floor(ratio * int(sizes.min()) + 1e-9)
        if per_cluster < 1:
            raise ValueError(
                f"budget_mode 'min' keeps floor(budget_ratio {ratio} x smallest cluster {int(sizes.min())}) = 0 "
                "samples per cluster, leaving every cluster with no sample; raise budget_ratio or lower num_clusters"
            )
        return np.full(sizes.shape, per_cluster, dtype=np.int64)

    total = int(budget_samples) if budget_samples is not None else int(round(ratio * int(sizes.sum())))
    total = min(total, int(sizes.sum()))
    if total < sizes.size:
        raise ValueError(
            f"a budget of {total} samples leaves some of the {sizes.size} clusters with no sample; "
            "raise budget_ratio / budget_samples or lower num_clusters"
        )
    if mode == "equal":
        return _water_fill(sizes, total)
    if mode == "proportional":
        return _proportional(sizes, total)
    if mode == "neyman":
        if total == int(sizes.sum()):
            return sizes.copy()  # everything kept: the spreads cannot change anything, so none are needed
        if cluster_spreads is None:
            raise ValueError("budget_mode 'neyman' needs features (the clusters' spreads) and there are none "
                             "(labels only); set budget_mode 'proportional', 'equal' or 'min', or pass the features")
        spreads = np.asarray(cluster_spreads, dtype=np.float64)
        priority = sizes * spreads
        if not np.isfinite(priority).all() or priority.sum() <= 0:
            priority = sizes.astype(np.float64)  # every cluster is a single point: spread says nothing
        # One sample per cluster first, so no cluster is dropped; the rest by priority.
        return 1 + apportion(total - sizes.size, priority, sizes - 1)
    raise ValueError(f"budget_mode must be one of min, proportional, equal, neyman; got {mode!r}")


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


def stable_label_order(labels: np.ndarray) -> np.ndarray:
    """Indices that sort `labels` (small non-negative ints) stably: a radix sort on int16 when they fit."""
    labels = np.asarray(labels)
    if labels.size and 0 <= labels.min() and labels.max() < np.iinfo(np.int16).max:
        return np.argsort(labels.astype(np.int16), kind="stable")  # radix sort: 4x faster at N = 10M
    return np.argsort(labels, kind="stable")


def cluster_spreads(distances: np.ndarray, labels: np.ndarray, num_clusters: int) -> np.ndarray:
    """sigma_c: root mean squared distance of a cluster's members to its centroid."""
    counts = np.bincount(labels, minlength=num_clusters)
    sums = np.bincount(labels, weights=np.asarray(distances, dtype=np.float64) ** 2, minlength=num_clusters)
    return np.sqrt(sums / np.maximum(counts, 1))


def select_in_clusters(
    labels: np.ndarray,
    kept_sizes: np.ndarray,
    strategy: Strategy,
    *,
    distances: Optional[np.ndarray] = None,
    norms: Optional[np.ndarray] = None,
    features: Optional[np.ndarray] = None,
    seed: int = 0,
) -> np.ndarray:
    """Sorted int64 indices: in each cluster c, kept_sizes[c] samples chosen by the strategy.

    peripheral: farthest from the centroid; core: nearest; random: uniform;
    mix: half peripheral, half core; norm: largest feature norm; spread:
    evenly over the quantiles of the distance to the centroid (core, middle
    and edge alike); kcenter: greedy farthest-point (k-centre) coverage of the
    cluster in feature space, starting from the sample nearest the centroid.
    Ties go to the lower index, so the choice is the same everywhere. Samples
    with a negative label (excluded) are never chosen. Long because this
    docstring defines every strategy; the body is one dispatch.
    """
    labels = np.asarray(labels, dtype=np.int64)
    kept_sizes = np.asarray(kept_sizes, dtype=np.int64)
    rng = np.random.default_rng([seed, 0x5E1EC7])
    taking_part = labels >= 0
    everyone = bool(taking_part.all())
    counts = np.bincount(labels if everyone else labels[taking_part], minlength=kept_sizes.size)
    if np.array_equal(counts, kept_sizes):  # everything is kept: nothing to choose
        return np.arange(labels.size, dtype=np.int64) if everyone else np.flatnonzero(taking_part)
    valid_rows = np.arange(labels.size, dtype=np.int64) if everyone else np.flatnonzero(taking_part)
    valid_labels = labels if everyone else labels[valid_rows]
    if strategy in ("peripheral", "core", "mix", "spread", "kcenter") and distances is None:
        raise ValueError(f"selection '{strategy}' needs features (distances to centroids); use 'random' without them")
    if strategy == "norm" and norms is None:
        raise ValueError("selection 'norm' needs features (their norms); use 'random' without them")
    sort_key = _sort_key(strategy, labels.size, distances, norms, rng)
    if strategy == "kcenter" and features is None:
        raise ValueError("selection 'kcenter' needs the features themselves; use 'spread' or 'random' without them")

    # Order by cluster, then key, then index: two stable sorts (a 3-key lexsort is slow at N = 10M).
    by_key = np.argsort(sort_key[valid_rows], kind="stable")
    order = by_key[stable_label_order(valid_labels[by_key])]
    grouped = valid_rows[order]
    group_labels = valid_labels[order]
    starts = np.searchsorted(group_labels, np.arange(kept_sizes.size))
    ends = np.searchsorted(group_labels, np.arange(kept_sizes.size), side="right")
    chosen = []
    for cluster, (start, end) in enumerate(zip(starts, ends)):
        keep = int(kept_sizes[cluster])
        if keep > end - start:
            raise ValueError(f"cluster {cluster} has {end - start} samples, cannot keep {keep}")
        members = grouped[start:end]
        if strategy == "mix":
            from_edge = (keep + 1) // 2
            chosen.append(members[:from_edge])
            chosen.append(members[len(members) - (keep - from_edge):] if keep - from_edge else members[:0])
        elif strategy == "spread":
            # members are ordered by distance: take the middle of each of `keep` equal slices.
            chosen.append(members[((np.arange(keep) + 0.5) * len(members) / keep).astype(np.int64)])
        elif strategy == "kcenter":
            chosen.append(k_center_greedy(features, members, keep))
        else:
            chosen.append(members[:keep])
    return np.sort(np.concatenate(chosen)).astype(np.int64)


def _sort_key(strategy: str, size: int, distances: Optional[np.ndarray], norms: Optional[np.ndarray],
              rng: np.random.Generator) -> np.ndarray:
    """The order a strategy reads each cluster in (ascending key first)."""
    if strategy == "random":
        return rng.permutation(size)
    if strategy in ("peripheral", "mix"):
        return -np.asarray(distances, dtype=np.float64)
    if strategy in ("core", "spread", "kcenter"):
        return np.asarray(distances, dtype=np.float64)
    if strategy == "norm":
        return -np.asarray(norms, dtype=np.float64)
    raise ValueError(f"selection must be one of peripheral, core, random, mix, norm, spread, kcenter; got {strategy!r}")


def k_center_greedy(features: np.ndarray, members: np.ndarray, keep: int) -> np.ndarray:
    """`keep` of `members` chosen greedily, each the farthest from those chosen so far (k-centre).

    `members` comes ordered by distance to the centroid: the first pick is the
    most central sample. Cost O(keep x len(members) x d).
    """
    points = np.asarray(features[members], dtype=np.float64)
    picked = [0]
    nearest = np.linalg.norm(points - points[0], axis=1)
    for _ in range(keep - 1):
        candidate = int(np.argmax(nearest))  # first index among ties
        picked.append(candidate)
        nearest = np.minimum(nearest, np.linalg.norm(points - points[candidate], axis=1))
    return members[np.asarray(picked, dtype=np.int64)]


def sample_weights(
    labels: np.ndarray,
    selected: np.ndarray,
    cluster_sizes: np.ndarray,
    kept_sizes: np.ndarray,
    weighting: Literal["cluster", "none"],
) -> np.ndarray:
    """Per-sample loss weight (N,) float64: w = (n_c / N) / (s_c / S) when kept, 0 otherwise.

    The kept samples of cluster c then carry n_c / N of the total weight, so
    the weighted mean over the subset estimates the full-data mean; the mean
    weight over kept samples is 1. With "none", kept samples weigh 1.
    """
    labels = np.asarray(labels, dtype=np.int64)
    if weighting == "none" and selected.size == labels.size:
        return np.ones(labels.size, dtype=np.float64)
    weights = np.zeros(labels.size, dtype=np.float64) if selected.size != labels.size else None
    if weighting == "none":
        weights[selected] = 1.0
        return weights
    if weighting != "cluster":
        raise ValueError(f"weighting must be 'cluster' or 'none', got {weighting!r}")
    sizes = np.asarray(cluster_sizes, dtype=np.float64)
    kept = np.asarray(kept_sizes, dtype=np.float64)
    per_cluster = (sizes / sizes.sum()) / (kept / kept.sum())
    if selected.size == labels.size:  # everything kept: one gather, no scatter
        return per_cluster[labels]
    weights[selected] = per_cluster[labels[selected]]
    return weights
