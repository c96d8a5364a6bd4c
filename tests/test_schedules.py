"""The warm-up + cosine learning-rate factor whose length is read when training starts."""
from __future__ import annotations

import pytest

from ds_cluster.loader.lr_schedules import auto_cooldown, warmup_cosine, warmup_stable_decay


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


def test_the_cool_down_share_is_read_from_the_block_defaults_included():
    assert auto_cooldown({"schedule": "adaptive", "budget_ratio": "auto"}) == 0.2  # the default
    assert auto_cooldown({"schedule": "adaptive", "budget_ratio": "auto", "auto_cooldown": 0.0}) == 0.0
    assert auto_cooldown({"schedule": "adaptive", "budget_ratio": 0.3}) == 0.0  # a fixed budget: cosine
    assert auto_cooldown({}) == 0.0
