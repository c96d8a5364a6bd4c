"""The pure planner: budgets, selection, capacity cap, weights, schedule, determinism."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds_cluster import ClusterSamplingConfig, Plan
from tests.planning import plan_of
from ds_cluster.planning.allocation import batch_quotas
from ds_cluster.clustering.kmeans import cluster_features
from ds_cluster.planning.budget import apportion, cluster_budgets
from ds_cluster.planning.selection import SelectionInputs, select_in_clusters
from ds_cluster.planning.weights import sample_weights


def blobs(sizes, dim=4, seed=0, spread=1.0):
    """Well separated Gaussian blobs of the given sizes (features) and their blob ids."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(0, 20, (len(sizes), dim))
    features = np.concatenate([rng.normal(centres[i], spread, (n, dim)) for i, n in enumerate(sizes)])
    return features.astype(np.float32), np.repeat(np.arange(len(sizes)), sizes)


def config(**overrides) -> ClusterSamplingConfig:
    # These tests were written against the paper's settings (the defaults before the recommended preset).
    base = {"enabled": True, "allocation": "stratified", "seed": 7, "kmeans_n_init": 2, "num_clusters": "auto",
            "budget_mode": "min", "selection": "peripheral", "capacity_factor": 1.5, "weighting": "cluster",
            "loss_reduction": "sample"}
    base.update(overrides)
    return ClusterSamplingConfig.from_dict(base)


# ----------------------------------------------------------------- budgets
def test_min_budget_keeps_floor_r_times_smallest_cluster():
    kept = cluster_budgets(np.array([100, 37, 12, 60]), "min", 0.75)
    assert kept.tolist() == [9, 9, 9, 9]  # floor(0.75 * 12)


def test_equal_budget_fills_smallest_first():
    # S = 60 over sizes 5, 10, 50, 100: 5 and 10 keep all, 45 left for two clusters.
    kept = cluster_budgets(np.array([100, 5, 50, 10]), "equal", 1.0, budget_samples=60)
    assert kept.tolist() == [23, 5, 22, 10]


def test_proportional_budget_keeps_r_times_each_cluster():
    assert cluster_budgets(np.array([600, 300, 100]), "proportional", 0.5).tolist() == [300, 150, 50]
    # r = 0.5 over 1000/300/25/60/40 (S = 712): 500, 150, 12.5, 30, 20; the half goes down, not every cluster.
    sizes = np.array([1000, 300, 25, 60, 40])
    kept = cluster_budgets(sizes, "proportional", 0.5)
    assert kept.tolist() == [500, 150, 12, 30, 20]
    # A cluster whose share is below one keeps one.
    assert cluster_budgets(np.array([1000, 3]), "proportional", 0.1).tolist() == [99, 1]  # S = 100


@given(sizes=st.lists(st.integers(1, 500), min_size=1, max_size=12), ratio=st.floats(0.01, 1.0))
@settings(max_examples=200, deadline=None)
def test_proportional_budget_is_within_one_of_r_times_size(sizes, ratio):
    sizes = np.array(sizes)
    if round(ratio * sizes.sum()) < sizes.size:
        return  # a budget smaller than the number of clusters is refused (tested elsewhere)
    kept = cluster_budgets(sizes, "proportional", ratio)
    share = round(ratio * sizes.sum()) * sizes / sizes.sum()
    assert (kept >= 1).all() and (kept <= sizes).all()
    assert (np.abs(kept - share) < 1 + 1e-9).all()


def test_neyman_budget_follows_size_times_spread():
    sizes = np.array([100, 100, 100])
    kept = cluster_budgets(sizes, "neyman", 1.0, budget_samples=63, cluster_spreads=np.array([1.0, 2.0, 4.0]))
    assert kept.sum() == 63
    assert kept.tolist() == [1 + 9, 1 + 17, 1 + 34]  # 60 shared 1:2:4


