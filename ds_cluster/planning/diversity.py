"""Selections that read the feature rows themselves: k-centre coverage and near-duplicate removal (SemDeDup).

Pure numpy, one cluster at a time; `ds_cluster.planning.selection.select_in_clusters`
gives each its cluster's members in the order it reads them.
"""
from __future__ import annotations

import numpy as np


def k_center_greedy(features: np.ndarray, members: np.ndarray, keep: int) -> np.ndarray:
    """`keep` of `members` chosen greedily, each the farthest from those chosen so far (k-centre).

    `members` comes ordered by distance to the centroid: the first pick is the
    most central sample. Cost O(keep x len(members) x d).
    """
    points = np.asarray(features[members], dtype=np.float64)
    picked = [0]
    nearest = np.linalg.norm(points - points[0], axis=1)
    nearest[0] = -1.0  # below any distance: once every sample is covered, duplicates are taken, not a pick twice
    for _ in range(keep - 1):
        candidate = int(np.argmax(nearest))  # first index among ties
        picked.append(candidate)
        nearest = np.minimum(nearest, np.linalg.norm(points - points[candidate], axis=1))
        nearest[candidate] = -1.0  # the earlier picks keep their -1 through the minimum
    return members[np.asarray(picked, dtype=np.int64)]


# Rows per block of the similarity matrix in semdedup: blocks of DEDUP_CHUNK x DEDUP_CHUNK floats (8 MB), never
# n_c x n_c. Similarities are rounded to _SIMILARITY_DECIMALS: identical rows have a cosine a few ulps from 1,
# which differ with the BLAS kernel (block shape, CPU); rounded, they are duplicates at dedup_similarity 1 and
# tie (then go in seeded order) on every machine.
DEDUP_CHUNK = 1024
_SIMILARITY_DECIMALS = 9


def semantic_dedup(features: np.ndarray, ordered: np.ndarray, keep: int, similarity: float) -> np.ndarray:
    """`keep` of the rows `ordered` (SemDeDup): the first `keep` that are not near-duplicates, in that order.

    A row is a near-duplicate when the cosine similarity of its L2-normalised
    features to any row earlier in `ordered`, rounded to 9 decimals, is >=
    `similarity` (an all-zero row has similarity 0 to everything). When fewer
    than `keep` rows are not, the near-duplicates fill the rest, least similar
    to an earlier row first (ties in `ordered` order); `keep` >= len(ordered)
    returns `ordered` as it is. Rows are read in blocks of DEDUP_CHUNK and
    reading stops once `keep` are found: O(read^2 x d) time, O(n x d) memory.
    """
    if not 0.0 < similarity <= 1.0:
        raise ValueError(f"dedup_similarity must be in (0, 1], got {similarity}")
    count = ordered.size
    if keep >= count:  # everything is kept: no similarity to compute
        return ordered
    unit = np.empty((count, features.shape[1]), dtype=np.float64)
    best_earlier = np.empty(count, dtype=np.float64)  # each row's largest similarity to an earlier row
    read, distinct = 0, 0
    while read < count and distinct < keep:
        stop = min(read + DEDUP_CHUNK, count)
        block = np.asarray(features[ordered[read:stop]], dtype=np.float64)
        lengths = np.linalg.norm(block, axis=1, keepdims=True)
        unit[read:stop] = block / np.where(lengths > 0, lengths, 1.0)
        best_earlier[read:stop] = np.round(_largest_similarity_to_earlier(unit, read, stop), _SIMILARITY_DECIMALS)
        distinct += int(np.count_nonzero(best_earlier[read:stop] < similarity))
        read = stop
    seen = best_earlier[:read]
    positions = np.flatnonzero(seen < similarity)[:keep]
    if positions.size < keep:  # every row was read: the least similar near-duplicates fill the budget
        duplicates = np.flatnonzero(seen >= similarity)
        fill = duplicates[np.argsort(seen[duplicates], kind="stable")[:keep - positions.size]]
        positions = np.concatenate([positions, fill])
    return ordered[positions]


def _largest_similarity_to_earlier(unit: np.ndarray, start: int, stop: int) -> np.ndarray:
    """For rows start..stop-1 of `unit`, the largest dot product with a row before it (-inf for row 0)."""
    rows = unit[start:stop]
    best = np.full(stop - start, -np.inf)
    for column in range(0, stop, DEDUP_CHUNK):
        end = min(column + DEDUP_CHUNK, stop)
        products = rows @ unit[column:end].T
        if end > start:  # the block reaches these rows themselves: only the columns before each row count
            products[np.arange(column, end)[None, :] >= np.arange(start, stop)[:, None]] = -np.inf
        np.maximum(best, products.max(axis=1), out=best)
    return best
