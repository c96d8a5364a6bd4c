"""k-means where the features are: every rank keeps its own rows, Lloyd steps sum over the ranks.

The feature matrix of a large job (10 M samples x hidden 4096 is 164 GB) never comes together on one
rank. Each rank holds some rows (with their global indices); what crosses ranks is small:

- initialisation: k-means++ (scikit-learn, `n_init` restarts, the seed) on a seeded sample of at most
  `sample_per_centre` x K rows, drawn by global index so that it is the same rows whatever the sharding;
- each Lloyd step: the (K, d) centroid sums and the K counts, summed over the ranks;
- the capacity cap: each point's few nearest centres (indices and squared distances), gathered, then
  the same greedy pass on every rank; the rare points whose candidates are all full get their
  distances to every centre from the rank that holds them.

The collectives are passed in (`ds_cluster.collectives.Collectives`): the module itself is pure numpy, and `LOCAL`
runs the same algorithm in one process, which is what two ranks must reproduce.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
from scipy import sparse

from ds_cluster.clustering.kmeans import capped_assignment, distances_to_centres, nearest_centroids
from ds_cluster.collectives import LOCAL, Collectives
from ds_cluster.settings import ClusteringSettings


# scikit-learn's convergence tolerance (relative to the data's mean variance), and the sample of each rank's rows
# per centre that k-means++ starts from.
TOLERANCE = 1e-4
SAMPLE_PER_CENTRE = 256


@dataclass(frozen=True)
class ShardedClusters:
    """This rank's part of the result, and the global labels and distances (small: N values each)."""

    centroids: np.ndarray        # (K, d) float32, the k-means centres
    rows: np.ndarray             # the global indices this rank holds
    labels: np.ndarray           # (len(rows),) int64
    distances: np.ndarray        # (len(rows),) float64, to the centre of the sample's cluster
    all_rows: np.ndarray         # every rank's rows, ascending
    all_labels: np.ndarray       # labels of all_rows
    all_distances: np.ndarray    # distances of all_rows
    iterations: int


def cluster_sharded(rows: np.ndarray, points: np.ndarray, num_samples: int, settings: ClusteringSettings,
                    collectives: Collectives = LOCAL) -> ShardedClusters:
    """k-means over the ranks' rows together with the clustering settings (K for the collectives' world size,
    restarts, iterations, capacity cap, seed), then the capacity cap. Collective: call on every rank.

    rows: global indices (< num_samples) of this rank's `points` (float32 (n, d)); the union over the
    ranks is the set of samples to cluster (samples left out appear on no rank).
    """
    arguments = settings.kmeans_arguments(collectives.world_size)
    num_clusters, seed, n_init, max_iter = (arguments[key] for key in ("num_clusters", "seed", "n_init", "max_iter"))
    capacity_factor, capacity_neighbors = arguments["capacity_factor"], arguments["capacity_neighbors"]
    tol, sample_per_centre = TOLERANCE, SAMPLE_PER_CENTRE
    rows = np.asarray(rows, dtype=np.int64)
    points = np.asarray(points, dtype=np.float32)
    centroids = _initial_centres(rows, points, num_samples, num_clusters, seed, n_init, sample_per_centre,
                                 collectives)
    total = collectives.sum(np.array([points.shape[0]], dtype=np.float64))[0]
    # scikit-learn's tolerance: relative to the mean variance of the data.
    moments = collectives.sum(np.concatenate([points.sum(axis=0, dtype=np.float64),
                                              (points.astype(np.float64) ** 2).sum(axis=0)]))
    dim = points.shape[1]
    variance = np.mean(moments[dim:] / total - (moments[:dim] / total) ** 2)
    iterations = 0
    for iterations in range(1, max_iter + 1):  # noqa: B007 (the count after the loop is reported)
        labels = nearest_centroids(points, centroids, 1)[0][:, 0]
        membership = sparse.csr_matrix((np.ones(labels.size), (labels, np.arange(labels.size))),
                                       shape=(num_clusters, labels.size))
        sums = np.asarray(membership @ points.astype(np.float64))
        counts = np.bincount(labels, minlength=num_clusters).astype(np.float64)
        reduced = collectives.sum(np.concatenate([sums.ravel(), counts]))
        sums, counts = reduced[:-num_clusters].reshape(num_clusters, dim), reduced[-num_clusters:]
        updated = np.where(counts[:, None] > 0, sums / np.maximum(counts, 1.0)[:, None], centroids)
        shift = float(((updated - centroids) ** 2).sum())
        centroids = updated
        if shift <= tol * variance:
            break
    return _capped(rows, points, centroids, total, num_clusters, capacity_factor, capacity_neighbors,
                   collectives, iterations)


