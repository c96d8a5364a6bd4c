"""Stage 2: k-means in feature space, with the paper's capacity cap.

Pure numpy / scikit-learn / faiss: no torch, no process group.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Literal, Optional

import numpy as np

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClusterResult:
    """Cluster of every sample, the centres, and each sample's distance to its centre."""

    labels: np.ndarray  # int64 (N,), values 0..K-1
    centroids: np.ndarray  # float32 (K, d)
    distances: np.ndarray  # float64 (N,)

    @property
    def num_clusters(self) -> int:
        return int(self.centroids.shape[0])


def validate_features(features: np.ndarray, name: str = "features") -> np.ndarray:
    """A 2-D finite float array with at least one row, or a ValueError saying what is wrong."""
    array = np.asarray(features)
    if array.ndim != 2:
        raise ValueError(f"{name} must be a 2-D array (N samples x d dimensions), got shape {array.shape}")
    if array.shape[0] == 0 or array.shape[1] == 0:
        raise ValueError(f"{name} is empty (shape {array.shape}): there is nothing to cluster")
    if not np.issubdtype(array.dtype, np.number):
        raise ValueError(f"{name} must be numeric, got dtype {array.dtype}")
    finite = np.isfinite(array).all(axis=1)
    if not finite.all():
        bad_rows = np.flatnonzero(~finite)
        raise ValueError(
            f"{name} has NaN or inf in {bad_rows.size} rows (first: row {int(bad_rows[0])}); "
            "recompute the features (fp32) or drop those samples"
        )
    return array


def cluster_features(
    features: np.ndarray,
    *,
    num_clusters: int,
    n_init: int = 10,
    max_iter: int = 300,
    capacity_factor: Optional[float] = 1.5,
    capacity_neighbors: int = 8,
    backend: Literal["sklearn", "faiss"] = "sklearn",
    seed: int = 0,
) -> ClusterResult:
    """k-means (k-means++ init, n_init restarts), then the capacity cap when it binds."""
    points = validate_features(features).astype(np.float32, copy=False)
    num_samples = points.shape[0]
    if num_clusters < 1:
        raise ValueError(f"num_clusters must be >= 1, got {num_clusters}")
    if num_clusters > num_samples:
        raise ValueError(
            f"num_clusters K={num_clusters} is larger than the number of samples N={num_samples}; "
            "lower num_clusters (or use 'auto' with fewer ranks)"
        )
    if backend == "faiss":
        centroids = _kmeans_faiss(points, num_clusters, n_init, max_iter, seed)
    elif backend == "sklearn":
        centroids = _kmeans_sklearn(points, num_clusters, n_init, max_iter, seed)
    else:
        raise ValueError(f"backend must be 'sklearn' or 'faiss', got {backend!r}")

    neighbor_count = min(capacity_neighbors, num_clusters)
    nearest, nearest_dist2 = nearest_centroids(points, centroids, neighbor_count, backend)
    labels = nearest[:, 0].astype(np.int64)
    if capacity_factor is not None:
        capacity = math.ceil(capacity_factor * num_samples / num_clusters)
        if np.bincount(labels, minlength=num_clusters).max() > capacity:
            labels = capped_assignment(points, centroids, nearest, nearest_dist2, capacity)
    return cluster_from_labels(points, labels, num_clusters)


def cluster_from_labels(features: Optional[np.ndarray], labels: np.ndarray, num_clusters: int) -> ClusterResult:
    """Centroids as member means and distances to them; features may be None (no geometry)."""
    labels = np.asarray(labels, dtype=np.int64)
    if features is None:
        return ClusterResult(labels, np.zeros((num_clusters, 0), np.float32), np.zeros(labels.shape[0]))
    points = np.asarray(features, dtype=np.float64)
    counts = np.bincount(labels, minlength=num_clusters).astype(np.float64)
    sums = np.zeros((num_clusters, points.shape[1]))
    np.add.at(sums, labels, points)
    centroids = sums / np.maximum(counts, 1.0)[:, None]
    distances = np.linalg.norm(points - centroids[labels], axis=1)
    return ClusterResult(labels, centroids.astype(np.float32), distances)