def test_neyman_caps_at_cluster_size():
    kept = cluster_budgets(np.array([10, 1000]), "neyman", 1.0, budget_samples=500,
                           cluster_spreads=np.array([100.0, 1.0]))
    assert kept.tolist() == [10, 490]


def test_apportion_respects_caps_and_total():
    result = apportion(10, np.array([5.0, 1.0, 1.0]), np.array([3, 10, 10]))
    assert result.tolist() == [3, 4, 3] or result.tolist() == [3, 3, 4]
    assert result.sum() == 10


def test_budget_leaving_a_cluster_empty_is_an_error():
    with pytest.raises(ValueError, match="no sample"):
        cluster_budgets(np.array([100, 3]), "min", 0.2)
    with pytest.raises(ValueError, match="no sample"):
        cluster_budgets(np.array([100, 3, 5]), "proportional", 1.0, budget_samples=2)


# --------------------------------------------------------------- selection
def test_peripheral_core_and_norm_keep_what_their_names_say():
    labels = np.array([0, 0, 0, 0, 1, 1, 1])
    distances = np.array([0.1, 0.9, 0.5, 0.7, 3.0, 1.0, 2.0])
    norms = np.array([5.0, 1.0, 2.0, 9.0, 0.5, 0.7, 0.6])
    kept = np.array([2, 1])
    assert select_in_clusters(labels, kept, "peripheral", SelectionInputs(distances=distances)).tolist() == [1, 3, 4]
    assert select_in_clusters(labels, kept, "core", SelectionInputs(distances=distances)).tolist() == [0, 2, 5]
    assert select_in_clusters(labels, kept, "norm", SelectionInputs(norms=norms)).tolist() == [0, 3, 5]
    mixed = select_in_clusters(labels, np.array([3, 1]), "mix", SelectionInputs(distances=distances))
    assert mixed.tolist() == [0, 1, 3, 4]
    random_pick = select_in_clusters(labels, kept, "random", SelectionInputs(seed=3))
    assert len(random_pick) == 3 and (np.bincount(labels[random_pick]) == kept).all()


def test_spread_takes_every_quantile_of_the_distance():
    labels = np.zeros(10, dtype=np.int64)
    distances = np.arange(10, dtype=np.float64)[::-1]  # sample 9 is the most central, sample 0 the farthest
    # Ordered by distance: 9, 8, ..., 0; the middles of 5 slices of 2 are positions 1, 3, 5, 7, 9.
    spread = select_in_clusters(labels, np.array([5]), "spread", SelectionInputs(distances=distances))
    assert spread.tolist() == [0, 2, 4, 6, 8]
    assert select_in_clusters(labels, np.array([1]), "spread", SelectionInputs(distances=distances)).tolist() == [4]


def test_kcenter_covers_the_cluster_greedily_from_its_centre():
    # Points on a line; the centre is at 0. First the central point, then the farthest from it, then the
    # farthest from both: 0, then 10, then -6 (distance 6 from 0 beats 5 from 0 or 10).
    points = np.array([[0.0], [10.0], [-6.0], [5.0], [1.0]], dtype=np.float32)
    labels = np.zeros(5, dtype=np.int64)
    distances = np.abs(points[:, 0]).astype(np.float64)
    chosen = select_in_clusters(labels, np.array([3]), "kcenter", SelectionInputs(distances=distances, features=points))
    assert chosen.tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="'kcenter' needs the features"):
        select_in_clusters(labels, np.array([3]), "kcenter", SelectionInputs(distances=distances))


def test_peripheral_plan_keeps_farthest_from_centroid():
    features, _ = blobs([80, 40, 30])
    plan = plan_of(features, config(num_clusters=3, budget_ratio=0.5, capacity_factor=None),
                      world_size=1, micro_batch_size=1, gradient_accumulation_steps=1)
    for cluster in range(3):
        members = np.flatnonzero(plan.labels == cluster)
        kept = np.intersect1d(members, plan.selected)
        dropped = np.setdiff1d(members, plan.selected)
        dist = np.linalg.norm(features - plan.centroids[cluster], axis=1)  # k-means' own centre
        assert dist[kept].min() >= dist[dropped].max() - 1e-5


