"""Stage 5b, the selection: which samples each cluster keeps, given how many (the budget's kept sizes).

Pure numpy. Each rule is an object in `SELECTIONS` (the `selection` key), read cluster by cluster in the order
of a per-sample key (ties to the lower index, so the choice is the same everywhere):

- "peripheral": farthest from the centroid; "core": nearest; "mix": half each;
- "norm": largest feature norm;
- "spread": evenly over the quantiles of the distance to the centroid (core, middle and edge alike);
- "kcenter": greedy farthest-point (k-centre) coverage of the cluster in feature space, starting from the
  sample nearest the centroid;
- "random": uniform (the smallest of one seeded uniform key per sample);
- "semdedup": random's order with near-duplicates (cosine similarity >= dedup_similarity to an earlier
  member) skipped (`diversity.semantic_dedup`).

Two rules read a set of target examples and decide how many records each cluster keeps themselves (`targeted`; the
plan calls `select_toward`, planning/targeted.py):

- "round_robin": the target examples (one target) or the targets (several) take turns, each its most similar
  record not yet taken;
- "clusters": each cluster's budget in proportion to the target examples nearest its centre (with a floor), its
  records taken most similar first.

Samples with a negative label (left out) are never chosen.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Optional, Union

import numpy as np

from ds_cluster.planning.diversity import k_center_greedy, semantic_dedup
from ds_cluster.planning.targeted import (TargetRows, centred_rows, check_budget_covers_targets,
                                          cluster_budgets_toward, member_centroids, round_robin, target_scores)
from ds_cluster.registry import Registry


@dataclass(frozen=True)
class SelectionInputs:
    """What a rule may read besides the labels: (N,) distances to the centre, (N,) feature norms, (N, d) rows."""

    distances: Optional[np.ndarray] = None
    norms: Optional[np.ndarray] = None
    features: Optional[np.ndarray] = None
    seed: int = 0
    dedup_similarity: float = 0.95
    # semdedup: test near-duplicates on the rows less the pool's mean unit row (targeted.centred_rows).
    dedup_centre: bool = False


class SelectionRule(ABC):
    """Which samples of each cluster a plan keeps."""

    name: ClassVar[str]
    reads_distances: ClassVar[bool] = False  # each sample's distance to its cluster's centre
    reads_norms: ClassVar[bool] = False  # each sample's feature norm (computed from the rows)
    reads_rows: ClassVar[bool] = False  # the feature rows themselves
    # Whether the rule reads target examples and decides the clusters' kept counts itself (`select_toward`).
    targeted: ClassVar[bool] = False

    @property
    def reads_features(self) -> bool:
        """Whether the rule needs the feature rows (directly or through their norms), not only the distances."""
        return self.reads_rows or self.reads_norms

    def check_inputs(self, inputs: SelectionInputs) -> None:
        """ValueError naming a fallback when an input the rule reads is missing."""
        if self.reads_distances and inputs.distances is None:
            raise ValueError(f"selection '{self.name}' needs features (distances to centroids); use 'random' "
                             "without them")
        if self.reads_norms and inputs.norms is None:
            raise ValueError(f"selection '{self.name}' needs features (their norms); use 'random' without them")
        if self.reads_rows and inputs.features is None:
            fallback = "'spread' or 'random'" if inputs.distances is not None else "'random'"  # spread reads distances
            raise ValueError(f"selection '{self.name}' needs the features themselves; use {fallback} without them")

    @abstractmethod
    def select(self, labels: np.ndarray, kept_sizes: np.ndarray, counts: np.ndarray, inputs: SelectionInputs,
               rng: np.random.Generator) -> np.ndarray:
        """Sorted int64 indices of the kept samples of every cluster (inputs checked, sizes feasible)."""


class _ClusterByCluster(SelectionRule):
    """A rule that reads each cluster on its own."""

    def select(self, labels: np.ndarray, kept_sizes: np.ndarray, counts: np.ndarray, inputs: SelectionInputs,
               rng: np.random.Generator) -> np.ndarray:
        chosen = np.zeros(labels.size, dtype=bool)
        for members, keep in _clusters_in_index_order(labels, counts, kept_sizes):
            chosen[self.choose(members, keep, inputs)] = True
        return np.flatnonzero(chosen).astype(np.int64, copy=False)

    @abstractmethod
    def choose(self, members: np.ndarray, keep: int, inputs: SelectionInputs) -> np.ndarray:
        """`keep` of one cluster's `members` (sample indices in index order)."""


