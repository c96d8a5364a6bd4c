"""Fuzzing the config parser and the planner: valid input gives a sound plan, invalid input a ValueError, nothing else.

Hypothesis draws cluster_sampling blocks (right keys, misspelled keys, values of
every JSON type) and planner inputs (sizes, batch shapes, features with NaN,
labels, excluded samples). Any exception other than ValueError is a bug: a user
would get a traceback from deep inside numpy or pydantic instead of a message.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds_cluster.config import ClusterSamplingConfig
from ds_cluster.planning.plan import Plan
from tests.planning import plan_of

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

FIELDS = sorted(ClusterSamplingConfig.model_fields)

# Any JSON value: what a hand-edited DeepSpeed config can hold.
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 50), st.floats(allow_nan=True, allow_infinity=True),
                         st.sampled_from(["auto", "paper", "min", "proportional", "equal", "neyman", "peripheral",
                                          "core", "random", "mix", "norm", "sklearn", "faiss", "stratified",
                                          "cluster_per_rank", "cluster", "none", "proxy", "lm_head", "layers", ""]))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=5)
near_keys = st.sampled_from(FIELDS).flatmap(
    lambda key: st.sampled_from([key, key[:-1], key + "s", key.upper(), key.replace("_", "")]))
blocks = st.dictionaries(st.one_of(near_keys, st.text(max_size=12)), json_values, max_size=6)


@FUZZ
@given(block=blocks)
def test_config_parser_gives_a_config_or_a_value_error(block: dict):
    try:
        config = ClusterSamplingConfig.from_dict(block)
    except ValueError as err:
        message = str(err)
        assert message.startswith("cluster_sampling: ") and len(message) < 4000, message
        return
    assert set(block) <= set(FIELDS)
    # What parsed once parses again to the same thing (a config round-trips through its dict).
    assert ClusterSamplingConfig.from_dict(config.model_dump()) == config


# Valid settings; one in five examples then gets one value broken (checked to be a ValueError).
planner_settings = st.fixed_dictionaries({
    "num_clusters": st.one_of(st.just("auto"), st.integers(1, 8)),
    "budget_mode": st.sampled_from(["min", "proportional", "equal", "neyman"]),
    "budget_ratio": st.floats(0.05, 1.0),
    "budget_samples": st.one_of(st.none(), st.integers(1, 80)),
    "selection": st.sampled_from(["peripheral", "core", "random", "mix", "norm"]),
    "capacity_factor": st.one_of(st.none(), st.floats(1.0, 3.0)),
    "allocation": st.sampled_from(["stratified", "stratified", "stratified", "cluster_per_rank"]),
    "weighting": st.sampled_from(["cluster", "none"]),
    "seed": st.integers(0, 10_000),
})
BROKEN_VALUES = [("budget_ratio", 0.0), ("budget_ratio", 1.2), ("num_clusters", 0), ("capacity_factor", 0.5),
                 ("seed", -1), ("budget_samples", 0), ("selection", "edge"), ("budget_mode", None)]
broken_settings = st.tuples(planner_settings, st.integers(0, 4), st.sampled_from(BROKEN_VALUES)).map(
    lambda drawn: {**drawn[0], drawn[2][0]: drawn[2][1]} if drawn[1] == 0 else drawn[0])


@st.composite
def planner_inputs(draw: Any) -> dict[str, Any]:
    num_samples = draw(st.integers(0, 60))
    dim = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    groups = draw(st.integers(1, 5))
    features: Optional[np.ndarray] = (rng.normal(0, 1, (groups, dim))[rng.integers(0, groups, num_samples)]
                                      + rng.normal(0, 0.2, (num_samples, dim))).astype(np.float32)
    if num_samples and draw(st.integers(0, 9)) == 0:
        features[draw(st.integers(0, num_samples - 1)), 0] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    labels = None
    if draw(st.booleans()):
        labels = rng.integers(-1 if draw(st.booleans()) else 0, groups, num_samples).astype(np.int64)
        if draw(st.booleans()):
            features = None  # labels alone: no geometry
    exclude = None
    if num_samples and draw(st.booleans()):
        exclude = rng.random(num_samples) < 0.15
    return {"features": features, "labels": labels, "exclude": exclude,
            "world_size": draw(st.integers(1, 3)), "micro_batch_size": draw(st.integers(1, 3)),
            "gradient_accumulation_steps": draw(st.integers(1, 2))}


def check_plan_properties(plan: Plan, inputs: dict[str, Any], config: ClusterSamplingConfig) -> None:
    """What every plan must satisfy, whatever the settings."""
    num_samples = plan.num_samples
    included = np.ones(num_samples, dtype=bool)
    if inputs["exclude"] is not None:
        included &= ~inputs["exclude"]
    if inputs["labels"] is not None:
        included &= inputs["labels"] >= 0
    selected = plan.selected
    # Unique, sorted indices of included samples only.
    assert np.array_equal(selected, np.unique(selected)) and included[selected].all()
    assert (plan.labels[~included] == -1).all() and (plan.labels[included] >= 0).all()
    # Kept counts: what the selection holds per cluster, at least one and at most the cluster's size.
    kept = np.bincount(plan.labels[selected], minlength=plan.num_clusters)
    assert np.array_equal(kept, plan.kept_sizes) and (kept >= 1).all() and (kept <= plan.cluster_sizes).all()
    assert plan.cluster_sizes.sum() == included.sum()
    # Weights: 0 off the selection; with cluster weighting, cluster c's share of the weight is n_c / N.
    assert (plan.weights[np.setdiff1d(np.arange(num_samples), selected)] == 0).all()
    if config.weighting == "cluster":
        shares = np.bincount(plan.labels[selected], weights=plan.weights[selected], minlength=plan.num_clusters)
        np.testing.assert_allclose(shares / plan.num_kept, plan.cluster_sizes / included.sum(), rtol=1e-9)
    else:
        assert (plan.weights[selected] == 1).all()
    # Schedule: (steps, world, gas, micro), only kept samples, none twice in an epoch.
    schedule = plan.epoch_layout(0)
    assert schedule.shape == (plan.steps_per_epoch, inputs["world_size"], inputs["gradient_accumulation_steps"],
                              inputs["micro_batch_size"])
    flat = schedule.reshape(-1)
    assert np.isin(flat, selected).all() and np.unique(flat).size == flat.size
    if plan.allocation == "stratified":
        assert (plan.quotas().sum(axis=1) == plan.global_batch_size).all()
    else:
        for rank in range(plan.world_size):  # the paper's allocation: rank r trains cluster r only
            assert (plan.labels[schedule[:, rank]] == rank).all()


@FUZZ
@given(setting=broken_settings, inputs=planner_inputs())
def test_planner_gives_a_sound_plan_or_a_value_error(setting: dict, inputs: dict):
    try:
        config = ClusterSamplingConfig.from_dict({"enabled": True, "kmeans_n_init": 1, "kmeans_max_iter": 20,
                                                  **setting})
        plan = plan_of(inputs["features"], config, world_size=inputs["world_size"],
                          micro_batch_size=inputs["micro_batch_size"],
                          gradient_accumulation_steps=inputs["gradient_accumulation_steps"],
                          labels=inputs["labels"], exclude=inputs["exclude"])
    except ValueError as err:
        assert str(err), "a ValueError without a message"
        return
    check_plan_properties(plan, inputs, config)