# --------------------------------------------------------------- capacity
def test_capacity_cap_bounds_every_cluster():
    features, _ = blobs([500, 30, 30, 20], seed=1, spread=8.0)
    result = cluster_features(features, num_clusters=4, n_init=2, capacity_factor=1.2, seed=0)
    cap = math.ceil(1.2 * 580 / 4)
    assert np.bincount(result.labels, minlength=4).max() <= cap
    assert result.labels.shape == (580,)


# ----------------------------------------------------------------- weights
def test_weights_keep_the_full_distribution():
    features, _ = blobs([300, 120, 50, 30])
    plan = plan_of(features, config(num_clusters=4, budget_ratio=0.8, capacity_factor=None),
                      world_size=2, micro_batch_size=2, gradient_accumulation_steps=1)
    total = plan.weights.sum()
    for cluster in range(4):
        share = plan.weights[plan.selected][plan.labels[plan.selected] == cluster].sum() / total
        assert abs(share - plan.cluster_sizes[cluster] / plan.num_samples) < 1e-9
    assert abs(plan.weights[plan.selected].mean() - 1.0) < 1e-12
    not_kept = np.setdiff1d(np.arange(plan.num_samples), plan.selected)
    assert (plan.weights[not_kept] == 0).all()


def test_weighting_none_gives_unit_weights():
    features, _ = blobs([60, 20])
    plan = plan_of(features, config(num_clusters=2, weighting="none"), world_size=1,
                      micro_batch_size=2, gradient_accumulation_steps=1)
    assert (plan.weights[plan.selected] == 1.0).all()


def test_paper_weight_per_rank_is_k_n_r_over_n():
    features, _ = blobs([90, 50, 30])
    cfg = ClusterSamplingConfig.from_dict({"enabled": True, "preset": "paper", "kmeans_n_init": 2,
                                           "capacity_factor": None})
    plan = plan_of(features, cfg, world_size=3, micro_batch_size=2, gradient_accumulation_steps=2)
    schedule = plan.epoch_layout(0)
    for rank in range(3):
        indices = schedule[:, rank].ravel()
        assert (plan.labels[indices] == rank).all()
        expected = 3 * plan.cluster_sizes[rank] / plan.num_samples
        assert np.allclose(plan.weights[indices], expected, rtol=0, atol=1e-12)


def test_weights_by_hand():
    labels = np.array([0, 0, 0, 1])
    weights = sample_weights(labels, np.array([0, 3]), np.array([3, 1]), np.array([1, 1]), "cluster")
    # cluster 0: (3/4)/(1/2) = 1.5, cluster 1: (1/4)/(1/2) = 0.5
    assert weights.tolist() == [1.5, 0.0, 0.0, 0.5]


# ---------------------------------------------------------------- schedule
def test_schedule_by_hand_stratified():
    # Two categories 6 and 2, everything kept, one rank, micro 2, gas 2: B = 4, S = 8 -> 2 steps,
    # each step holds 3 of category 0 and 1 of category 1.
    labels = np.array([0, 0, 0, 1, 0, 0, 0, 1])
    plan = plan_of(None, config(selection="random", budget_mode="proportional"), world_size=1, micro_batch_size=2,
                      gradient_accumulation_steps=2, labels=labels)
    schedule = plan.epoch_layout(0)
    assert schedule.shape == (2, 1, 2, 2)
    for step in schedule:
        assert sorted(labels[step.ravel()].tolist()) == [0, 0, 0, 1]
    assert sorted(schedule.ravel().tolist()) == list(range(8))


