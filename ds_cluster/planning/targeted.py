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
record already taken is at or above `dedup_similarity` is skipped, and skipped records come back only when nothing
else is left (most similar to the target first).
"""
from __future__ import annotations

from typing import Optional, Protocol

import numpy as np

from ds_cluster.planning.budget import apportion

# Pool rows x target examples per block of similarities (32 MB of float64).
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
    for start, stop in _blocks(rows.size, examples.shape[0]):
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
    for start, stop in _blocks(rows.size, examples.shape[0]):
        scores = _query_scores(features, rows, examples, query_of, num_queries, start, stop)
        for query in range(num_queries):
            positions = np.concatenate([best_positions[query], np.arange(start, stop)])
            values = np.concatenate([best_scores[query], scores[:, query]])
            order = np.lexsort((positions, -values))[:count]
            best_positions[query], best_scores[query] = positions[order], values[order]
    return best_positions


class _Taken:
    """The records taken so far (their unit rows, for the near-duplicate test) and those skipped as near-duplicates."""

    def __init__(self, features: np.ndarray, size: int, total: int, similarity: float) -> None:
        self.features, self.similarity = features, similarity
        self.mask = np.zeros(size, dtype=bool)
        self.skipped = np.zeros(size, dtype=bool)
        self.order: list[int] = []
        self.units = np.empty((total, features.shape[1]), dtype=np.float64)

    def offer(self, row: int, index: int) -> bool:
        """Take pool row `row` (the sample `index`) unless it is a near-duplicate of one taken; True when taken."""
        unit = unit_rows(self.features[index][None])[0]
        count = len(self.order)
        if count and np.round(float((self.units[:count] @ unit).max()), _DECIMALS) >= self.similarity:
            self.skipped[row] = True
            return False
        self.units[count] = unit
        self.mask[row] = True
        self.order.append(row)
        return True


def round_robin(features: np.ndarray, rows: np.ndarray, target: TargetRows, total: int,
                dedup_similarity: float) -> np.ndarray:
    """`total` of the pool `rows` (sample indices, ascending), taken in turns by the target examples (one target) or
    by the targets (several), each its best match not yet taken; sorted int64 sample indices. Long because the turns,
    the refill of a query's candidates and the near-duplicate fill are one loop."""
    query_of, num_queries = _queries(target)
    num_targets = int(np.unique(target.groups).size)
    if total < num_targets:
        raise ValueError(f"a budget of {total} records is smaller than the {num_targets} targets, so some target "
                         "would get nothing: raise budget_ratio / budget_samples, or give fewer targets")
    total = min(total, rows.size)
    examples = unit_rows(target.features)
    count = min(rows.size, 2 * -(-total // num_queries) + 16)
    candidates = _top_matches(features, rows, examples, query_of, num_queries, count)
    pointers = np.zeros(num_queries, dtype=np.int64)
    taken = _Taken(features, rows.size, total, dedup_similarity)
    active = [True] * num_queries
    while len(taken.order) < total and any(active):
        for query in range(num_queries):
            if len(taken.order) >= total:
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
    if len(taken.order) < total:  # only near-duplicates are left: the most similar to the target fill the budget
        skipped = np.flatnonzero(taken.skipped & ~chosen)
        scores, _ = target_scores(features, rows[skipped], target)
        chosen[skipped[np.lexsort((skipped, -scores))[:total - len(taken.order)]]] = True
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
