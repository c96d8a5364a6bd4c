"""Targeted selection: the pool's records most like a few target examples (docs/targeted.md). Pure numpy.

A record's similarity to a target example is the cosine of their L2-normalised feature rows, computed a block of
pool rows at a time (never N x N, never all N x T at once), in float64 and rounded to 9 decimals, so that ties go to
the lower index on every machine and every rank builds the same plan.

- `round_robin` (after RDS+): with one target, each target example in turn takes its most similar record not yet
  taken; with several targets (groups), a record's score for a target is its largest similarity to that target's
  examples, and the targets take their turns, so no target's score scale crowds out another's.
- `cluster_budgets_toward`: the clusters' budgets in proportion to the target examples nearest each cluster's centre
  (each target weighing one, shared by its examples), every cluster first given `floor` records.

Near-duplicates (one example rendered under many templates) never fill a selection: a record whose similarity to a
record already taken from its cluster is at or above `dedup_similarity` is skipped (near-duplicates share a cluster;
testing within it keeps the cost O(S^2 d / K)), and skipped records come back only when nothing else is left (most
similar to the target first). With `dedup_centre`, that test reads each row's unit vector less the pool's mean unit
row (`centred_rows`): on features where one direction carries most of every row (a language model's last hidden
layer), unrelated records sit near cosine 1 and the plain test would skip most of the records that match the target.
"""
from __future__ import annotations

from typing import Optional, Protocol

import numpy as np

from ds_cluster.planning.budget import apportion

# Pool rows x max(target examples, feature dimension) per block: the block's float64 rows and similarities (32 MB).
SIMILARITY_BLOCK = 1 << 22
_DECIMALS = 9


class TargetRows(Protocol):
    """The target examples as a selection reads them: their feature rows (T, d) and each one's target (T,)."""

    features: np.ndarray
    groups: np.ndarray


def unit_rows(rows: np.ndarray) -> np.ndarray:
    """float64 rows of length 1 (an all-zero row stays zero)."""
    rows = np.asarray(rows, dtype=np.float64)
    lengths = np.linalg.norm(rows, axis=1, keepdims=True)
    return rows / np.where(lengths > 0, lengths, 1.0)