def nearest_centroids(
    points: np.ndarray, centroids: np.ndarray, count: int, backend: str = "sklearn", chunk: int = 65536
) -> tuple[np.ndarray, np.ndarray]:
    """Indices and squared distances of each point's `count` nearest centres, nearest first."""
    if backend == "faiss":
        import faiss

        index = faiss.IndexFlatL2(centroids.shape[1])
        index.add(np.ascontiguousarray(centroids, dtype=np.float32))
        dist2, nearest = index.search(np.ascontiguousarray(points, dtype=np.float32), count)
        return nearest.astype(np.int64), dist2.astype(np.float64)
    centre_norms = (centroids.astype(np.float64) ** 2).sum(axis=1)
    nearest = np.empty((points.shape[0], count), dtype=np.int64)
    nearest_dist2 = np.empty((points.shape[0], count), dtype=np.float64)
    for start in range(0, points.shape[0], chunk):
        block = points[start:start + chunk].astype(np.float64)
        dist2 = (block ** 2).sum(axis=1)[:, None] - 2.0 * block @ centroids.T.astype(np.float64) + centre_norms
        np.maximum(dist2, 0.0, out=dist2)
        if count < dist2.shape[1]:
            part = np.argpartition(dist2, count - 1, axis=1)[:, :count]
        else:
            part = np.tile(np.arange(dist2.shape[1]), (dist2.shape[0], 1))
        part_dist = np.take_along_axis(dist2, part, axis=1)
        order = np.lexsort((part, part_dist), axis=1)
        nearest[start:start + chunk] = np.take_along_axis(part, order, axis=1)
        nearest_dist2[start:start + chunk] = np.take_along_axis(part_dist, order, axis=1)
    return nearest, nearest_dist2


def capped_assignment(
    points: np.ndarray, centroids: np.ndarray, nearest: np.ndarray, nearest_dist2: np.ndarray, capacity: int
) -> np.ndarray:
    """The paper's greedy reassignment under a capacity.

    (point, centre) pairs among each point's nearest centres are taken in order
    of increasing distance; a point goes to the first centre that still has
    room. Points whose candidates are all full go to the nearest centre with
    room among all centres, so no cluster ends above `capacity`.
    """
    num_samples, num_clusters = points.shape[0], centroids.shape[0]
    if capacity * num_clusters < num_samples:
        raise ValueError(f"capacity {capacity} x {num_clusters} clusters cannot hold {num_samples} samples")
    flat_order = np.lexsort((nearest.ravel(), np.arange(nearest.size), nearest_dist2.ravel()))
    candidate_point = (flat_order // nearest.shape[1]).tolist()
    candidate_centre = nearest.ravel()[flat_order].tolist()
    labels = [-1] * num_samples
    room = [capacity] * num_clusters
    for point, centre in zip(candidate_point, candidate_centre):
        if labels[point] < 0 and room[centre] > 0:
            labels[point] = centre
            room[centre] -= 1
    label_array = np.asarray(labels, dtype=np.int64)
    unplaced = np.flatnonzero(label_array < 0)
    if unplaced.size:
        all_nearest, all_dist2 = nearest_centroids(points[unplaced], centroids, num_clusters)
        pairs = np.lexsort((all_nearest.ravel(), all_dist2.ravel()))
        for flat in pairs.tolist():
            point, centre = int(unplaced[flat // num_clusters]), int(all_nearest.ravel()[flat])
            if label_array[point] < 0 and room[centre] > 0:
                label_array[point] = centre
                room[centre] -= 1
    logger.info("capacity cap %d moved %d samples off their nearest centre", capacity,
                int((label_array != nearest[:, 0]).sum()))
    return label_array


def _kmeans_sklearn(points: np.ndarray, num_clusters: int, n_init: int, max_iter: int, seed: int) -> np.ndarray:
    from sklearn.cluster import KMeans

    model = KMeans(n_clusters=num_clusters, init="k-means++", n_init=n_init, max_iter=max_iter, random_state=seed)
    model.fit(points)
    return model.cluster_centers_.astype(np.float32)


def _kmeans_faiss(points: np.ndarray, num_clusters: int, n_init: int, max_iter: int, seed: int) -> np.ndarray:
    try:
        import faiss
    except ImportError as err:
        raise ValueError("backend 'faiss' needs the faiss package: pip install 'ds_cluster[faiss]'") from err
    kmeans = faiss.Kmeans(points.shape[1], num_clusters, niter=min(max_iter, 50), nredo=n_init, seed=seed,
                          verbose=False, spherical=False)
    kmeans.train(np.ascontiguousarray(points, dtype=np.float32))
    return np.asarray(kmeans.centroids, dtype=np.float32)
