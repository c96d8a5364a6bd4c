"""Tempered cluster weights (`weight_temperature`) and the semdedup selection (`dedup_similarity`)."""
from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_cluster import ClusterSamplingConfig
from tests.planning import plan_of
from ds_cluster.planning import diversity
from ds_cluster.planning.diversity import semantic_dedup
from ds_cluster.planning.selection import SelectionInputs, select_in_clusters
from ds_cluster.planning.weights import sample_weights
from tests.test_plan import blobs, config


# ------------------------------------------------------------------------------------------------ helpers
@st.composite
def clusters_with_budgets(draw) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(labels in a shuffled order, selected indices, cluster sizes, kept sizes): kept_c of each cluster c."""
    sizes = np.array(draw(st.lists(st.integers(1, 60), min_size=1, max_size=8)))
    kept = np.array([draw(st.integers(1, int(size))) for size in sizes])
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 16)))
    labels = rng.permutation(np.repeat(np.arange(sizes.size), sizes))
    selected = np.sort(np.concatenate([np.flatnonzero(labels == c)[:kept[c]] for c in range(sizes.size)]))
    return labels, selected, sizes, kept


def unit_weights(sizes: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """Today's per-cluster weights, (n_c / N) / (s_c / S), written out with the same float64 arithmetic."""
    sizes, kept = sizes.astype(np.float64), kept.astype(np.float64)
    return (sizes / sizes.sum()) / (kept / kept.sum())


def reference_dedup(points: np.ndarray, ordered: np.ndarray, keep: int, similarity: float) -> np.ndarray:
    """The semdedup rule read literally, on the whole similarity matrix at once."""
    rows = points[ordered].astype(np.float64)
    lengths = np.linalg.norm(rows, axis=1, keepdims=True)
    unit = rows / np.where(lengths > 0, lengths, 1.0)
    cosine = np.round(unit @ unit.T, 9)
    best = [max(cosine[i, :i].tolist(), default=-np.inf) for i in range(len(ordered))]
    distinct = [i for i in range(len(ordered)) if best[i] < similarity]
    duplicates = sorted((i for i in range(len(ordered)) if best[i] >= similarity), key=lambda i: (best[i], i))
    return ordered[(distinct + duplicates)[:keep]]


# ------------------------------------------------------------------------------------- tempered weights
@given(clusters_with_budgets())
@settings(max_examples=150, deadline=None)
def test_temperature_one_is_todays_weights_and_zero_is_all_ones(case):
    labels, selected, sizes, kept = case
    today = np.zeros(labels.size)
    today[selected] = unit_weights(sizes, kept)[labels[selected]]
    assert np.array_equal(sample_weights(labels, selected, sizes, kept, "cluster", temperature=1.0), today)
    assert np.array_equal(sample_weights(labels, selected, sizes, kept, "cluster"), today)
    flat = sample_weights(labels, selected, sizes, kept, "cluster", temperature=0.0)
    assert (flat[selected] == 1.0).all() and flat.sum() == selected.size
    assert np.array_equal(flat, sample_weights(labels, selected, sizes, kept, "none"))


@given(clusters_with_budgets(), st.floats(0.0, 1.0))
@settings(max_examples=200, deadline=None)
def test_tempered_weights_have_mean_one_and_keep_the_clusters_order(case, temperature):
    labels, selected, sizes, kept = case
    weights = sample_weights(labels, selected, sizes, kept, "cluster", temperature=temperature)
    assert abs(weights[selected].sum() - selected.size) < 1e-9 * selected.size
    assert (np.delete(weights, selected) == 0).all()
    # Per cluster, the tempered weights rank the clusters as the untempered ones do (ties allowed).
    untempered, tempered = unit_weights(sizes, kept), np.zeros(sizes.size)
    tempered[labels[selected]] = weights[selected]
    lighter = untempered[:, None] < untempered[None, :]
    assert (tempered[:, None] <= tempered[None, :] * (1 + 1e-12))[lighter].all()


