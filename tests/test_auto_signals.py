"""The automatic budget's stopping signals (planning/auto.py): exact small cases, the relative rule is 0.5.0's
`auto_stop`, and the loader resumes with a curve signal's history."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_cluster.planning.auto import AUTO_SIGNALS, AutoState, auto_step, fitted_curve
from ds_cluster.settings import ScheduleSettings
from ds_cluster.planning.shares import auto_stop


def test_a_power_law_is_read_back_from_its_points():
    history = [[step, 5.0 * step ** -0.3] for step in (10, 20, 30, 40, 50)]
    now, beta = fitted_curve(history)
    assert beta == pytest.approx(-0.3) and now == pytest.approx(5.0 * 50 ** -0.3)
    assert fitted_curve(history[:1]) is None and fitted_curve([[10, 1.0], [20, 0.0]]) is None


def test_the_curve_signal_stops_when_as_many_steps_again_would_buy_little():
    rule = ScheduleSettings(signal="curve", fit_windows=4, remaining=0.2, patience=1)
    steep = [[step, 5.0 * step ** -0.5] for step in (10, 20, 30, 40)]  # 1 - 2**-0.5 = 0.29 >= 0.2: improving
    flat = [[step, 5.0 * step ** -0.1] for step in (10, 20, 30, 40)]  # 1 - 2**-0.1 = 0.07 < 0.2: not
    signal = AUTO_SIGNALS["curve"]
    assert signal.read(steep, 5.0, math.nan, rule).improving
    reading = signal.read(flat, 5.0, math.nan, rule)
    assert not reading.improving and reading.predicted_gain == pytest.approx(5.0 * 40 ** -0.1 * (1 - 2 ** -0.1))
    assert signal.read(steep[:3], 5.0, math.nan, rule).improving  # fewer windows than the fit needs: no verdict


def test_the_floor_signal_reads_the_fall_over_the_next_window_in_nats():
    rule = ScheduleSettings(signal="floor", fit_windows=3, floor=0.02, adapt_every=10, patience=1)
    history = [[step, 2.0 * step ** -0.2] for step in (60, 70, 80)]
    fall = 2.0 * 80 ** -0.2 * (1 - (90 / 80) ** -0.2)
    reading = AUTO_SIGNALS["floor"].read(history, 2.0, math.nan, rule)
    assert reading.improving == (fall >= 0.02) and fall < 0.03


def test_a_cluster_stops_after_patience_windows_and_records_why():
    rule = ScheduleSettings(signal="curve", fit_windows=3, remaining=0.2, patience=2)
    state = AutoState.empty(2)
    for step in range(10, 110, 10):
        losses = np.array([3.0 * step ** -0.05, 3.0 * step ** -0.6])  # cluster 0 flat, cluster 1 steep
        state, predicted = auto_step(state, losses, step, rule)
    assert state.stopped == [True, False]
    assert state.stops[0]["step"] == 40 and state.stops[0]["signal"] == "curve"  # windows 3 and 4 read flat
    assert state.stops[0]["predicted_gain"] == pytest.approx(3.0 * 40 ** -0.05 * (1 - 2 ** -0.05))
    assert predicted[0] is None and predicted[1] is not None  # a stopped cluster is no longer read
    json.dumps(state.__dict__)  # plain JSON: checkpoints keep it


@settings(max_examples=100, deadline=None)
@given(losses=st.lists(st.lists(st.one_of(st.floats(0.1, 10.0), st.just(float("nan"))), min_size=3, max_size=3),
                       min_size=1, max_size=12),
       tolerance=st.floats(0.0, 0.2), patience=st.integers(1, 4))
def test_the_relative_signal_is_the_rule_of_0_5_0(losses, tolerance, patience):
    rule = ScheduleSettings(signal="relative", tolerance=tolerance, patience=patience)
    state = AutoState.empty(3)
    best, stale, stopped = np.full(3, np.nan), np.zeros(3, dtype=np.int64), np.zeros(3, dtype=bool)
    for window, row in enumerate(losses):
        tracked = np.array(row)
        state, _ = auto_step(state, tracked, 10 * (window + 1), rule)
        best, stale, stopped = auto_stop(best, stale, stopped, tracked, tolerance, patience)
        assert state.stopped == stopped.tolist() and state.stale == stale.tolist()
        assert [np.nan if b is None else b for b in state.best] == pytest.approx(best.tolist(), nan_ok=True)
