"""Stage 3: k-means in feature space, with the paper's capacity cap.

Pure numpy / scikit-learn / faiss: no torch import, no process group. A training job's end asks for scikit-learn's
k-means in a child process (`cluster_with(..., in_child=True)`, `child.py`).
"""
from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional, Sequence, Union

import numpy as np

from ds_cluster.registry import Registry
from ds_cluster.settings import ClusteringSettings, stages_of

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
    backend: Union[str, "KMeansBackend"] = "sklearn",
    seed: int = 0,
) -> ClusterResult:
    """k-means (k-means++ init, n_init restarts), then the capacity cap when it binds.

    The centroids are k-means' own centres, and every distance is to the
    centre of the sample's cluster, also for samples the cap moved (as the
    reference implementation measures them for peripheral selection).
    """
    points = validate_features(features).astype(np.float32, copy=False)
    num_samples = points.shape[0]
    if num_clusters < 1:
        raise ValueError(f"num_clusters must be >= 1, got {num_clusters}")
    if num_clusters > num_samples:
        raise ValueError(
            f"num_clusters K={num_clusters} is larger than the number of samples N={num_samples}; "
            "lower num_clusters (or use 'auto' with fewer ranks)"
        )
    centroids = BACKENDS.get_rule(backend).centroids(points, num_clusters, n_init, max_iter, seed)

    neighbor_count = min(capacity_neighbors, num_clusters)
    nearest, nearest_dist2 = nearest_centroids(points, centroids, neighbor_count)
    labels = nearest[:, 0].astype(np.int64)
    if capacity_factor is not None:
        capacity = math.ceil(capacity_factor * num_samples / num_clusters)
        if np.bincount(labels, minlength=num_clusters).max() > capacity:
            labels = capped_assignment(points, centroids, nearest, nearest_dist2, capacity)
    return ClusterResult(labels, centroids.astype(np.float32), distances_to_centres(points, centroids, labels))


def cluster_from_labels(features: Optional[np.ndarray], labels: np.ndarray, num_clusters: int,
                        chunk: int = 65536) -> ClusterResult:
    """Centroids as member means and distances to them; features may be None (no geometry)."""
    labels = np.asarray(labels, dtype=np.int64)
    if features is None:
        return ClusterResult(labels, np.zeros((num_clusters, 0), np.float32), np.zeros(labels.shape[0]))
    from scipy import sparse

    points = np.asarray(features)
    # Member sums as one sparse (K x N) @ (N x d) product: np.add.at is far slower at N = 1M.
    membership = sparse.csr_matrix(
        (np.ones(labels.size, dtype=points.dtype), (labels, np.arange(labels.size))),
        shape=(num_clusters, labels.size),
    )
    sums = np.asarray(membership @ points, dtype=np.float64)
    counts = np.bincount(labels, minlength=num_clusters).astype(np.float64)
    centroids = sums / np.maximum(counts, 1.0)[:, None]
    return ClusterResult(labels, centroids.astype(np.float32), distances_to_centres(points, centroids, labels, chunk))


def distances_to_centres(points: np.ndarray, centroids: np.ndarray, labels: np.ndarray,
                         chunk: int = 65536) -> np.ndarray:
    """Euclidean distance of every point to the centre of its cluster: float64 (N,)."""
    centres = np.asarray(centroids, dtype=np.float64)
    distances = np.empty(labels.size, dtype=np.float64)
    for start in range(0, labels.size, chunk):  # chunked: a full (N, d) float64 difference can be GBs
        diff = points[start:start + chunk] - centres[labels[start:start + chunk]]
        distances[start:start + chunk] = np.sqrt(np.einsum("ij,ij->i", diff, diff))
    return distances