class _ReadInOrder(_ClusterByCluster):
    """The first `keep` members in the order of one per-sample key (ascending; ties to the lower index)."""

    source: ClassVar[str] = "distances"  # the SelectionInputs field the key is read from
    descending: ClassVar[bool] = False

    def keys(self, members: np.ndarray, inputs: SelectionInputs) -> np.ndarray:
        values = np.asarray(getattr(inputs, self.source)[members], dtype=np.float64)
        return -values if self.descending else values

    def choose(self, members: np.ndarray, keep: int, inputs: SelectionInputs) -> np.ndarray:
        return members[_first_in_order(self.keys(members, inputs), keep)]


class Peripheral(_ReadInOrder):
    name = "peripheral"
    reads_distances = True
    descending = True


class Core(_ReadInOrder):
    name = "core"
    reads_distances = True


class Mix(_ReadInOrder):
    name = "mix"
    reads_distances = True
    descending = True

    def choose(self, members: np.ndarray, keep: int, inputs: SelectionInputs) -> np.ndarray:
        # The first (keep + 1) // 2 of the order (the edge) and its last keep // 2 (the core): all but its
        # first len - keep // 2.
        keys = self.keys(members, inputs)
        from_edge, from_core = (keep + 1) // 2, keep // 2
        taken = [members[_first_in_order(keys, from_edge)]]
        if from_core:
            far_end = np.ones(members.size, dtype=bool)
            far_end[_first_in_order(keys, members.size - from_core)] = False
            taken.append(members[far_end])
        return np.concatenate(taken)


class Norm(_ReadInOrder):
    name = "norm"
    reads_norms = True
    source = "norms"
    descending = True


class Spread(_ReadInOrder):
    name = "spread"
    reads_distances = True

    def choose(self, members: np.ndarray, keep: int, inputs: SelectionInputs) -> np.ndarray:
        # In distance order, take the middle of each of `keep` equal slices.
        middles = ((np.arange(keep) + 0.5) * len(members) / keep).astype(np.int64)
        return members[_stable_argsort(self.keys(members, inputs))[middles]]


class KCenter(_ReadInOrder):
    name = "kcenter"
    reads_distances = True
    reads_rows = True

    def choose(self, members: np.ndarray, keep: int, inputs: SelectionInputs) -> np.ndarray:
        return k_center_greedy(inputs.features, members[_stable_argsort(self.keys(members, inputs))], keep)


class Random(SelectionRule):
    name = "random"

    def select(self, labels: np.ndarray, kept_sizes: np.ndarray, counts: np.ndarray, inputs: SelectionInputs,
               rng: np.random.Generator) -> np.ndarray:
        return _random_in_clusters(labels, kept_sizes, counts, rng)


class SemDedup(SelectionRule):
    name = "semdedup"
    reads_rows = True

    def select(self, labels: np.ndarray, kept_sizes: np.ndarray, counts: np.ndarray, inputs: SelectionInputs,
               rng: np.random.Generator) -> np.ndarray:
        # A cluster is read in random's seeded order, so without near-duplicates it keeps what random keeps.
        keys = rng.random(labels.size)
        chosen = np.zeros(labels.size, dtype=bool)
        rows = centred_rows(inputs.features, np.flatnonzero(labels >= 0)) if inputs.dedup_centre else inputs.features
        for members, keep in _clusters_in_index_order(labels, counts, kept_sizes):
            ordered = members[_stable_argsort(keys[members])]
            chosen[semantic_dedup(rows, ordered, keep, inputs.dedup_similarity)] = True
        return np.flatnonzero(chosen).astype(np.int64, copy=False)


@dataclass(frozen=True)
class TargetedInputs:
    """What a targeted rule reads: the feature rows (N, d), every sample's cluster (-1: left out), the clusters'
    centres, the target examples, the budget S, the clusters rule's floor and the near-duplicate threshold."""

    features: np.ndarray
    labels: np.ndarray
    centroids: Optional[np.ndarray]
    target: TargetRows
    total: int
    floor: int
    dedup_similarity: float
    dedup_centre: bool = False


class TargetedRule(SelectionRule):
    """A rule that reads target examples and chooses the whole subset itself: the clusters' kept counts follow."""

    targeted = True
    reads_rows = True

    def select(self, labels: np.ndarray, kept_sizes: np.ndarray, counts: np.ndarray, inputs: SelectionInputs,
               rng: np.random.Generator) -> np.ndarray:
        raise TypeError(f"selection {self.name!r} decides how many records each cluster keeps: build_plan calls "
                        "its select_toward with the target examples")

    @abstractmethod
    def select_toward(self, inputs: TargetedInputs) -> np.ndarray:
        """Sorted int64 indices of the records kept (S of them, never a left-out one)."""


