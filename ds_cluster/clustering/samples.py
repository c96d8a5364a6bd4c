"""Every sample's cluster: the one place where an analysis's features and/or labels become the clusters a plan is
built from (`cluster_samples`).

With labels (a hand-made analysis, or the clustering an analysis recorded) the clusters are those labels, their
centres the member means (or the recorded centres and distances); with features only, k-means clusters them
(`kmeans.cluster_with`). Samples left out (no response tokens, or label -1) take no part and get label -1.
Pure numpy: the planning stage above reads the result and never clusters itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ds_cluster.clustering.kmeans import (ClusterResult, cluster_from_labels, cluster_with, spread_to_all,
                                          validate_features)
from ds_cluster.settings import ClusteringSettings


@dataclass
class PlanInputs:
    """What the plan is built from: features and/or labels of an analysis, and the samples left out."""

    features: Optional[np.ndarray]
    labels: Optional[np.ndarray]
    exclude: Optional[np.ndarray]
    distances: Optional[np.ndarray] = None  # with labels: each sample's distance to its k-means centre
    centroids: Optional[np.ndarray] = None


@dataclass(frozen=True)
class Clusters:
    """Every sample's cluster. labels (N,) int64: 0..K-1, -1 for a sample left out; distances (N,): to the centre of
    its cluster (0 where left out, and everywhere without geometry); centroids (K, d); rows: the samples that take
    part, ascending; features (N, d): the validated features, when there are any; has_geometry: whether the
    distances mean something (features, or recorded distances)."""

    labels: np.ndarray
    distances: np.ndarray
    centroids: np.ndarray
    rows: np.ndarray
    features: Optional[np.ndarray]
    has_geometry: bool

    @property
    def num_samples(self) -> int:
        return int(self.labels.shape[0])

    @property
    def num_clusters(self) -> int:
        return int(self.centroids.shape[0])

    @property
    def everyone(self) -> bool:
        """Whether every sample takes part (then nothing needs copying to leave samples out)."""
        return self.rows.size == self.num_samples

    def taking_part(self, values: np.ndarray) -> np.ndarray:
        """`values` (N, ...) of the samples that take part, without a copy when every sample does."""
        return values if self.everyone else values[self.rows]


def cluster_samples(inputs: PlanInputs, settings: ClusteringSettings, world_size: int, *,
                    kmeans_in_child: bool = False) -> Clusters:
    """The clusters of `inputs`: the given labels, else k-means of the features with `settings` (K for
    `world_size`; `kmeans_in_child`: `kmeans.cluster_with`'s `in_child`, for a training rank). Every input is
    checked here, once: a ValueError says what is wrong."""
    num_samples, points = _check_inputs(inputs)
    distances = inputs.distances
    if distances is not None and (inputs.labels is None or np.asarray(distances).shape != (num_samples,)):
        raise ValueError(f"distances must come with labels and have shape ({num_samples},)")
    included = np.ones(num_samples, dtype=bool)
    if inputs.exclude is not None:
        included &= ~np.asarray(inputs.exclude, dtype=bool)
    if inputs.labels is not None:
        included &= np.asarray(inputs.labels) >= 0
    rows = np.flatnonzero(included)
    if rows.size == 0:
        raise ValueError("every sample is excluded (no features or label -1): there is nothing to train on")
    everyone = rows.size == num_samples
    # Avoid copying (N, d) features when nothing is left out.
    included_points = None if points is None else (points if everyone else points[rows])
    if inputs.labels is None:
        assert included_points is not None
        result = cluster_with(included_points, settings, world_size, in_child=kmeans_in_child)
    else:
        label_array = np.asarray(inputs.labels, dtype=np.int64)
        taking_part = label_array if everyone else label_array[rows]
        compact, num_clusters = _compact_labels(taking_part)
        if distances is None:
            result = cluster_from_labels(included_points, compact, num_clusters)
        else:
            given = np.asarray(distances, dtype=np.float64)
            centres = (np.asarray(inputs.centroids, dtype=np.float32)[np.flatnonzero(np.bincount(taking_part) > 0)]
                       if inputs.centroids is not None else np.zeros((num_clusters, 0), np.float32))
            result = ClusterResult(compact, centres, given if everyone else given[rows])
    labels, all_distances = spread_to_all(result, rows, num_samples)
    return Clusters(labels, all_distances, result.centroids, rows, points,
                    has_geometry=points is not None or distances is not None)


def _check_inputs(inputs: PlanInputs) -> tuple[int, Optional[np.ndarray]]:
    points = None
    if inputs.features is not None:
        points = validate_features(inputs.features)
        num_samples = points.shape[0]
    elif inputs.labels is None:
        raise ValueError("a plan needs features, or labels to skip clustering")
    if inputs.labels is not None:
        label_array = np.asarray(inputs.labels)
        if label_array.ndim != 1 or not np.issubdtype(label_array.dtype, np.integer):
            raise ValueError(f"labels must be a 1-D integer array, got shape {label_array.shape}, "
                             f"dtype {label_array.dtype}")
        if label_array.size == 0:
            raise ValueError("labels is empty: there is nothing to plan")
        if points is not None and label_array.shape[0] != points.shape[0]:
            raise ValueError(f"labels has {label_array.shape[0]} entries but features has {points.shape[0]} rows")
        if (label_array < -1).any():
            raise ValueError(f"labels must be >= 0 (or -1 to leave a sample out); found {int(label_array.min())}")
        num_samples = label_array.shape[0]
    if inputs.exclude is not None and np.asarray(inputs.exclude).shape != (num_samples,):
        raise ValueError(f"exclude must be a bool array of shape ({num_samples},), "
                         f"got {np.asarray(inputs.exclude).shape}")
    return num_samples, points


def _compact_labels(labels: np.ndarray) -> tuple[np.ndarray, int]:
    """Labels renumbered 0..K-1 in order of their values (an O(N) bincount, not a sort)."""
    present = np.bincount(labels) > 0
    if present.all():
        return labels.astype(np.int64, copy=False), int(present.size)  # already 0..K-1: no copy of N labels
    new_id = np.cumsum(present) - 1
    return new_id[labels].astype(np.int64), int(present.sum())