def nearest_centroids(
    points: np.ndarray, centroids: np.ndarray, count: int, chunk: int = 65536
) -> tuple[np.ndarray, np.ndarray]:
    """Indices and squared distances of each point's `count` nearest centres, nearest first.

    Chunked float32 GEMM (measured faster than a faiss flat search on 2 cores).
    """
    centres = centroids.astype(np.float32)
    centre_norms = (centroids.astype(np.float64) ** 2).sum(axis=1)
    nearest = np.empty((points.shape[0], count), dtype=np.int64)
    nearest_dist2 = np.empty((points.shape[0], count), dtype=np.float64)
    for start in range(0, points.shape[0], chunk):
        block = points[start:start + chunk].astype(np.float32)
        block_norms = np.einsum("ij,ij->i", block, block, dtype=np.float64)
        dist2 = block_norms[:, None] - 2.0 * (block @ centres.T).astype(np.float64) + centre_norms
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
    points: Optional[np.ndarray], centroids: np.ndarray, nearest: np.ndarray, nearest_dist2: np.ndarray, capacity: int,
    all_centres: Optional[Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]] = None,
) -> np.ndarray:
    """The paper's greedy reassignment under a capacity.

    Taken literally: (point, centre) pairs among each point's nearest centres
    are visited in order of increasing distance, and a point goes to the first
    centre that still has room. We compute the same result event by event
    (vectorised): every point proposes to its nearest centre that is not yet
    full; the centre whose capacity-th closest proposal is nearest fills first
    and keeps those, the rest move on to their next candidate; repeat (at most
    K events). Points whose candidates are all full go to the nearest centre
    with room among all centres, so no cluster ends above `capacity`; their
    distances to every centre come from `all_centres(point indices)` when the
    points are not at hand (sharded clustering), else from `points`.
    Long because the event loop is one algorithm; split, its order hides.
    """
    num_samples, num_clusters = nearest.shape[0], centroids.shape[0]
    if capacity * num_clusters < num_samples:
        raise ValueError(f"capacity {capacity} x {num_clusters} clusters cannot hold {num_samples} samples")
    num_candidates = nearest.shape[1]
    rows = np.arange(num_samples)
    position = np.zeros(num_samples, dtype=np.int64)  # which candidate each point proposes to
    full = np.zeros(num_clusters, dtype=bool)
    locked = np.zeros(num_samples, dtype=bool)  # accepted by a centre that filled up
    while True:
        # Skip candidates that are already full.
        while True:
            live = ~locked & (position < num_candidates)
            centre = np.where(live, nearest[rows, np.minimum(position, num_candidates - 1)], -1)
            blocked = live & full[np.maximum(centre, 0)]
            if not blocked.any():
                break
            position[blocked] += 1
        proposing = np.flatnonzero(live)
        counts = np.bincount(centre[proposing], minlength=num_clusters)
        overfull = np.flatnonzero((counts > capacity) & ~full)
        if overfull.size == 0:
            break
        distance = nearest_dist2[proposing, position[proposing]]
        fill_time = {}
        for candidate in overfull.tolist():
            mine = distance[centre[proposing] == candidate]
            fill_time[candidate] = np.partition(mine, capacity - 1)[capacity - 1]
        first = min(fill_time, key=lambda c: (fill_time[c], c))
        mine = proposing[centre[proposing] == first]
        keep_order = np.lexsort((mine, nearest_dist2[mine, position[mine]]))
        locked[mine[keep_order[:capacity]]] = True
        position[mine[keep_order[capacity:]]] += 1
        full[first] = True
    labels = np.where(position < num_candidates, nearest[rows, np.minimum(position, num_candidates - 1)], -1)
    unplaced = np.flatnonzero(labels < 0)
    if unplaced.size:
        room = capacity - np.bincount(labels[labels >= 0], minlength=num_clusters)
        all_nearest, all_dist2 = (all_centres(unplaced) if all_centres is not None
                                  else nearest_centroids(points[unplaced], centroids, num_clusters))
        for flat in np.lexsort((np.arange(all_dist2.size), all_dist2.ravel())).tolist():
            point, centre_id = flat // num_clusters, int(all_nearest.ravel()[flat])
            if labels[unplaced[point]] < 0 and room[centre_id] > 0:
                labels[unplaced[point]] = centre_id
                room[centre_id] -= 1
    logger.info("capacity cap %d moved %d samples off their nearest centre", capacity,
                int((labels != nearest[:, 0]).sum()))
    return labels.astype(np.int64)


def cluster_with(points: np.ndarray, settings: ClusteringSettings, world_size: int, *,
                 in_child: bool = False) -> ClusterResult:
    """k-means of `points` as the clustering settings say (K for `world_size`, restarts, cap, back-end, seed).
    `in_child`: a rank that goes on to train asks for it; scikit-learn's k-means then runs in a child process
    (the same centres), other back-ends as they are."""
    backend: Union[str, KMeansBackend] = settings.backend
    if in_child and settings.backend == SklearnKMeans.name:
        backend = SklearnKMeans(in_child=True)
    return cluster_features(points, backend=backend, **settings.kmeans_arguments(world_size))


def kmeans_settings(config: Any, world_size: int) -> dict[str, Any]:
    """0.5.0's reading of a block's k-means keys: `ClusteringSettings.kmeans_arguments`."""
    return stages_of(config).clustering.kmeans_arguments(world_size)


def cluster_by_config(points: np.ndarray, config: Any, world_size: int) -> ClusterResult:
    """0.5.0's `cluster_with` for a whole block."""
    return cluster_with(points, stages_of(config).clustering, world_size)