def _initial_centres(rows: np.ndarray, points: np.ndarray, num_samples: int, num_clusters: int, seed: int,
                     n_init: int, sample_per_centre: int, collectives: Collectives) -> np.ndarray:
    """k-means++ on a sample chosen by global index (the same rows however the data is sharded)."""
    from sklearn.cluster import KMeans

    rng = np.random.default_rng([seed, 0x5A4D])
    size = min(num_samples, sample_per_centre * num_clusters)
    wanted = np.sort(rng.choice(num_samples, size=size, replace=False))
    mine = np.isin(rows, wanted)
    parts = collectives.gather((rows[mine], points[mine]))
    sample_rows = np.concatenate([part[0] for part in parts])
    sample = np.concatenate([part[1] for part in parts])[np.argsort(sample_rows, kind="stable")]
    if sample.shape[0] < num_clusters:
        raise ValueError(f"only {sample.shape[0]} samples to start {num_clusters} clusters from; lower num_clusters")
    model = KMeans(n_clusters=num_clusters, init="k-means++", n_init=n_init, random_state=seed).fit(sample)
    return model.cluster_centers_.astype(np.float64)


def _capped(rows: np.ndarray, points: np.ndarray, centroids: np.ndarray, total: float, num_clusters: int,
            capacity_factor: Optional[float], capacity_neighbors: int, collectives: Collectives,
            iterations: int) -> ShardedClusters:
    """Labels under the capacity cap, computed the same way on every rank from gathered neighbour lists."""
    count = min(capacity_neighbors, num_clusters)
    nearest, nearest_dist2 = nearest_centroids(points, centroids, count)
    parts = collectives.gather((rows, nearest.astype(np.int32), nearest_dist2))
    all_rows = np.concatenate([part[0] for part in parts])
    order = np.argsort(all_rows, kind="stable")
    all_rows = all_rows[order]
    all_nearest = np.concatenate([part[1] for part in parts]).astype(np.int64)[order]
    all_dist2 = np.concatenate([part[2] for part in parts])[order]
    labels = all_nearest[:, 0]
    if capacity_factor is not None:
        capacity = math.ceil(capacity_factor * int(total) / num_clusters)
        if np.bincount(labels, minlength=num_clusters).max() > capacity:
            def all_centres(unplaced: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
                # The holders of the unplaced points measure them against every centre.
                wanted = all_rows[unplaced]
                mine = np.isin(rows, wanted)
                found = nearest_centroids(points[mine], centroids, num_clusters)
                gathered = collectives.gather((rows[mine], found[0], found[1]))
                got = np.concatenate([g[0] for g in gathered])
                position = np.argsort(got, kind="stable")
                return (np.concatenate([g[1] for g in gathered])[position],
                        np.concatenate([g[2] for g in gathered])[position])

            labels = capped_assignment(None, centroids, all_nearest, all_dist2, capacity, all_centres=all_centres)
    mine = np.searchsorted(all_rows, rows)
    my_labels = labels[mine]
    my_distances = distances_to_centres(points, centroids, my_labels)
    gathered = collectives.gather((rows, my_distances))
    distance_rows = np.concatenate([g[0] for g in gathered])
    all_distances = np.concatenate([g[1] for g in gathered])[np.argsort(distance_rows, kind="stable")]
    return ShardedClusters(centroids=centroids.astype(np.float32), rows=rows, labels=my_labels,
                           distances=my_distances, all_rows=all_rows, all_labels=labels,
                           all_distances=all_distances, iterations=iterations)