def test_tempered_weights_by_hand():
    # Clusters of 3 and 1, one kept of each: untempered 1.5 and 0.5; t = 0.5 gives sqrt(1.5), sqrt(0.5),
    # rescaled to a mean of 1.
    labels = np.array([0, 0, 0, 1])
    weights = sample_weights(labels, np.array([0, 3]), np.array([3, 1]), np.array([1, 1]), "cluster",
                             temperature=0.5)
    scale = 2 / (np.sqrt(1.5) + np.sqrt(0.5))
    assert weights == pytest.approx([np.sqrt(1.5) * scale, 0.0, 0.0, np.sqrt(0.5) * scale], abs=1e-15)
    # Everything kept (the path without a scatter) and weighting "none" ignoring the temperature.
    everything = sample_weights(labels, np.arange(4), np.array([3, 1]), np.array([3, 1]), "cluster",
                                temperature=0.3)
    assert everything == pytest.approx([1.0] * 4, abs=1e-15)
    assert sample_weights(labels, np.array([0, 3]), np.array([3, 1]), np.array([1, 1]), "none",
                          temperature=0.5).tolist() == [1.0, 0.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="temperature must be in"):
        sample_weights(labels, np.array([0, 3]), np.array([3, 1]), np.array([1, 1]), "cluster", temperature=1.5)


def test_plan_with_tempered_weights():
    features, _ = blobs([120, 50, 30])
    shape = {"world_size": 1, "micro_batch_size": 2, "gradient_accumulation_steps": 1}
    block = {"num_clusters": 3, "budget_mode": "equal", "budget_ratio": 0.3, "capacity_factor": None}
    default = plan_of(features, config(**block), **shape)
    explicit_one = plan_of(features, config(**block, weight_temperature=1.0), **shape)
    half = plan_of(features, config(**block, weight_temperature=0.5), **shape)
    flat = plan_of(features, config(**block, weight_temperature=0.0), **shape)
    assert np.array_equal(explicit_one.weights, default.weights)
    assert explicit_one.fingerprint() == default.fingerprint()
    assert "weight_temperature" not in default.settings and half.settings["weight_temperature"] == 0.5
    assert len({default.fingerprint(), half.fingerprint(), flat.fingerprint()}) == 3
    assert np.array_equal(half.selected, default.selected)
    assert abs(half.weights[half.selected].mean() - 1.0) < 1e-12
    assert (flat.weights[flat.selected] == 1.0).all()
    spread = [float(np.ptp(plan.weights[plan.selected])) for plan in (default, half, flat)]
    assert spread[0] > spread[1] > spread[2] == 0.0


# -------------------------------------------------------------------------------------------- semdedup
def planted_duplicates() -> tuple[np.ndarray, np.ndarray]:
    """One cluster of 7 rows in 4 directions: e0 three times (once scaled), e1 twice, e2 and e3 once."""
    eye = np.eye(4, dtype=np.float32)
    points = np.stack([eye[0], eye[1], 2.5 * eye[0], eye[2], eye[0], eye[3], eye[1]])
    return points, np.array([0, 1, 0, 2, 0, 3, 1])  # the direction of each row


@pytest.mark.parametrize("seed", range(6))
def test_semdedup_drops_planted_duplicates_while_there_is_room(seed):
    points, direction = planted_duplicates()
    labels = np.zeros(len(points), dtype=np.int64)
    for keep in (1, 2, 3, 4):
        chosen = select_in_clusters(labels, np.array([keep]), "semdedup", SelectionInputs(features=points, seed=seed))
        assert chosen.size == keep and np.unique(direction[chosen]).size == keep  # no direction twice
    # Past the four directions, duplicates fill the budget; every direction is still there.
    chosen = select_in_clusters(labels, np.array([6]), "semdedup", SelectionInputs(features=points, seed=seed))
    assert chosen.size == 6 and set(direction[chosen].tolist()) == {0, 1, 2, 3}