def test_cluster_per_rank_rank_sees_only_its_cluster_and_epochs_differ_in_order():
    features, _ = blobs([40, 40])
    cfg = ClusterSamplingConfig.from_dict({"enabled": True, "preset": "paper", "kmeans_n_init": 2, "seed": 3})
    plan = plan_of(features, cfg, world_size=2, micro_batch_size=4, gradient_accumulation_steps=1)
    first, second = plan.epoch_layout(0), plan.epoch_layout(1)
    for rank in range(2):
        assert (plan.labels[first[:, rank].ravel()] == rank).all()
    assert sorted(first.ravel().tolist()) == sorted(second.ravel().tolist())
    assert not np.array_equal(first, second)


def test_stratified_epochs_same_content_when_batches_divide():
    labels = np.repeat(np.arange(4), [40, 20, 12, 8])
    plan = plan_of(None, config(selection="random", budget_mode="proportional"), world_size=2, micro_batch_size=2,
                      gradient_accumulation_steps=2, labels=labels)
    assert plan.num_kept % plan.global_batch_size == 0
    first, second = plan.epoch_layout(0), plan.epoch_layout(1)
    assert sorted(first.ravel().tolist()) == sorted(second.ravel().tolist())
    assert not np.array_equal(first, second)


def test_stratified_tail_differs_between_epochs():
    labels = np.repeat(np.arange(3), [50, 23, 10])  # 83 kept, B = 8: 10 steps, 3 dropped
    plan = plan_of(None, config(selection="random", budget_mode="proportional"), world_size=2, micro_batch_size=2,
                      gradient_accumulation_steps=2, labels=labels)
    used = [set(plan.epoch_layout(epoch).ravel().tolist()) for epoch in range(4)]
    assert all(len(u) == 80 for u in used)
    assert len({frozenset(u) for u in used}) > 1


# ------------------------------------------------------------- properties
@st.composite
def plan_inputs(draw):
    num_clusters = draw(st.integers(1, 6))
    sizes = [draw(st.integers(1, 60)) for _ in range(num_clusters)]
    sizes[0] += draw(st.integers(0, 300))  # skew
    world = draw(st.integers(1, 4))
    micro = draw(st.integers(1, 3))
    gas = draw(st.integers(1, 3))
    ratio = draw(st.floats(0.05, 1.0))
    mode = draw(st.sampled_from(["min", "proportional", "equal", "neyman"]))
    selection = draw(st.sampled_from(["peripheral", "core", "random", "mix", "norm"]))
    seed = draw(st.integers(0, 2**16))
    return sizes, world, micro, gas, ratio, mode, selection, seed


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan_inputs())
def test_plan_properties(inputs):
    sizes, world, micro, gas, ratio, mode, selection, seed = inputs
    features, categories = blobs(sizes, seed=seed % 97)
    cfg = config(budget_mode=mode, budget_ratio=ratio, selection=selection, seed=seed)
    try:
        plan = plan_of(features, cfg, world_size=world, micro_batch_size=micro,
                          gradient_accumulation_steps=gas, labels=categories)
    except ValueError as err:
        assert "no sample" in str(err) or "smaller than one global batch" in str(err)
        return
    n = plan.num_samples
    assert plan.selected.dtype == np.int64 and np.all(np.diff(plan.selected) > 0)
    assert 0 <= plan.selected.min() and plan.selected.max() < n
    assert (np.bincount(plan.labels[plan.selected], minlength=plan.num_clusters) == plan.kept_sizes).all()
    assert (plan.kept_sizes >= 1).all() and (plan.kept_sizes <= plan.cluster_sizes).all()
    if mode == "min":
        assert (plan.kept_sizes == math.floor(ratio * plan.cluster_sizes.min() + 1e-9)).all()
    kept_w = plan.weights[plan.selected]
    assert abs(kept_w.mean() - 1.0) < 1e-9
    for cluster in range(plan.num_clusters):
        share = kept_w[plan.labels[plan.selected] == cluster].sum() / kept_w.sum()
        assert abs(share - plan.cluster_sizes[cluster] / n) < 1e-9

    schedule = plan.epoch_layout(seed % 5)
    batch = world * micro * gas
    assert schedule.shape == (plan.num_kept // batch, world, gas, micro)
    flat = schedule.ravel()
    assert len(np.unique(flat)) == flat.size  # no sample twice in an epoch
    assert np.isin(flat, plan.selected).all()
    expected = batch * plan.kept_sizes / plan.num_kept
    for step in schedule:
        counts = np.bincount(plan.labels[step.ravel()], minlength=plan.num_clusters)
        assert (np.abs(counts - expected) < 1.0 + 1e-9).all()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 200), min_size=1, max_size=10), st.integers(1, 64))
