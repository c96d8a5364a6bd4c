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
from typing import Literal, Optional, get_args

import numpy as np

from ds_cluster.diversity import k_center_greedy, semantic_dedup

BudgetMode = Literal["min", "proportional", "equal", "neyman"]
Strategy = Literal["peripheral", "core", "random", "mix", "norm", "spread", "kcenter", "semdedup"]
FEATURE_SELECTIONS = ("norm", "kcenter", "semdedup")  # they read the feature rows, not only the distances


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
    """Indices that sort `labels` (small non-negative ints) stably: a radix sort on uint8 or int16 when they fit."""
    labels = np.asarray(labels)
    if labels.size and 0 <= labels.min():
        top = int(labels.max())
        for small in (np.uint8, np.int16):  # radix sort: 4x faster at N = 10M; one pass fewer for uint8
            if top <= np.iinfo(small).max:
                return np.argsort(labels.astype(small), kind="stable")
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
    dedup_similarity: float = 0.95,
) -> np.ndarray:
    """Sorted int64 indices: in each cluster c, kept_sizes[c] samples chosen by the strategy.

    peripheral: farthest from the centroid; core: nearest; random: uniform (the
    smallest of one seeded uniform key per sample); mix: half peripheral, half
    core; norm: largest feature norm; spread: evenly over the quantiles of the
    distance to the centroid (core, middle and edge alike); kcenter: greedy
    farthest-point (k-centre) coverage of the cluster in feature space,
    starting from the sample nearest the centroid; semdedup: the random
    strategy's order with near-duplicates (cosine similarity >= dedup_similarity
    to an earlier member) skipped, see `semantic_dedup`. Ties go to the lower
    index, so the choice is the same everywhere. Samples with a negative label
    (excluded) are never chosen. Long because this docstring defines every
    strategy; the body checks the inputs, then reads each cluster as it says.
    """
    labels = np.asarray(labels, dtype=np.int64)
    kept_sizes = np.asarray(kept_sizes, dtype=np.int64)
    rng = np.random.default_rng([seed, 0x5E1EC7])
    taking_part = labels >= 0
    everyone = bool(taking_part.all())
    counts = np.bincount(labels if everyone else labels[taking_part], minlength=kept_sizes.size)
    if np.array_equal(counts, kept_sizes):  # everything is kept: nothing to choose
        return np.arange(labels.size, dtype=np.int64) if everyone else np.flatnonzero(taking_part)
    if strategy in ("peripheral", "core", "mix", "spread", "kcenter") and distances is None:
        raise ValueError(f"selection '{strategy}' needs features (distances to centroids); use 'random' without them")
    if strategy == "norm" and norms is None:
        raise ValueError("selection 'norm' needs features (their norms); use 'random' without them")
    if strategy not in get_args(Strategy):
        raise ValueError(f"selection must be one of {', '.join(get_args(Strategy))}; got {strategy!r}")
    if strategy in ("kcenter", "semdedup") and features is None:
        fallback = "'spread' or 'random'" if distances is not None else "'random'"  # spread reads the distances
        raise ValueError(f"selection '{strategy}' needs the features themselves; use {fallback} without them")
    too_many = np.flatnonzero(kept_sizes > counts[:kept_sizes.size])
    if too_many.size:
        cluster = int(too_many[0])
        raise ValueError(f"cluster {cluster} has {int(counts[cluster])} samples, "
                         f"cannot keep {int(kept_sizes[cluster])}")
    if strategy == "random":
        return _random_in_clusters(labels, kept_sizes, counts, rng)
    # semdedup reads a cluster in random's seeded order (so without near-duplicates it keeps what random keeps).
    random_keys = rng.random(labels.size) if strategy == "semdedup" else None

    # Each cluster's members in index order: one radix sort of the labels, no sort of N keys. A cluster is then
    # read in the order of its key (ties: lower index first), found by partition or a sort of that cluster alone.
    if everyone:
        grouped = stable_label_order(labels)
    else:
        valid_rows = np.flatnonzero(taking_part)
        grouped = valid_rows[stable_label_order(labels[valid_rows])]
    ends = np.cumsum(counts[:kept_sizes.size])
    chosen = np.zeros(labels.size, dtype=bool)
    for cluster, (end, keep) in enumerate(zip(ends.tolist(), kept_sizes.tolist())):
        members = grouped[end - int(counts[cluster]):end]
        if random_keys is not None:
            ordered = members[_stable_argsort(random_keys[members])]
            chosen[semantic_dedup(features, ordered, keep, dedup_similarity)] = True  # type: ignore[arg-type]
            continue
        keys = _member_keys(strategy, members, distances, norms)
        if strategy == "mix":
            # The first (keep + 1) // 2 of the order (the edge) and its last keep // 2 (the core): all
            # but its first len - keep // 2.
            from_edge, from_core = (keep + 1) // 2, keep // 2
            chosen[members[_first_in_order(keys, from_edge)]] = True
            if from_core:
                far_end = np.ones(members.size, dtype=bool)
                far_end[_first_in_order(keys, members.size - from_core)] = False
                chosen[members[far_end]] = True
        elif strategy == "spread":
            # In distance order, take the middle of each of `keep` equal slices.
            middles = ((np.arange(keep) + 0.5) * len(members) / keep).astype(np.int64)
            chosen[members[_stable_argsort(keys)[middles]]] = True
        elif strategy == "kcenter":
            chosen[k_center_greedy(features, members[_stable_argsort(keys)], keep)] = True
        else:
            chosen[members[_first_in_order(keys, keep)]] = True
    return np.flatnonzero(chosen).astype(np.int64, copy=False)