def spread_to_all(clusters: ClusterResult, participating_rows: np.ndarray, num_samples: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Labels (N,) and distances (N,) of every sample from those of the participating rows: -1 and 0 elsewhere."""
    if participating_rows.size == num_samples:
        return clusters.labels, clusters.distances  # every sample takes part: nothing to spread
    labels = np.full(num_samples, -1, dtype=np.int64)
    labels[participating_rows] = clusters.labels
    distances = np.zeros(num_samples, dtype=np.float64)
    distances[participating_rows] = clusters.distances
    return labels, distances


def category_counts(labels: np.ndarray, categories: Sequence[str], num_clusters: int
                    ) -> tuple[list[str], np.ndarray]:
    """Per cluster, how many samples of each category (a task family, say): (names, counts (K, F)).

    Samples with label -1 (left out of clustering) are not counted.
    """
    labels = np.asarray(labels, dtype=np.int64)
    taking_part = labels >= 0
    names, columns = np.unique(np.asarray(categories, dtype=object)[taking_part].astype(str), return_inverse=True)
    counts = np.zeros((num_clusters, len(names)), dtype=np.int64)
    np.add.at(counts, (labels[taking_part], columns), 1)
    return names.tolist(), counts


def purity(counts: np.ndarray) -> float:
    """(1/n) sum_c max_f |c and f| from `category_counts`: 1.0 when every cluster holds one category."""
    total = int(counts.sum())
    return float(counts.max(axis=1).sum() / total) if total and counts.shape[1] else 0.0


class KMeansBackend(ABC):
    """A k-means implementation: the centres of `points` (float32 (K, d))."""

    name: ClassVar[str]

    @abstractmethod
    def centroids(self, points: np.ndarray, num_clusters: int, n_init: int, max_iter: int, seed: int) -> np.ndarray:
        """k-means++ initialisation, `n_init` restarts, the best run's centres."""


class SklearnKMeans(KMeansBackend):
    """scikit-learn's KMeans (the default). With `in_child` it runs in a child process, which gives back the
    libraries scikit-learn imports (about 0.15 GB a training rank would keep): the same centres
    (`ds_cluster.clustering.child`)."""

    name = "sklearn"

    def __init__(self, in_child: bool = False) -> None:
        self.in_child = in_child

    def centroids(self, points: np.ndarray, num_clusters: int, n_init: int, max_iter: int, seed: int) -> np.ndarray:
        from ds_cluster.clustering.child import sklearn_centroids, sklearn_centroids_in_child

        if self.in_child:
            logger.info("k-means of %d points in a child process (scikit-learn's imports stay out of this rank)",
                        len(points))
            return sklearn_centroids_in_child(points, num_clusters, n_init, max_iter, seed)
        return sklearn_centroids(points, num_clusters, n_init, max_iter, seed)


class FaissKMeans(KMeansBackend):
    """faiss's k-means on samples of the points: for millions of samples (the `faiss` extra)."""

    name = "faiss"

    def centroids(self, points: np.ndarray, num_clusters: int, n_init: int, max_iter: int, seed: int) -> np.ndarray:
        return _kmeans_faiss(points, num_clusters, n_init, max_iter, seed)


BACKENDS: Registry[KMeansBackend] = Registry("backend", (SklearnKMeans(), FaissKMeans()))


def _kmeans_faiss(points: np.ndarray, num_clusters: int, n_init: int, max_iter: int, seed: int) -> np.ndarray:
    """faiss k-means: the n_init restarts on 64 points per centre, the best refined on 256 per centre.

    faiss itself trains on at most 256 points per centre; running the restarts
    on a coarser sample is what keeps N = 1M, K = 64 within seconds on 2 cores.
    """
    try:
        import faiss
    except ImportError as err:
        raise ValueError("backend 'faiss' needs the faiss package: pip install 'ds_cluster[faiss]'") from err
    rng = np.random.default_rng([seed, 0xFA155])
    dim = points.shape[1]
    iterations = min(max_iter, 25)

    def sample(per_centre: int) -> np.ndarray:
        size = min(points.shape[0], per_centre * num_clusters)
        rows = np.sort(rng.choice(points.shape[0], size=size, replace=False))
        return np.ascontiguousarray(points[rows], dtype=np.float32)

    restarts = faiss.Kmeans(dim, num_clusters, niter=iterations, nredo=n_init, seed=seed, verbose=False,
                            max_points_per_centroid=1 << 30, min_points_per_centroid=1)
    restarts.train(sample(64))
    refine = faiss.Kmeans(dim, num_clusters, niter=iterations, nredo=1, seed=seed, verbose=False,
                          max_points_per_centroid=1 << 30, min_points_per_centroid=1)
    refine.train(sample(256), init_centroids=np.asarray(restarts.centroids, dtype=np.float32))
    return np.asarray(refine.centroids, dtype=np.float32)
