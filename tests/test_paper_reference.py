"""The paper preset keeps exactly what the reference algorithm keeps, with and without a binding capacity cap.

`reference_selection` is the published procedure written out literally, step by step, independently of
ds_cluster's vectorised code: scikit-learn k-means (k-means++, 10 restarts, the seed), the capacity cap
as a greedy pass over (point, centre) pairs among each point's 8 nearest centres in order of increasing
distance, distances to the k-means centres, floor(r x smallest cluster) farthest samples per cluster, and
rank weights K n_c / N.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from sklearn.cluster import KMeans

from ds_cluster import ClusterSamplingConfig
from tests.planning import plan_of


def reference_selection(features: np.ndarray, world_size: int, ratio: float, seed: int, alpha: float = 1.5,
                        neighbours: int = 8) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(labels, selected indices, weights of the selected) as the reference computes them."""
    num_samples, num_clusters = features.shape[0], world_size
    kmeans = KMeans(n_clusters=num_clusters, init="k-means++", n_init=10, random_state=seed).fit(features)
    centres = kmeans.cluster_centers_
    distance = np.linalg.norm(features[:, None, :].astype(np.float64) - centres[None, :, :], axis=2)
    labels = distance.argmin(axis=1)
    capacity = math.ceil(alpha * num_samples / num_clusters)
    if np.bincount(labels, minlength=num_clusters).max() > capacity:
        pairs = sorted((distance[i, c], i, c) for i in range(num_samples)
                       for c in np.argsort(distance[i], kind="stable")[:neighbours])
        labels = np.full(num_samples, -1)
        room = np.full(num_clusters, capacity)
        for _, i, c in pairs:
            if labels[i] < 0 and room[c] > 0:
                labels[i], room[c] = c, room[c] - 1
        for i in np.flatnonzero(labels < 0):  # no room among its neighbours: the nearest centre with room
            c = next(c for c in np.argsort(distance[i], kind="stable") if room[c] > 0)
            labels[i], room[c] = c, room[c] - 1
    own = distance[np.arange(num_samples), labels]
    sizes = np.bincount(labels, minlength=num_clusters)
    per_cluster = math.floor(ratio * sizes.min())
    selected = np.sort(np.concatenate([
        members[np.argsort(-own[members], kind="stable")[:per_cluster]]
        for members in (np.flatnonzero(labels == c) for c in range(num_clusters))]))
    weights = num_clusters * sizes[labels[selected]] / num_samples
    return labels, selected, weights


def skewed_blobs(sizes: list[int], seed: int, dim: int = 6) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.normal(0, 4, (len(sizes), dim))
    return np.concatenate([rng.normal(centre, 1.0, (size, dim)) for centre, size in zip(centres, sizes)]
                          ).astype(np.float32)


def same_up_to_renaming(a: np.ndarray, b: np.ndarray) -> bool:
    mapping = {}
    for x, y in zip(a.tolist(), b.tolist()):
        if mapping.setdefault(x, y) != y:
            return False
    return len(set(mapping.values())) == len(mapping)


CASES = [
    # (cluster sizes of the data, world size = K, r, whether the cap binds)
    ([300, 300], 2, 1.0, False),
    ([300, 300], 2, 0.5, False),
    ([1000, 200], 2, 1.0, True),
    ([1000, 200], 2, 0.5, True),
    ([500, 150, 100, 50], 4, 0.5, True),
    ([200, 200, 200, 200], 4, 0.75, False),
]


@pytest.mark.parametrize("sizes,world_size,ratio,binds", CASES, ids=[f"{c[0]}-K{c[1]}-r{c[2]}" for c in CASES])
def test_paper_preset_keeps_exactly_what_the_reference_keeps(sizes, world_size, ratio, binds):
    features = skewed_blobs(sizes, seed=len(sizes) + world_size)
    seed = 7
    labels, selected, weights = reference_selection(features, world_size, ratio, seed)
    capacity = math.ceil(1.5 * len(features) / world_size)
    kmeans_sizes = np.bincount(KMeans(n_clusters=world_size, n_init=10, random_state=seed).fit(features).labels_)
    assert (kmeans_sizes.max() > capacity) == binds  # the case really exercises (or not) the cap
    config = ClusterSamplingConfig(enabled=True, preset="paper", budget_ratio=ratio, seed=seed)
    plan = plan_of(features, config, world_size=world_size, micro_batch_size=1, gradient_accumulation_steps=1)
    assert same_up_to_renaming(plan.labels, labels)
    assert plan.selected.tolist() == selected.tolist()
    np.testing.assert_allclose(plan.weights[plan.selected], weights, rtol=1e-12)


@pytest.mark.parametrize("sizes,world_size,ratio,binds", CASES[2:4], ids=["cap binds r1", "cap binds r0.5"])
def test_the_same_through_an_analysis_folder(tmp_path, sizes, world_size, ratio, binds):
    """What the hook does: the analysis records labels, k-means centres and distances; the plan reads them."""
    from ds_cluster import BatchShape, build_plan, cluster_samples
    from ds_cluster.analysis.folder import AnalysisDir
    from ds_cluster.clustering.kmeans import cluster_features

    features = skewed_blobs(sizes, seed=len(sizes) + world_size)
    config = ClusterSamplingConfig(enabled=True, preset="paper", budget_ratio=ratio, seed=7)
    clusters = cluster_features(features, num_clusters=world_size, n_init=10, capacity_factor=1.5, seed=7)
    AnalysisDir(tmp_path / "analysis").write({
        "features.npy": features, "labels.npy": clusters.labels, "distances.npy": clusters.distances,
        "centroids.npy": clusters.centroids}, {}, {})
    inputs = AnalysisDir(tmp_path / "analysis").load_inputs(len(features))
    plan = build_plan(cluster_samples(inputs, config.stages().clustering, world_size), config,
                      BatchShape(world_size, 1, 1))
    labels, selected, weights = reference_selection(features, world_size, ratio, seed=7)
    assert same_up_to_renaming(plan.labels, labels)
    assert plan.selected.tolist() == selected.tolist()
    np.testing.assert_allclose(plan.weights[plan.selected], weights, rtol=1e-12)