def test_quotas_rows_sum_to_batch_and_never_overdraw(kept, batch):
    kept_sizes = np.array(kept)
    if kept_sizes.sum() < batch:
        return
    quotas = batch_quotas(kept_sizes, batch)
    assert quotas.shape == (kept_sizes.sum() // batch, len(kept))
    assert (quotas.sum(axis=1) == batch).all()
    assert (quotas.sum(axis=0) <= kept_sizes).all()
    share = batch * kept_sizes / kept_sizes.sum()
    assert (np.abs(quotas - share) < 1.0 + 1e-9).all()


# ------------------------------------------------------------- determinism
_DETERMINISM_SCRIPT = """
import json, sys, numpy as np
from ds_cluster import ClusterSamplingConfig
from tests.planning import plan_of
rng = np.random.default_rng(11)
features = np.concatenate([rng.normal(i * 5, 1, (n, 6)) for i, n in enumerate([200, 90, 40, 25])]).astype(np.float32)
cfg = ClusterSamplingConfig(enabled=True, num_clusters=4, budget_ratio=0.7, seed=int(sys.argv[1]))
plan = plan_of(features, cfg, world_size=2, micro_batch_size=3, gradient_accumulation_steps=2)
print(json.dumps({"fingerprint": plan.fingerprint(), "schedule": plan.epoch_layout(1).ravel().tolist()}))
"""


def _plan_in_subprocess(seed: int) -> dict:
    out = subprocess.run([sys.executable, "-c", _DETERMINISM_SCRIPT, str(seed)], capture_output=True, text=True,
                         check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_same_inputs_same_plan_in_two_processes_and_seed_changes_order():
    first, second, other_seed = _plan_in_subprocess(5), _plan_in_subprocess(5), _plan_in_subprocess(6)
    assert first == second
    assert first["schedule"] != other_seed["schedule"]


def test_save_and_load_round_trip(tmp_path):
    features, _ = blobs([50, 30])
    plan = plan_of(features, config(num_clusters=2), world_size=2, micro_batch_size=2, gradient_accumulation_steps=1)
    plan.save(tmp_path / "plan")
    loaded = Plan.load(tmp_path / "plan")
    assert loaded.fingerprint() == plan.fingerprint()
    assert np.array_equal(loaded.epoch_layout(3), plan.epoch_layout(3))
    np.save(tmp_path / "plan" / "weights.npy", plan.weights * 2)
    with pytest.raises(ValueError, match="fingerprint"):
        Plan.load(tmp_path / "plan")


# --------------------------------------------------------------- bad input
@pytest.mark.parametrize("features, labels, kwargs, message", [
    (np.zeros((0, 4)), None, {}, "empty"),
    (np.array([[1.0, np.nan], [0.0, 1.0]]), None, {}, "NaN or inf"),
    (np.array([[1.0, np.inf], [0.0, 1.0]]), None, {}, "NaN or inf"),
    (np.ones((3, 2)), None, {"num_clusters": 5}, "larger than the number of samples"),
    (np.ones((4, 2)), np.array([0, 1, 1]), {}, "labels has 3 entries"),
    (np.ones((4, 2)), np.array([0, -3, 1, 1]), {}, "must be >= 0"),
    (np.random.default_rng(0).normal(size=(40, 2)), None, {"num_clusters": 2, "budget_ratio": 0.01}, "no sample"),
    (np.random.default_rng(0).normal(size=(20, 2)), None, {"num_clusters": 2, "world": 4, "micro": 8},
     "smaller than one global batch"),
    (np.random.default_rng(0).normal(size=(40, 2)), None, {"num_clusters": 3, "allocation": "cluster_per_rank"},
     "num_clusters must equal the world size"),
    (np.ones((4, 2)), None, {"world": 0}, "world_size must be an integer >= 1"),
    (np.ones((4, 2)), None, {"micro": 0}, "micro_batch_size must be an integer >= 1"),
    (np.ones((4, 2)), None, {"gas": -1}, "gradient_accumulation_steps must be an integer >= 1"),
])
def test_bad_input_is_a_clear_value_error(features, labels, kwargs, message):
    world, micro, gas = kwargs.pop("world", 2), kwargs.pop("micro", 1), kwargs.pop("gas", 1)
    cfg = config(**kwargs)
    with pytest.raises(ValueError, match=message):
        plan_of(features, cfg, world_size=world, micro_batch_size=micro, gradient_accumulation_steps=gas,
                   labels=labels)


def test_defaults_are_the_recommended_preset():
    """A block without a preset gets the best setting measured (the recommended preset), not the paper's."""
    from ds_cluster.config import RECOMMENDED_PRESET

    bare = ClusterSamplingConfig.from_dict({"enabled": True}).model_dump()
    recommended = ClusterSamplingConfig.from_dict({"enabled": True, "preset": "recommended"}).model_dump()
    assert {key: bare[key] for key in RECOMMENDED_PRESET} == RECOMMENDED_PRESET
    assert {k: v for k, v in bare.items() if k != "preset"} == {k: v for k, v in recommended.items() if k != "preset"}


def test_config_errors_name_the_key(tmp_path):
    with pytest.raises(ValueError, match="did you mean 'budget_ratio'"):
        ClusterSamplingConfig.from_dict({"budget_ration": 0.5})
    with pytest.raises(ValueError, match="'budget_ratio'"):
        ClusterSamplingConfig.from_dict({"budget_ratio": 0.0})
    with pytest.raises(ValueError, match="'selection'"):
        ClusterSamplingConfig.from_dict({"selection": "edges"})
    with pytest.raises(FileNotFoundError, match="not found"):
        ClusterSamplingConfig.from_ds_config(tmp_path / "missing.json")
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match="broken.json: not valid JSON"):
        ClusterSamplingConfig.from_ds_config(broken)


def test_config_from_deepspeed_json_and_preset(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "data_efficiency": {"enabled": True, "data_sampling": {
        "enabled": True, "cluster_sampling": {"enabled": True, "preset": "paper", "budget_ratio": 0.5}}}}))
    cfg = ClusterSamplingConfig.from_ds_config(path)
    assert cfg.enabled and cfg.allocation == "cluster_per_rank" and cfg.budget_mode == "min"
    assert cfg.capacity_factor == 1.5 and cfg.kmeans_n_init == 10 and cfg.budget_ratio == 0.5
    assert not ClusterSamplingConfig.from_ds_config({"train_batch_size": 8}).enabled