def _random_in_clusters(labels: np.ndarray, kept_sizes: np.ndarray, counts: np.ndarray,
                        rng: np.random.Generator) -> np.ndarray:
    """Uniform choice: in each cluster c, the kept_sizes[c] members with the smallest of one seeded uniform
    key per row (float64; ties, vanishingly rare, to the lower index). Sorted int64 indices.

    No sort of N and no random access into N-sized arrays (a permutation of N
    and sorts did this before issue 22, 2 to 3x slower on a busy machine): a
    histogram of (cluster, key bin) says in which bin each cluster's last
    kept key lies; rows in an earlier bin are kept, and only the rows in
    their cluster's boundary bin (about N / KEY_BINS of them) are sorted.
    """
    keys = rng.random(labels.size)  # one key per row of all N: a row's key does not depend on who is left out
    num_clusters = kept_sizes.size
    rows = counts.size + 1  # histogram row 0: left out (label -1); row c + 1: cluster c
    num_bins = KEY_BINS
    while num_bins > 1 and rows * num_bins > _MAX_HISTOGRAM:
        num_bins //= 2
    # Scaled in place by a power of two, which is exact: the keys keep their order and ties, and their
    # integer parts are the bins.
    keys *= num_bins
    bins = keys.astype(np.int32)
    cell = labels + 1  # int64: bincount casts anything narrower to it first
    cell *= num_bins
    cell += bins
    histogram = np.bincount(cell, minlength=rows * num_bins).reshape(rows, num_bins)
    del cell
    upto = np.cumsum(histogram[1:num_clusters + 1], axis=1)  # (K, bins): members with a key in bins <= b
    boundary = np.argmax(upto >= kept_sizes[:, None], axis=1)
    in_earlier_bins = np.where(boundary > 0, upto[np.arange(num_clusters), boundary - 1], 0)
    # Read by label; the last entry, read by label -1, is -1 (no bin), as for a cluster keeping nothing.
    boundary_of_label = np.full(rows, -1, dtype=np.int32)
    boundary_of_label[:num_clusters] = np.where(kept_sizes > 0, boundary, -1)
    boundary_here = boundary_of_label[labels]
    chosen = bins < boundary_here
    candidates = np.flatnonzero(bins == boundary_here)
    del bins, boundary_here
    # In each cluster's boundary bin, by (key, index): the first kept_sizes[c] - in_earlier_bins[c] are kept.
    candidate_labels = labels[candidates]
    order = np.lexsort((candidates, keys[candidates], candidate_labels))
    sorted_labels = candidate_labels[order]
    rank = np.arange(order.size) - np.searchsorted(sorted_labels, sorted_labels)
    chosen[candidates[order][rank < (kept_sizes - in_earlier_bins)[sorted_labels]]] = True
    return np.flatnonzero(chosen).astype(np.int64, copy=False)


# Key bins per cluster in the random selection's histogram (fewer when clusters are many, so that the
# histogram stays within _MAX_HISTOGRAM cells); about N / KEY_BINS rows are sorted at the end.
KEY_BINS = 4096
_MAX_HISTOGRAM = 1 << 22