def test_semdedup_fills_with_the_least_similar_duplicates_first():
    # Row order given: row 1 is 0.9 similar to row 0, row 2 0.99, row 3 identical to row 0. At 0.85 all three
    # are near-duplicates of row 0; a budget of 3 takes row 0, then the least similar: rows 1 and 2.
    angles = np.arccos([1.0, 0.9, 0.99, 1.0])
    points = np.stack([np.cos(angles), np.sin(angles)], axis=1)
    ordered = np.arange(4)
    assert semantic_dedup(points, ordered, 3, 0.85).tolist() == [0, 1, 2]
    assert semantic_dedup(points, ordered, 3, 0.95).tolist() == [0, 1, 2]  # row 1 is no duplicate at 0.95
    assert semantic_dedup(points, np.array([3, 0, 1]), 2, 1.0).tolist() == [3, 1]  # row 0 repeats row 3 exactly
    # An all-zero row is similar to nothing, not even another all-zero row.
    zeros = np.zeros((3, 2))
    assert semantic_dedup(zeros, np.arange(3), 3, 0.5).tolist() == [0, 1, 2]


@given(data=st.data(), count=st.integers(1, 30), dim=st.integers(1, 3), chunk=st.integers(1, 5),
       similarity=st.one_of(st.sampled_from([0.5, 0.9, 0.95, 1.0]), st.floats(0.01, 1.0)))
@settings(max_examples=200, deadline=None)
def test_semantic_dedup_is_the_rule_read_literally(data, count, dim, chunk, similarity):
    # Small integer rows: many exact and scaled duplicates, zero rows, and exact ties in similarity.
    points = np.array(data.draw(st.lists(st.lists(st.integers(-2, 2), min_size=dim, max_size=dim),
                                         min_size=count, max_size=count)), dtype=np.float32)
    ordered = np.array(data.draw(st.permutations(range(count))), dtype=np.int64)
    keep = data.draw(st.integers(1, count))
    with mock.patch.object(diversity, "DEDUP_CHUNK", chunk):  # several blocks, within and across rows
        chosen = semantic_dedup(points, ordered, keep, similarity)
    expected = reference_dedup(points, ordered, keep, similarity)
    if keep == count:  # everything kept: returned as given, without reading a similarity
        assert chosen.tolist() == ordered.tolist() and sorted(expected.tolist()) == sorted(chosen.tolist())
    else:
        assert chosen.tolist() == expected.tolist()


@given(data=st.data(), num_clusters=st.integers(1, 4), seed=st.integers(0, 1000))
@settings(max_examples=100, deadline=None)
def test_semdedup_keeps_each_clusters_budget(data, num_clusters, seed):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, num_clusters, 60)
    labels[:num_clusters] = np.arange(num_clusters)  # no cluster empty
    points = rng.integers(-1, 2, (60, 2)).astype(np.float32)  # mostly duplicates
    counts = np.bincount(labels, minlength=num_clusters)
    kept = np.array([data.draw(st.integers(1, int(size))) for size in counts])
    chosen = select_in_clusters(labels, kept, "semdedup", SelectionInputs(
        features=points, seed=seed, dedup_similarity=data.draw(st.floats(0.05, 1.0))))
    assert np.array_equal(np.bincount(labels[chosen], minlength=num_clusters), kept)
    assert np.array_equal(chosen, np.unique(chosen))  # sorted, no sample twice


def test_semdedup_is_seeded_and_reads_random_s_order():
    rng = np.random.default_rng(0)
    points = rng.normal(size=(200, 8)).astype(np.float32)
    labels = rng.integers(0, 3, 200)
    kept = np.array([20, 15, 10])
    first = select_in_clusters(labels, kept, "semdedup", SelectionInputs(features=points, seed=5))
    assert np.array_equal(first, select_in_clusters(labels, kept, "semdedup", SelectionInputs(features=points, seed=5)))
    picks = {tuple(select_in_clusters(labels, kept, "semdedup", SelectionInputs(features=points, seed=seed)))
             for seed in range(5)}
    assert len(picks) == 5
    # Without near-duplicates (Gaussian rows, similarity 1) and with nothing but duplicates (identical rows),
    # semdedup keeps exactly what "random" keeps: the same seeded order.
    for rows in (points, np.ones_like(points)):
        for seed in (0, 5):
            assert np.array_equal(select_in_clusters(labels, kept, "semdedup",
                                                     SelectionInputs(features=rows, seed=seed, dedup_similarity=1.0)),
                                  select_in_clusters(labels, kept, "random", SelectionInputs(seed=seed)))
    identical = select_in_clusters(labels, kept, "semdedup", SelectionInputs(features=np.ones_like(points), seed=1))
    assert np.array_equal(np.bincount(labels[identical]), kept)