class RoundRobin(TargetedRule):
    name = "round_robin"

    def select_toward(self, inputs: TargetedInputs) -> np.ndarray:
        rows = np.flatnonzero(inputs.labels >= 0)
        return round_robin(inputs.features, rows, inputs.target, inputs.total, inputs.dedup_similarity,
                           inputs.labels[rows], dedup_centre=inputs.dedup_centre)


class TowardTargetClusters(TargetedRule):
    name = "clusters"

    def select_toward(self, inputs: TargetedInputs) -> np.ndarray:
        labels = inputs.labels
        rows = np.flatnonzero(labels >= 0)
        num_clusters = int(labels.max()) + 1
        sizes = np.bincount(labels[rows], minlength=num_clusters)
        centroids = member_centroids(inputs.features, labels, num_clusters, inputs.centroids)
        check_budget_covers_targets(inputs.total, inputs.target)
        kept = cluster_budgets_toward(sizes, centroids, inputs.target, inputs.total, inputs.floor)
        score = np.full(labels.size, -np.inf)
        score[rows] = target_scores(inputs.features, rows, inputs.target)[0]
        chosen = np.zeros(labels.size, dtype=bool)
        dedup_rows = centred_rows(inputs.features, rows) if inputs.dedup_centre else inputs.features
        for members, keep in _clusters_in_index_order(labels, sizes, kept):
            ordered = members[np.lexsort((members, -score[members]))]  # most similar first, ties to the lower index
            chosen[semantic_dedup(dedup_rows, ordered, int(keep), inputs.dedup_similarity)] = True
        return np.flatnonzero(chosen).astype(np.int64, copy=False)


SELECTIONS: Registry[SelectionRule] = Registry(
    "selection", (Peripheral(), Core(), Random(), Mix(), Norm(), Spread(), KCenter(), SemDedup(), RoundRobin(),
                  TowardTargetClusters()))
# What a plan falls back to when it has no geometry and keeps everything anyway.
UNIFORM: SelectionRule = SELECTIONS["random"]


def select_in_clusters(labels: np.ndarray, kept_sizes: np.ndarray, rule: Union[str, SelectionRule],
                       inputs: Optional[SelectionInputs] = None) -> np.ndarray:
    """Sorted int64 indices: in each cluster c, kept_sizes[c] samples chosen by the rule (see the module docstring),
    from what it reads (`inputs`: distances, norms, feature rows, the seed).

    Samples with a negative label (excluded) are never chosen.
    """
    inputs = inputs or SelectionInputs()
    labels = np.asarray(labels, dtype=np.int64)
    kept_sizes = np.asarray(kept_sizes, dtype=np.int64)
    rng = np.random.default_rng([inputs.seed, 0x5E1EC7])
    taking_part = labels >= 0
    everyone = bool(taking_part.all())
    counts = np.bincount(labels if everyone else labels[taking_part], minlength=kept_sizes.size)
    if np.array_equal(counts, kept_sizes):  # everything is kept: nothing to choose
        return np.arange(labels.size, dtype=np.int64) if everyone else np.flatnonzero(taking_part)
    chosen_rule = SELECTIONS.get_rule(rule)
    chosen_rule.check_inputs(inputs)
    too_many = np.flatnonzero(kept_sizes > counts[:kept_sizes.size])
    if too_many.size:
        cluster = int(too_many[0])
        raise ValueError(f"cluster {cluster} has {int(counts[cluster])} samples, "
                         f"cannot keep {int(kept_sizes[cluster])}")
    return chosen_rule.select(labels, kept_sizes, counts, inputs, rng)


def _clusters_in_index_order(labels: np.ndarray, counts: np.ndarray, kept_sizes: np.ndarray):
    """(members in index order, kept count) of each cluster: one radix sort of the labels, no sort of N keys."""
    taking_part = labels >= 0
    if taking_part.all():
        grouped = stable_label_order(labels)
    else:
        valid_rows = np.flatnonzero(taking_part)
        grouped = valid_rows[stable_label_order(labels[valid_rows])]
    ends = np.cumsum(counts[:kept_sizes.size])
    for cluster, (end, keep) in enumerate(zip(ends.tolist(), kept_sizes.tolist())):
        yield grouped[end - int(counts[cluster]):end], keep


def stable_label_order(labels: np.ndarray) -> np.ndarray:
    """Indices that sort `labels` (small non-negative ints) stably: a radix sort on uint8 or int16 when they fit."""
    labels = np.asarray(labels)
    if labels.size and 0 <= labels.min():
        top = int(labels.max())
        for small in (np.uint8, np.int16):  # radix sort: 4x faster at N = 10M; one pass fewer for uint8
            if top <= np.iinfo(small).max:
                return np.argsort(labels.astype(small), kind="stable")
    return np.argsort(labels, kind="stable")


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
