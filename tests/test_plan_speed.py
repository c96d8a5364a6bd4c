"""The fast selection (no sort of all N keys) chooses exactly what the sort-based definition chooses.

select_in_clusters reads each cluster in the order of a key (one seeded uniform draw per sample for
"random", the distance or norm otherwise; ties to the lower index) and takes from that order. It gets
there by a histogram of key bins (random), a radix sort of the labels, partitions and per-cluster sorts
instead of a stable sort of all N keys (issue 22: the planner at budget_ratio 0.5 and N = 10M); these
tests pin the result to the plain definition. The timing itself is bench/plan_speed.py's.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds_cluster.planning.selection import (SelectionInputs, _first_in_order, _stable_argsort, k_center_greedy,
                                          select_in_clusters)

STRATEGIES = ("random", "peripheral", "core", "mix", "norm", "spread", "kcenter")


def _by_definition(labels: np.ndarray, kept: np.ndarray, strategy: str, distances: np.ndarray, norms: np.ndarray,
                   features: np.ndarray, seed: int) -> np.ndarray:
    """Every cluster sorted by its key (stable: ties by index), then read as the strategy says."""
    if strategy == "random":
        key = np.random.default_rng([seed, 0x5E1EC7]).random(labels.size)
    elif strategy in ("peripheral", "mix"):
        key = -distances
    elif strategy == "norm":
        key = -norms
    else:
        key = distances
    chosen = []
    for cluster, keep in enumerate(kept):
        members = np.flatnonzero(labels == cluster)
        ordered = members[np.argsort(key[members], kind="stable")]
        if strategy == "mix":
            from_edge = (keep + 1) // 2
            chosen += [ordered[:from_edge], ordered[len(ordered) - (keep - from_edge):] if keep - from_edge else []]
        elif strategy == "spread":
            chosen.append(ordered[((np.arange(keep) + 0.5) * len(ordered) / keep).astype(np.int64)])
        elif strategy == "kcenter":
            chosen.append(k_center_greedy(features, ordered, keep))
        else:
            chosen.append(ordered[:keep])
    return np.sort(np.concatenate(chosen)).astype(np.int64)


@st.composite
def selection_inputs(draw):
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    size = draw(st.integers(1, 250))
    num_clusters = draw(st.integers(1, 6))
    labels = rng.integers(0, num_clusters, size)
    labels[:num_clusters] = np.arange(num_clusters)[:size]
    if draw(st.booleans()):
        left_out = rng.random(size) < 0.2
        left_out[:num_clusters] = False  # every cluster keeps a member, as build_plan's are
        labels[left_out] = -1  # left out: never chosen
    num_clusters = int(labels.max()) + 1
    counts = np.bincount(labels[labels >= 0], minlength=num_clusters)
    kept = np.array([rng.integers(1, n + 1) for n in counts], dtype=np.int64)
    # Coarse rounding makes ties common; a few NaN and signed zeros test the sort's conventions.
    distances = np.round(rng.gamma(2.0, 0.5, size), draw(st.integers(0, 2)))
    if draw(st.booleans()):
        distances[rng.random(size) < 0.15] = np.nan
        distances[rng.random(size) < 0.15] = -0.0
    norms = np.round(rng.gamma(2.0, 0.5, size), 1)
    features = np.round(rng.normal(size=(size, 2)), 0).astype(np.float32)  # duplicate points too
    return labels, kept, distances, norms, features, seed


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(selection_inputs(), st.sampled_from(STRATEGIES))
def test_fast_selection_is_the_sort_based_definition(inputs, strategy):
    labels, kept, distances, norms, features, seed = inputs
    if strategy == "kcenter":
        distances = np.nan_to_num(distances, nan=9.0)  # k-centre starts from a real distance
    fast = select_in_clusters(labels, kept, strategy,
                              SelectionInputs(distances=distances, norms=norms, features=features, seed=seed))
    assert fast.dtype == np.int64
    assert np.array_equal(fast, _by_definition(labels, kept, strategy, distances, norms, features, seed))


def test_random_selection_at_scale_is_the_sort_based_definition():
    # Skewed clusters and left-out rows at N = 200,000: boundary bins with many rows, not a small-input case.
    rng = np.random.default_rng(4)
    weights = 1.0 / np.arange(1, 41)
    labels = rng.choice(40, size=200_000, p=weights / weights.sum())
    labels[rng.random(labels.size) < 0.05] = -1
    counts = np.bincount(labels[labels >= 0], minlength=40)
    kept = np.maximum(counts // 2, 1)
    fast = select_in_clusters(labels, kept, "random", SelectionInputs(seed=9))
    assert np.array_equal(fast, _by_definition(labels, kept, "random", None, None, None, seed=9))
    assert (np.bincount(labels[fast], minlength=40) == kept).all()


def test_random_selection_with_many_clusters_and_few_bins(monkeypatch):
    # Many clusters shrink the key bins (the histogram stays bounded); with one bin every row is a candidate.
    import ds_cluster.planning.selection as selection

    rng = np.random.default_rng(2)
    labels = rng.integers(0, 300, 5000)
    labels[:300] = np.arange(300)
    counts = np.bincount(labels)
    kept = rng.integers(1, counts + 1)
    expected = _by_definition(labels, kept, "random", None, None, None, seed=5)
    for max_cells in (1 << 22, 4096, 301, 1):
        monkeypatch.setattr(selection, "_MAX_HISTOGRAM", max_cells)
        assert np.array_equal(select_in_clusters(labels, kept, "random", SelectionInputs(seed=5)), expected)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 300), st.integers(0, 3), st.integers(0, 2**16), st.booleans())
def test_stable_argsort_and_first_in_order_match_a_stable_sort(size, decimals, seed, special):
    rng = np.random.default_rng(seed)
    keys = np.round(rng.normal(size=size), decimals)
    if special:
        keys[rng.random(size) < 0.2] = np.nan
        keys[rng.random(size) < 0.2] = -0.0
        keys[rng.random(size) < 0.2] = 0.0
    stable = np.argsort(keys, kind="stable")
    assert np.array_equal(_stable_argsort(keys), stable)
    count = int(rng.integers(0, size + 1))
    assert np.array_equal(_first_in_order(keys, count), np.sort(stable[:count]))


def test_kcenter_never_picks_a_sample_twice_when_points_repeat():
    # Three distinct points, six samples: once all three are covered, the duplicates come next, lowest first.
    points = np.array([[0.0], [5.0], [0.0], [5.0], [9.0], [9.0]], dtype=np.float32)
    picked = k_center_greedy(points, np.arange(6), 5)
    assert picked.tolist() == [0, 4, 1, 2, 3]
    labels = np.zeros(6, dtype=np.int64)
    chosen = select_in_clusters(labels, np.array([5]), "kcenter",
                                SelectionInputs(distances=np.abs(points[:, 0]) * 1.0, features=points))
    assert chosen.tolist() == [0, 1, 2, 3, 4]


def test_a_cluster_asked_for_more_than_it_has_is_named():
    with pytest.raises(ValueError, match="cluster 1 has 2 samples, cannot keep 3"):
        select_in_clusters(np.array([0, 0, 1, 1]), np.array([1, 3]), "random")


def test_random_selection_is_uniform_within_each_cluster():
    # Two clusters (12 and 5 members, keeping 4 and 2) over 3000 seeds: every member is kept in about
    # keep / size of the draws (five binomial standard deviations).
    labels = np.array([0] * 12 + [1] * 5)
    kept = np.array([4, 2])
    times_kept = np.zeros(labels.size)
    draws = 3000
    for seed in range(draws):
        times_kept[select_in_clusters(labels, kept, "random", SelectionInputs(seed=seed))] += 1
    share = np.where(labels == 0, 4 / 12, 2 / 5)
    assert (np.abs(times_kept / draws - share) < 5 * np.sqrt(share * (1 - share) / draws)).all()