def test_semdedup_errors():
    labels = np.zeros(5, dtype=np.int64)
    with pytest.raises(ValueError, match="'semdedup' needs the features themselves; use 'random'"):
        select_in_clusters(labels, np.array([2]), "semdedup")
    with pytest.raises(ValueError, match="'semdedup' needs the features themselves; use 'spread' or 'random'"):
        select_in_clusters(labels, np.array([2]), "semdedup", SelectionInputs(distances=np.arange(5.0)))
    with pytest.raises(ValueError, match="dedup_similarity must be in"):
        select_in_clusters(labels, np.array([2]), "semdedup", SelectionInputs(features=np.eye(5), dedup_similarity=0.0))
    with pytest.raises(ValueError, match="one of peripheral, core, random, mix, norm, spread, kcenter, semdedup"):
        select_in_clusters(labels, np.array([2]), "edges")  # type: ignore[arg-type]


def test_semdedup_plan_end_to_end():
    features, _ = blobs([90, 60, 40], dim=6, seed=3)
    features[1::3] = features[0::3][:features[1::3].shape[0]]  # every third row repeats the one before it
    shape = {"world_size": 2, "micro_batch_size": 2, "gradient_accumulation_steps": 1}
    block = {"num_clusters": 3, "budget_mode": "proportional", "budget_ratio": 0.4, "capacity_factor": None,
             "selection": "semdedup", "dedup_similarity": 0.999}
    plan = plan_of(features, config(**block), **shape)
    assert np.array_equal(np.bincount(plan.labels[plan.selected], minlength=3), plan.kept_sizes)
    kept_rows = features[plan.selected]
    assert np.unique(kept_rows, axis=0).shape[0] == plan.num_kept  # room for distinct rows: no repeat kept
    assert plan.settings["dedup_similarity"] == 0.999
    again = plan_of(features, config(**block), **shape)
    assert again.fingerprint() == plan.fingerprint()
    assert plan_of(features, config(**block, seed=8), **shape).fingerprint() != plan.fingerprint()
    # Without the features themselves it stops and says so.
    labels = plan.labels
    with pytest.raises(ValueError, match="'semdedup' needs the features themselves"):
        plan_of(None, config(**block), **shape, labels=labels)
    with pytest.raises(ValueError, match="'semdedup' needs the features themselves, and there are none"):
        plan_of(None, config(**block), **shape, labels=labels, distances=plan.distances)


# ---------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("key,value", [("weight_temperature", -0.1), ("weight_temperature", 1.01),
                                       ("dedup_similarity", 0.0), ("dedup_similarity", -0.5),
                                       ("dedup_similarity", 1.2)])
def test_config_refuses_values_out_of_range(key, value):
    with pytest.raises(ValueError, match=f"'{key}'"):
        ClusterSamplingConfig.from_dict({"enabled": True, key: value})


def test_config_accepts_the_ends_of_the_ranges_and_keeps_the_defaults():
    block = ClusterSamplingConfig.from_dict({"weight_temperature": 0.0, "dedup_similarity": 1.0,
                                             "selection": "semdedup"})
    assert block.weight_temperature == 0.0 and block.dedup_similarity == 1.0
    assert ClusterSamplingConfig.from_dict({"weight_temperature": 1}).weight_temperature == 1.0
    defaults = ClusterSamplingConfig()
    assert defaults.weight_temperature == 1.0 and defaults.dedup_similarity == 0.95
    assert ClusterSamplingConfig(preset="paper").selection == "peripheral"
