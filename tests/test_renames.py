"""0.5.0's public names (docs/changes.md, 0.6.0): each still works, warning with its replacement, or fails with a
message naming it."""
from __future__ import annotations

import importlib
import sys
import warnings

import numpy as np
import pytest
import torch

from ds_cluster import ClusterSamplingConfig, build_plan
from tests.planning import plan_of
from ds_cluster.loader.sampler import ClusterDataLoader

LABELS = np.repeat(np.arange(3), [20, 12, 8])


def _config(**keys) -> ClusterSamplingConfig:
    return ClusterSamplingConfig.from_dict({"enabled": True, "num_clusters": 3, "budget_mode": "proportional",
                                            "budget_ratio": 0.5, "selection": "random", "loss_reduction": "sample",
                                            **keys})


def _plan(config: ClusterSamplingConfig):
    return plan_of(None, config, world_size=1, micro_batch_size=2, gradient_accumulation_steps=1, labels=LABELS)


def _data() -> list[dict]:
    return [{"input_ids": torch.zeros(4, dtype=torch.int64), "labels": torch.zeros(4, dtype=torch.int64)}
            for _ in LABELS]


def test_renamed_plan_methods_warn_and_give_the_same_layout():
    plan = _plan(_config())
    with pytest.warns(DeprecationWarning, match="epoch_layout"):
        assert np.array_equal(plan.schedule(1), plan.epoch_layout(1))
    with pytest.warns(DeprecationWarning, match="rank_layout"):
        assert np.array_equal(plan.rank_schedule(1, 0), plan.rank_layout(1, 0))


def test_the_old_module_of_the_adaptive_arithmetic_still_imports():
    sys.modules.pop("ds_cluster.planning.schedule", None)
    with pytest.warns(DeprecationWarning, match="ds_cluster.planning.shares"):
        old = importlib.import_module("ds_cluster.planning.schedule")
    from ds_cluster.planning import shares

    assert old.ADAPTIVE_RULES is shares.ADAPTIVE_RULES and old.window_draws is shares.window_draws


def test_the_old_adaptive_loader_builds_the_one_loader_with_an_adaptive_schedule(tmp_path):
    from ds_cluster.collectives import LOCAL
    from ds_cluster.loader.adaptive import AdaptiveDataLoader, AdaptiveSchedule, AdaptiveSettings

    config = _config(schedule="adaptive", adapt_every=2, probe_size=0, analysis_path=str(tmp_path / "analysis"))
    with pytest.warns(DeprecationWarning, match="config.stages"):
        settings = AdaptiveSettings.from_config(config)
    assert settings == config.stages().schedule
    with pytest.warns(DeprecationWarning, match="ClusterDataLoader"):
        loader = AdaptiveDataLoader(_data(), _plan(config), 0, settings, collectives=LOCAL)
    assert type(loader) is ClusterDataLoader and isinstance(loader.schedule, AdaptiveSchedule)


def test_removed_loader_methods_name_their_replacement():
    loader = ClusterDataLoader(_data(), _plan(_config()), 0)
    for old, new in (("prepare_epoch", "prepare_iteration"), ("rank_schedule", "rank_layout"),
                     ("epoch_batches", "trainer_batches"), ("probe", "loader.schedule.probe")):
        with pytest.raises(AttributeError, match=new.replace(".", r"\.")):
            getattr(loader, old)


def test_a_loader_given_only_a_sum_over_ranks_still_normalises_tokens_over_the_ranks():
    plan = plan_of(None, _config(loss_reduction="token"), world_size=2, micro_batch_size=2,
                      gradient_accumulation_steps=1, labels=LABELS)
    data = [{"input_ids": torch.zeros(4, dtype=torch.int64), "labels": torch.tensor([0, 1, 1, 1])} for _ in LABELS]
    loader = ClusterDataLoader(data, plan, 0, sum_over_ranks=lambda counts: counts * 2)  # as if rank 1 had as many
    batch = next(iter(loader))
    # 3 response tokens a sample, 2 samples a rank, 2 ranks: 12 tokens over (2 ranks x 1 accumulation step).
    assert batch["loss_normalizer"].tolist() == [6.0, 6.0]