def _literal_capped_greedy(nearest, dist2, capacity, num_clusters):
    """The paper's rule read literally: pairs by increasing distance, first centre with room."""
    pairs = sorted((dist2[p, j], p, j) for p in range(nearest.shape[0]) for j in range(nearest.shape[1]))
    labels, room = [-1] * nearest.shape[0], [capacity] * num_clusters
    for _, point, j in pairs:
        centre = nearest[point, j]
        if labels[point] < 0 and room[centre] > 0:
            labels[point], room[centre] = centre, room[centre] - 1
    return labels


@settings(max_examples=80, deadline=None)
@given(st.integers(2, 6), st.integers(1, 4), st.integers(0, 10_000), st.floats(1.0, 2.0))
def test_capped_assignment_matches_the_literal_greedy(num_clusters, neighbours, seed, alpha):
    from ds_cluster.clustering.kmeans import capped_assignment, nearest_centroids

    rng = np.random.default_rng(seed)
    points = np.concatenate([rng.normal(0, 1, (30, 2)), rng.normal(4, 1, (5, 2))])
    centroids = rng.normal(0, 2, (num_clusters, 2))
    count = min(neighbours, num_clusters)
    nearest, dist2 = nearest_centroids(points, centroids, count)
    capacity = math.ceil(alpha * len(points) / num_clusters)
    labels = capped_assignment(points, centroids, nearest, dist2, capacity)
    assert np.bincount(labels, minlength=num_clusters).max() <= capacity
    literal = _literal_capped_greedy(nearest, dist2, capacity, num_clusters)
    placed = np.array(literal) >= 0
    assert np.array_equal(labels[placed], np.array(literal)[placed])


