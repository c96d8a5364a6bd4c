"""The warm-up + cosine learning-rate factor whose length is read when training starts."""
from __future__ import annotations

import pytest

from ds_cluster.loader.lr_schedules import run_schedule, warmup_cosine, warmup_stable_decay


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


def test_a_runs_schedule_is_cosine_unless_an_auto_budget_cools_down_defaults_included():
    class Loader:
        def cooldown_steps(self):
            return (40, 60)

    cosine = warmup_cosine(lambda: 100, 0.05)
    for block in ({"schedule": "adaptive", "budget_ratio": 0.3}, {}, None,
                  {"schedule": "adaptive", "budget_ratio": "auto", "auto_cooldown": 0.0}):
        factor = run_schedule(block, lambda: 100, 0.05, lambda: Loader())
        assert [factor(step) for step in (3, 50, 90)] == [cosine(step) for step in (3, 50, 90)]
    made = {}
    factor = run_schedule({"schedule": "adaptive", "budget_ratio": "auto"}, lambda: 100, 0.05,
                          lambda: made.get("loader"))  # auto_cooldown's default, 0.2
    assert factor(50) == 1.0 and factor(90) == pytest.approx(((100 - 90) / round(100 / 6)))  # the cap's last 1/6
    made["loader"] = Loader()
    assert factor(50) == pytest.approx(0.5) and factor(60) == 0.0
