"""The warm-up + cosine learning-rate factor whose length is read when training starts."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ds_cluster.loader.lr_schedules import run_lr_schedule, warmup_cosine, warmup_stable_decay


def test_warmup_then_cosine_to_zero_at_the_last_step():
    factor = warmup_cosine(lambda: 100, 0.05)
    assert [factor(step) for step in range(5)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    after = [factor(step) for step in range(5, 101)]
    assert after[0] == pytest.approx(1.0) and after[-1] == pytest.approx(0.0, abs=1e-12)
    assert all(a >= b for a, b in zip(after, after[1:]))
    assert factor(52) == pytest.approx(0.5, abs=0.02)  # half-way through the cosine


def test_the_length_is_read_at_every_call():
    steps = {"total": 0}
    factor = warmup_cosine(lambda: steps["total"], 0.1)
    assert factor(0) == 1.0  # before the run's length is known: one warm-up step
    steps["total"] = 20
    assert factor(0) == pytest.approx(0.5) and factor(20) == pytest.approx(0.0, abs=1e-12)


def test_warmup_stable_decay_holds_until_the_run_announces_its_end_then_decays_to_zero():
    announced = {"cooldown": None}
    factor = warmup_stable_decay(lambda: 100, 0.1, 0.2, lambda: announced["cooldown"])
    assert [factor(step) for step in (0, 9)] == [pytest.approx(0.1), 1.0]
    assert factor(50) == 1.0  # no end known yet: constant
    announced["cooldown"] = (40, 60)
    assert factor(40) == 1.0 and factor(50) == pytest.approx(0.5) and factor(60) == 0.0
    announced["cooldown"] = None
    # A run that reaches its cap decays over the last 20% of it.
    assert factor(80) == 1.0 and factor(90) == pytest.approx(0.5) and factor(100) == 0.0


def test_a_runs_lr_schedule_is_cosine_unless_its_loader_may_end_the_run_with_a_cool_down():
    from ds_cluster.loader.schedule import RunEnd

    class Loader:
        def __init__(self, run_end):
            self.end = run_end

        def run_end(self):
            return self.end

    cosine = warmup_cosine(lambda: 100, 0.05)
    for loader in (Loader(None), None):  # a static or fixed-budget schedule; no loader yet
        factor = run_lr_schedule(lambda: 100, 0.05, lambda loader=loader: loader)
        assert [factor(step) for step in (0, 3, 50, 90)] == [cosine(step) for step in (0, 3, 50, 90)]
    made = {"loader": Loader(RunEnd(0.2, (40, 60)))}  # an auto budget with auto_cooldown 0.2 (its default)
    factor = run_lr_schedule(lambda: 100, 0.05, lambda: made["loader"])
    assert factor(0) == cosine(0)  # the warm-up's first step, the same for both
    assert factor(50) == pytest.approx(0.5) and factor(60) == 0.0  # linear to 0 over the announced cool-down
    made["loader"].end = RunEnd(0.2)  # not announced: constant, then the cap's last 1/6
    assert factor(50) == 1.0 and factor(90) == pytest.approx(((100 - 90) / round(100 / 6)))


def test_the_loaders_blocks_say_whether_the_run_may_end_with_a_cool_down(tmp_path):
    from ds_cluster import ClusterSamplingConfig
    from tests.planning import plan_of
    from ds_cluster.loader.adaptive import AdaptiveSchedule
    from ds_cluster.loader.sampler import ClusterDataLoader

    labels = np.repeat(np.arange(2), 20)
    data = [{"input_ids": torch.zeros(4, dtype=torch.int64), "attention_mask": torch.ones(4, dtype=torch.int64),
             "labels": torch.zeros(4, dtype=torch.int64)} for _ in labels]
    ends = []
    for block in ({}, {"schedule": "adaptive", "budget_ratio": 0.5}, {"schedule": "adaptive", "budget_ratio": "auto"},
                  {"schedule": "adaptive", "budget_ratio": "auto", "auto_cooldown": 0.0}):
        config = ClusterSamplingConfig.from_dict({"enabled": True, "num_clusters": 2, "loss_reduction": "sample",
                                                  "budget_mode": "proportional",
                                                  "analysis_path": str(tmp_path / "a"), **block})
        stages = config.stages()
        plan = plan_of(None, stages, world_size=1, micro_batch_size=2, gradient_accumulation_steps=1,
                          labels=labels)
        schedule = AdaptiveSchedule(plan, 0, stages.schedule) if stages.schedule.adaptive else None
        loader = ClusterDataLoader(data, plan, 0, schedule=schedule)
        assert loader.run_end() is None  # no block open yet
        next(iter(loader))
        ends.append(loader.run_end())
    from ds_cluster.loader.schedule import RunEnd

    assert ends == [None, None, RunEnd(0.2), None]