def test_old_readings_of_the_block_give_the_stages_values():
    from ds_cluster.clustering.kmeans import cluster_by_config, cluster_with, kmeans_settings

    config = _config(kmeans_n_init=2)
    stages = config.stages()
    assert config.plan_settings() == stages.plan_record()
    assert config.planned_ratio == stages.selection.planned_ratio == 0.5
    assert config.resolved_num_clusters(2) == 3 and kmeans_settings(config, 2) == stages.clustering.kmeans_arguments(2)
    points = np.random.default_rng(0).normal(size=(30, 4)).astype(np.float32)
    assert np.array_equal(cluster_by_config(points, config, 1).labels,
                          cluster_with(points, stages.clustering, 1).labels)


def test_old_names_of_the_learning_rate_schedule_the_figures_and_the_feature_engine():
    from ds_cluster.features import feature_model
    from ds_cluster.loader.figures import ClusterFigures
    from ds_cluster.loader.lr_schedules import run_lr_schedule, run_schedule

    with pytest.warns(DeprecationWarning, match="run_lr_schedule"):
        old = run_schedule({"schedule": "static"}, lambda: 100, 0.05, lambda: None)
    new = run_lr_schedule(lambda: 100, 0.05, lambda: None)
    assert [old(step) for step in (0, 10, 90)] == [new(step) for step in (0, 10, 90)]
    with pytest.warns(DeprecationWarning, match="ClusterTally"):
        figures = ClusterFigures(np.array([0, 1, 1]), 2)
    figures.add(np.array([0, 2]), np.array([1.0, 3.0]))
    assert figures.report(lambda values: values) == {"train_loss": [1.0, 3.0], "samples": [1, 1]}
    with pytest.raises(AttributeError, match="feature_source"):
        feature_model.feature_engine  # noqa: B018
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ClusterFigures(figures.tally)  # the 0.6.0 form: no warning


def test_the_0_6_0_call_of_build_plan_warns_and_clusters_first_as_it_did():
    from ds_cluster import BatchShape, PlanInputs, cluster_samples

    config = _config(num_clusters=3, budget_mode="neyman", selection="peripheral")
    features = np.random.default_rng(0).normal(size=(40, 3)).astype(np.float32)
    with pytest.warns(DeprecationWarning, match="cluster_samples"):
        old = build_plan(features, config, world_size=2, micro_batch_size=2, gradient_accumulation_steps=1)
    clusters = cluster_samples(PlanInputs(features, None, None), config.stages().clustering, 2)
    assert old.fingerprint() == build_plan(clusters, config, BatchShape(2, 2, 1)).fingerprint()


def test_the_loaders_analysis_timings_name_their_replacement():
    loader = ClusterDataLoader(_data(), _plan(_config()), 0)
    with pytest.raises(AttributeError, match=r"loader\.analysis"):
        loader.analysis_timings  # noqa: B018


@pytest.mark.parametrize("case", ["static", "adaptive_auto"])
def test_a_0_6_0_sampler_state_resumes_the_sequence_0_6_0_trained(case):
    """States 0.6.0 wrote mid-run (tests/fixtures/sampler_states_0.6.0.json, made with that release's code): the
    plan's fingerprint is the same, and the resumed run continues the micro-batches 0.6.0 trained uninterrupted."""
    import json
    from pathlib import Path

    from ds_cluster.loader.adaptive import AdaptiveSchedule

    saved = json.loads((Path(__file__).parent / "fixtures" / "sampler_states_0.6.0.json").read_text())[case]
    config = ClusterSamplingConfig.from_dict(saved["block"])
    stages = config.stages()
    labels = np.repeat(np.arange(3), (60, 30, 10))
    plan = plan_of(None, config, world_size=1, micro_batch_size=4, gradient_accumulation_steps=2, labels=labels)
    schedule = AdaptiveSchedule(plan, 0, stages.schedule) if stages.schedule.adaptive else None
    data = [{"input_ids": torch.full((6,), i % 50), "attention_mask": torch.ones(6, dtype=torch.int64),
             "labels": torch.full((6,), i % 50)} for i in range(len(labels))]
    loader = ClusterDataLoader(data, plan, 0, schedule=schedule, loss=stages.loss)
    loader.load_state_dict(saved["state"])
    resumed = []
    while len(resumed) < len(saved["micro_batches"]) - saved["taken"] and loader.completed_epochs < 50:
        for batch in loader:
            indices = batch["sample_index"]
            loader.record_losses(indices, torch.tensor([(2.0, 1.0, 0.5)[labels[i]] for i in indices.tolist()]))
            resumed.append(indices.tolist())
            if len(resumed) == len(saved["micro_batches"]) - saved["taken"]:
                break
    assert resumed == saved["micro_batches"][saved["taken"]:]