def test_left_out_samples_get_no_weight_and_no_slot():
    # -1 labels (no response tokens, as `ds-cluster analyze` writes them) and an explicit exclude mask.
    labels = np.array([0, 0, -1, 1, 1, 0, 1, 0])
    exclude = np.zeros(8, dtype=bool)
    exclude[5] = True
    plan = plan_of(None, config(selection="random", budget_mode="proportional"), world_size=1,
                      micro_batch_size=1, gradient_accumulation_steps=1, labels=labels, exclude=exclude)
    assert plan.labels[2] == -1 and plan.labels[5] == -1
    assert plan.weights[2] == 0 and plan.weights[5] == 0
    assert 2 not in plan.epoch_layout(0) and 5 not in plan.epoch_layout(0)
    assert plan.cluster_sizes.tolist() == [3, 3] and plan.summary()["num_excluded"] == 2


@given(world=st.integers(1, 5), micro=st.integers(1, 4), accumulation=st.integers(1, 3),
       clusters=st.integers(1, 6), ratio=st.floats(0.3, 1.0), seed=st.integers(0, 3), epoch=st.integers(0, 2),
       per_rank=st.booleans())
@settings(max_examples=150, deadline=None)
def test_each_rank_builds_exactly_its_part_of_the_schedule(world, micro, accumulation, clusters, ratio, seed, epoch,
                                                          per_rank):
    """rank_layout(e, r) (built alone, O(N / W)) is the whole schedule's slice for rank r."""
    num_clusters = world if per_rank else clusters
    labels = np.random.default_rng(seed).integers(0, num_clusters, 400)
    labels[:num_clusters] = np.arange(num_clusters)  # no cluster empty
    block = ({"preset": "paper", "budget_ratio": ratio, "num_clusters": num_clusters} if per_rank else
             {"num_clusters": num_clusters, "budget_mode": "proportional", "budget_ratio": ratio,
              "selection": "random", "allocation": "stratified"})
    try:
        plan = plan_of(None, ClusterSamplingConfig(enabled=True, seed=seed, **{**block, "selection": "random"}),
                          world_size=world, micro_batch_size=micro, gradient_accumulation_steps=accumulation,
                          labels=labels)
    except ValueError:
        return  # too little data for one step: refused (tested elsewhere)
    whole = plan.epoch_layout(epoch)
    for rank in range(world):
        assert np.array_equal(plan.rank_layout(epoch, rank), whole[:, rank])


def test_neyman_that_keeps_everything_needs_no_spreads():
    """A labels-only analysis at budget_ratio 1 (the default) keeps every sample under the default neyman budget."""
    sizes = np.array([7, 3, 12])
    assert cluster_budgets(sizes, "neyman", 1.0).tolist() == [7, 3, 12]
    with pytest.raises(ValueError, match="neyman' needs features"):
        cluster_budgets(sizes, "neyman", 0.5)