def centred_rows(features: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """(N, d) float32: every row's unit vector less the mean unit vector of the pool `rows` (a row equal to that
    mean becomes zero, similar to nothing). The mean is summed a block at a time in a fixed order, so every rank
    gets the same rows; the copy is the features' size in float32."""
    rows = np.asarray(rows, dtype=np.int64)
    count, width = features.shape
    total = np.zeros(width, dtype=np.float64)
    for start, stop in _blocks(rows.size, width):
        total += unit_rows(features[rows[start:stop]]).sum(axis=0)
    mean = total / max(rows.size, 1)
    centred = np.empty((count, width), dtype=np.float32)
    for start, stop in _blocks(count, width):
        centred[start:stop] = unit_rows(features[start:stop]) - mean
    return centred


def _queries(target: TargetRows) -> tuple[np.ndarray, int]:
    """Which query each target example belongs to: itself (one target), or its target (several)."""
    groups = np.asarray(target.groups, dtype=np.int64)
    if np.unique(groups).size <= 1:
        return np.arange(groups.size, dtype=np.int64), int(groups.size)
    return groups, int(groups.max()) + 1


def _blocks(count: int, width: int):
    step = max(1, SIMILARITY_BLOCK // max(width, 1))
    for start in range(0, count, step):
        yield start, min(start + step, count)


def _query_scores(features: np.ndarray, rows: np.ndarray, examples: np.ndarray, query_of: np.ndarray,
                  num_queries: int, start: int, stop: int) -> np.ndarray:
    """(stop - start, Q) scores of pool rows rows[start:stop]: each query's largest rounded similarity."""
    similarities = np.round(unit_rows(features[rows[start:stop]]) @ examples.T, _DECIMALS)
    scores = np.full((stop - start, num_queries), -np.inf)
    for query in range(num_queries):
        scores[:, query] = similarities[:, query_of == query].max(axis=1)
    return scores


def target_scores(features: np.ndarray, rows: np.ndarray, target: TargetRows) -> tuple[np.ndarray, np.ndarray]:
    """Each pool row's score and the target it is most like: its largest similarity to any target example, and that
    example's target; (len(rows),) float64 and int64."""
    examples = unit_rows(target.features)
    groups = np.asarray(target.groups, dtype=np.int64)
    scores = np.empty(rows.size, dtype=np.float64)
    nearest = np.empty(rows.size, dtype=np.int64)
    for start, stop in _blocks(rows.size, max(examples.shape)):
        similarities = np.round(unit_rows(features[rows[start:stop]]) @ examples.T, _DECIMALS)
        best = np.argmax(similarities, axis=1)  # the first example among ties
        scores[start:stop] = similarities[np.arange(stop - start), best]
        nearest[start:stop] = groups[best]
    return scores, nearest


def _top_matches(features: np.ndarray, rows: np.ndarray, examples: np.ndarray, query_of: np.ndarray,
                 num_queries: int, count: int) -> list[np.ndarray]:
    """Each query's `count` best pool rows (indices into `rows`), best first (ties to the lower index), streamed
    over blocks of the pool."""
    best_positions = [np.zeros(0, dtype=np.int64) for _ in range(num_queries)]
    best_scores = [np.zeros(0) for _ in range(num_queries)]
    for start, stop in _blocks(rows.size, max(examples.shape)):
        scores = _query_scores(features, rows, examples, query_of, num_queries, start, stop)
        for query in range(num_queries):
            positions = np.concatenate([best_positions[query], np.arange(start, stop)])
            values = np.concatenate([best_scores[query], scores[:, query]])
            order = np.lexsort((positions, -values))[:count]
            best_positions[query], best_scores[query] = positions[order], values[order]
    return best_positions


class _Taken:
    """The records taken so far, and those skipped as near-duplicates: a record is tested against the records already
    taken from its own cluster (near-duplicates share a cluster), whose unit rows are kept cluster by cluster."""

    def __init__(self, features: np.ndarray, clusters: np.ndarray, similarity: float) -> None:
        self.features, self.clusters, self.similarity = features, clusters, similarity
        self.mask = np.zeros(clusters.size, dtype=bool)
        self.skipped = np.zeros(clusters.size, dtype=bool)
        self.count = 0
        self._units: dict[int, np.ndarray] = {}  # per cluster, rows [0, _sizes[c]) in use
        self._sizes: dict[int, int] = {}

    def offer(self, row: int, index: int) -> bool:
        """Take pool row `row` (the sample `index`) unless it is a near-duplicate of one taken; True when taken."""
        cluster = int(self.clusters[row])
        unit = unit_rows(self.features[index][None])[0]
        units, size = self._units.get(cluster), self._sizes.get(cluster, 0)
        if size and np.round(float((units[:size] @ unit).max()), _DECIMALS) >= self.similarity:
            self.skipped[row] = True
            return False
        if units is None or size == units.shape[0]:  # room for twice as many
            grown = np.empty((max(16, 2 * size), unit.size))
            if units is not None:
                grown[:size] = units[:size]
            self._units[cluster] = units = grown
        units[size] = unit
        self._sizes[cluster] = size + 1
        self.mask[row] = True
        self.count += 1
        return True


def check_budget_covers_targets(total: int, target: TargetRows) -> None:
    """ValueError when the budget is smaller than the number of targets (some target would get nothing)."""
    num_targets = int(np.unique(target.groups).size)
    if total < num_targets:
        raise ValueError(f"a budget of {total} records is smaller than the {num_targets} targets, so some target "
                         "would get nothing: raise budget_ratio / budget_samples, or give fewer targets")


def round_robin(features: np.ndarray, rows: np.ndarray, target: TargetRows, total: int, dedup_similarity: float,
                clusters: Optional[np.ndarray] = None, dedup_centre: bool = False) -> np.ndarray:
    """`total` of the pool `rows` (sample indices, ascending), taken in turns by the target examples (one target) or
    by the targets (several), each its best match not yet taken, a near-duplicate of a record already taken from its
    cluster (`clusters`: each row's; None, one cluster) skipped (tested on `centred_rows` with `dedup_centre`); sorted
    int64 sample indices. Long because the turns,
    the refill of a query's candidates and the near-duplicate fill are one loop."""
    check_budget_covers_targets(total, target)
    if total >= rows.size:
        return np.asarray(rows, dtype=np.int64)
    query_of, num_queries = _queries(target)
    examples = unit_rows(target.features)
    count = min(rows.size, 2 * -(-total // num_queries) + 16)
    candidates = _top_matches(features, rows, examples, query_of, num_queries, count)
    pointers = np.zeros(num_queries, dtype=np.int64)
    taken = _Taken(centred_rows(features, rows) if dedup_centre else features,
                   np.zeros(rows.size, np.int64) if clusters is None else clusters, dedup_similarity)
    active = [True] * num_queries
    while taken.count < total and any(active):
        for query in range(num_queries):
            if taken.count >= total:
                break
            while active[query]:
                if pointers[query] == candidates[query].size:
                    if candidates[query].size == rows.size:
                        active[query] = False  # every record read: this query has nothing left to take
                        break
                    count = min(rows.size, 2 * candidates[query].size)
                    mine = query_of == query
                    candidates[query] = _top_matches(features, rows, examples[mine], np.zeros(int(mine.sum()),
                                                     dtype=np.int64), 1, count)[0]
                    continue
                row = int(candidates[query][pointers[query]])
                pointers[query] += 1
                if not (taken.mask[row] or taken.skipped[row]) and taken.offer(row, int(rows[row])):
                    break
    chosen = taken.mask
    if taken.count < total:  # only near-duplicates are left: the most similar to the target fill the budget
        skipped = np.flatnonzero(taken.skipped & ~chosen)
        scores, _ = target_scores(features, rows[skipped], target)
        chosen[skipped[np.lexsort((skipped, -scores))[:total - taken.count]]] = True
    return np.sort(rows[chosen]).astype(np.int64)


def nearest_clusters(centroids: np.ndarray, target: TargetRows) -> np.ndarray:
    """(T,) the cluster whose centre each target example is nearest to (Euclidean, as k-means assigns; ties to the
    lower cluster)."""
    examples = np.asarray(target.features, dtype=np.float64)
    centres = np.asarray(centroids, dtype=np.float64)
    distances = (examples ** 2).sum(axis=1)[:, None] - 2 * examples @ centres.T + (centres ** 2).sum(axis=1)[None]
    return np.argmin(np.round(distances, _DECIMALS), axis=1).astype(np.int64)


def target_affinity(centroids: np.ndarray, target: TargetRows) -> np.ndarray:
    """(K,) how much of the target each cluster is nearest to: every target weighs 1, shared by its examples."""
    nearest = nearest_clusters(centroids, target)
    groups = np.asarray(target.groups, dtype=np.int64)
    per_group = np.bincount(groups)
    return np.bincount(nearest, weights=1.0 / per_group[groups], minlength=np.asarray(centroids).shape[0])


def cluster_budgets_toward(cluster_sizes: np.ndarray, centroids: np.ndarray, target: TargetRows, total: int,
                           floor: int) -> np.ndarray:
    """Kept count per cluster: min(floor, n_c) each, the rest in proportion to `target_affinity` (capped at n_c)."""
    sizes = np.asarray(cluster_sizes, dtype=np.int64)
    floors = np.minimum(sizes, int(floor))
    if int(floors.sum()) > total:
        raise ValueError(f"a budget of {total} records cannot give each of the {sizes.size} clusters its floor of "
                         f"{floor} (target.cluster_floor): raise budget_ratio / budget_samples, lower "
                         "target.cluster_floor (0 lets a cluster go unvisited), or lower num_clusters")
    return floors + apportion(total - int(floors.sum()), target_affinity(centroids, target), sizes - floors)


def member_centroids(features: np.ndarray, labels: np.ndarray, num_clusters: int,
                     given: Optional[np.ndarray] = None) -> np.ndarray:
    """The clusters' centres: the given ones when they are in the features' space, else the members' means."""
    if given is not None and given.ndim == 2 and given.shape == (num_clusters, features.shape[1]):
        return np.asarray(given, dtype=np.float64)
    taking_part = labels >= 0
    sums = np.zeros((num_clusters, features.shape[1]))
    np.add.at(sums, labels[taking_part], np.asarray(features[taking_part], dtype=np.float64))
    return sums / np.maximum(np.bincount(labels[taking_part], minlength=num_clusters), 1)[:, None]