# Which per-sample value orders a cluster for each strategy but random, and its sign (ascending key read first).
_KEY_SOURCE: dict[str, tuple[str, float]] = {
    "peripheral": ("distances", -1.0), "mix": ("distances", -1.0), "core": ("distances", 1.0),
    "spread": ("distances", 1.0), "kcenter": ("distances", 1.0), "norm": ("norms", -1.0),
}


def _member_keys(strategy: str, members: np.ndarray, distances: Optional[np.ndarray],
                 norms: Optional[np.ndarray]) -> np.ndarray:
    """The key each member of one cluster is read in order of (ascending first), float64."""
    source, sign = _KEY_SOURCE[strategy]
    per_sample = distances if source == "distances" else norms
    values = np.asarray(per_sample[members], dtype=np.float64)  # type: ignore[index]
    return -values if sign < 0 else values


def _stable_argsort(keys: np.ndarray) -> np.ndarray:
    """np.argsort(keys, kind="stable") for float keys (ties by position, NaN last), 4x faster at 2M keys.

    The default sort (vectorised where the CPU allows) does not keep ties in
    position order; the runs of equal keys, rare in distances, are put back
    in position order afterwards by a sort of those entries alone.
    """
    order = np.argsort(keys)
    ordered = keys[order]
    same = ordered[1:] == ordered[:-1]
    if ordered.size and np.isnan(ordered[-1]):  # NaNs sort last, as one run
        same |= np.isnan(ordered[1:]) & np.isnan(ordered[:-1])
    if same.any():
        in_run = np.concatenate([[False], same]) | np.concatenate([same, [False]])
        run_of = np.cumsum(np.concatenate([[True], ~same]))  # the same number along a run of equal keys
        positions = np.flatnonzero(in_run)
        order[positions] = order[positions][np.lexsort((order[positions], run_of[positions]))]
    return order


def _first_in_order(keys: np.ndarray, count: int) -> np.ndarray:
    """Positions (ascending) of the first `count` in a stable ascending sort of `keys` (NaN last), without sorting.

    Those are the keys below the count-th smallest value, then as many of the
    keys equal to it as fit, lowest position first: an O(n) partition, where
    a sort of the cluster is O(n log n).
    """
    if count >= keys.size:
        return np.arange(keys.size)
    if count <= 0:
        return np.zeros(0, dtype=np.int64)
    threshold = np.partition(keys, count - 1)[count - 1]
    if threshold != threshold:  # NaN: every number comes first, then the NaNs in position order
        taken = ~np.isnan(keys)
        tied = np.flatnonzero(~taken)
    else:
        taken = keys < threshold
        tied = np.flatnonzero(keys == threshold)
    taken[tied[:count - int(np.count_nonzero(taken))]] = True
    return np.flatnonzero(taken)


def sample_weights(
    labels: np.ndarray,
    selected: np.ndarray,
    cluster_sizes: np.ndarray,
    kept_sizes: np.ndarray,
    weighting: Literal["cluster", "none"],
    *,
    temperature: float = 1.0,
) -> np.ndarray:
    """Per-sample loss weight (N,) float64: w = (n_c / N) / (s_c / S) when kept, 0 otherwise.

    The kept samples of cluster c then carry n_c / N of the total weight, so
    the weighted mean over the subset estimates the full-data mean; the mean
    weight over kept samples is 1. With "none", kept samples weigh 1.
    A temperature t in [0, 1] makes them w ** t, rescaled to a mean of 1 over the kept samples (t = 1 these
    weights, t = 0 all 1s): some bias for a larger effective sample size.
    """
    if not 0.0 <= temperature <= 1.0:
        raise ValueError(f"weight temperature must be in [0, 1], got {temperature}")
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
    if temperature != 1.0:  # w ** t, rescaled to a mean of 1 over the kept samples; t = 1 stays bit for bit
        has_kept = kept > 0  # a cluster keeping nothing has an infinite weight that no sample carries
        per_cluster = np.where(has_kept, per_cluster, 1.0) ** temperature
        per_cluster *= kept.sum() / float(np.dot(kept[has_kept], per_cluster[has_kept]))
    if selected.size == labels.size:  # everything kept: one gather, no scatter
        return per_cluster[labels]
    weights[selected] = per_cluster[labels[selected]]
    return weights
