"""The adaptive schedule in one process: windows placed like the plan, shares that follow the losses, the same
shares from the same figures, exact resume from a state saved mid-window, the automatic budget, the log, and the
rules' arithmetic. Real multi-rank runs (hook, Trainers, kill and resume) are in tests/test_adaptive_jobs.py."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_cluster import ClusterSamplingConfig
from tests.planning import plan_of
from ds_cluster.collectives import LOCAL
from ds_cluster.loader.adaptive import AdaptiveSchedule, _draw
from ds_cluster.loader.sampler import ClusterDataLoader
from ds_cluster.planning.shares import ADAPTIVE_RULES, WindowFigures, auto_stop, window_draws
from ds_cluster.planning.tally import FIXED_POINT, to_fixed_point

SIZES = (60, 30, 10)  # three clusters of unequal size
LABELS = np.repeat(np.arange(3), SIZES)


def _dataset() -> list[dict]:
    return [{"input_ids": torch.full((6,), i % 50), "attention_mask": torch.ones(6, dtype=torch.int64),
             "labels": torch.full((6,), i % 50)} for i in range(len(LABELS))]


def _loader(tmp_path: Path, **keys) -> ClusterDataLoader:
    block = {"enabled": True, "schedule": "adaptive", "num_clusters": 3, "budget_mode": "proportional",
             "budget_ratio": 0.5, "selection": "random", "adapt_every": 2, "probe_size": 0,
             "loss_reduction": "sample", "analysis_path": str(tmp_path / "analysis"), **keys}
    config = ClusterSamplingConfig.from_dict(block)
    plan = plan_of(None, config, world_size=1, micro_batch_size=4, gradient_accumulation_steps=2, labels=LABELS)
    stages = config.stages()
    schedule = AdaptiveSchedule(plan, 0, stages.schedule, collectives=LOCAL)
    return ClusterDataLoader(_dataset(), plan, 0, schedule=schedule, loss=stages.loss, collectives=LOCAL)


def _train(loader: ClusterDataLoader, micro_batches: int, loss_of_cluster=(2.0, 1.0, 0.5)) -> list[list[int]]:
    """Take micro-batches as a training loop does, handing back losses that depend on the cluster only."""
    seen = []
    while len(seen) < micro_batches and loader.completed_epochs < 50:
        for batch in loader:
            indices = batch["sample_index"]
            loader.record_losses(indices, torch.tensor([loss_of_cluster[LABELS[i]] for i in indices.tolist()]))
            seen.append(indices.tolist())
            if len(seen) == micro_batches:
                break
    return seen


def test_windows_are_placed_like_the_plan_and_cover_every_cluster(tmp_path):
    loader = _loader(tmp_path)
    assert len(loader) == loader.plan.steps_per_epoch * 2  # an epoch: the static plan's step count at r = 0.5
    batches = _train(loader, 8)  # two windows of 2 steps x 2 micro-batches
    for window in (batches[:4], batches[4:]):
        drawn = [LABELS[i] for batch in window for i in batch]
        assert len(drawn) == 16 and set(drawn) == {0, 1, 2}
        # Without replacement inside a cluster until it is used up: no sample twice in a window here.
        assert len({i for batch in window for i in batch}) == 16
    # The first window draws at the natural shares (0.6, 0.3, 0.1 of 16 samples), each within one.
    counts = np.bincount([LABELS[i] for b in batches[:4] for i in b], minlength=3)
    assert (np.abs(counts - 16 * np.array([0.6, 0.3, 0.1])) < 1).all()


def test_shares_follow_the_rule_and_the_log_says_so(tmp_path):
    loader = _loader(tmp_path, adaptive_rule="loss", exploration=0.0)
    _train(loader, 12)
    lines = [json.loads(line) for line in (tmp_path / "schedule.jsonl").read_text().splitlines()]
    assert [line["window"] for line in lines] == [0, 1]  # a window's line is written when the next one starts
    assert lines[0]["train_loss"] == pytest.approx([2.0, 1.0, 0.5])
    natural = np.array(SIZES) / sum(SIZES)
    expected = natural * [2.0, 1.0, 0.5] / (natural * [2.0, 1.0, 0.5]).sum()
    assert lines[0]["shares"] == pytest.approx(expected.tolist())
    assert lines[0]["step"] == 2 and sum(lines[0]["samples_consumed"]) == 16


def test_a_static_schedule_is_the_static_loader_bit_for_bit(tmp_path):
    config = ClusterSamplingConfig(enabled=True, num_clusters=3, budget_mode="proportional", budget_ratio=0.5,
                                   selection="random")
    static = ClusterSamplingConfig(enabled=True, num_clusters=3, budget_mode="proportional", budget_ratio=0.5,
                                   selection="random", schedule="static", adapt_every=10)
    plans = [plan_of(None, c, world_size=1, micro_batch_size=4, gradient_accumulation_steps=2, labels=LABELS)
             for c in (config, static)]
    assert plans[0].fingerprint() == plans[1].fingerprint()  # the new keys at their defaults change nothing
    assert type(ClusterDataLoader(_dataset(), plans[0], 0)) is ClusterDataLoader


def test_resume_mid_window_gives_the_same_indices_and_shares(tmp_path):
    whole = _loader(tmp_path / "a")
    expected = _train(whole, 20)
    first = _loader(tmp_path / "b")
    done = _train(first, 7)  # inside the fourth window (2 micro-batches per step, 2 steps per window)
    state = json.loads(json.dumps(first.state_dict(global_step=3)))  # plain JSON, as checkpoints keep it
    resumed = _loader(tmp_path / "b")
    resumed.load_state_dict(state)
    assert done + _train(resumed, 13) == expected
    log = [json.loads(line) for line in (tmp_path / "b" / "schedule.jsonl").read_text().splitlines()]
    assert log == [json.loads(line) for line in (tmp_path / "a" / "schedule.jsonl").read_text().splitlines()]


def test_resume_from_a_state_saved_on_a_windows_last_step_closes_that_window_first(tmp_path):
    """A checkpoint every adapt_every steps is saved when a window has just ended and the next is not drawn yet;
    the resumed run must close the saved window (its figures, the rule) before drawing the next (0.5.0 redrew the
    closed window instead)."""
    whole = _loader(tmp_path / "a")
    expected = _train(whole, 20)
    first = _loader(tmp_path / "b")
    done = _train(first, 8)  # exactly two windows of 2 steps x 2 micro-batches
    state = json.loads(json.dumps(first.state_dict(global_step=4)))
    resumed = _loader(tmp_path / "b")
    resumed.load_state_dict(state)
    assert done + _train(resumed, 12) == expected
    log = [json.loads(line) for line in (tmp_path / "b" / "schedule.jsonl").read_text().splitlines()]
    assert log == [json.loads(line) for line in (tmp_path / "a" / "schedule.jsonl").read_text().splitlines()]


def test_a_loop_that_hands_no_losses_gets_a_clear_error(tmp_path):
    loader = _loader(tmp_path)
    with pytest.raises(RuntimeError, match="received no per-sample losses in window 0.*record_losses"):
        for _ in loader:
            pass


def test_auto_budget_stops_clusters_that_stop_improving_and_ends_the_run(tmp_path):
    loader = _loader(tmp_path, budget_ratio="auto", auto_patience=2, auto_tolerance=0.01, auto_cooldown=0.0)
    assert loader.plan.num_kept == loader.plan.num_samples  # auto: everything may be drawn
    batches = _train(loader, 1000)  # losses never improve: every cluster stops after patience + 1 windows
    assert loader.finished and loader.completed_epochs > 50
    assert len(batches) == 3 * 2 * 2  # three windows, then every cluster has stopped
    last = json.loads((tmp_path / "schedule.jsonl").read_text().splitlines()[-1])
    assert last["stopped"] == [0, 1, 2] and last["finished"]
    assert 0 < last["kept_fraction"] < 1


def test_auto_cooldown_goes_on_over_every_cluster_at_the_natural_shares_then_ends(tmp_path):
    loader = _loader(tmp_path, budget_ratio="auto", auto_patience=2, auto_tolerance=0.01, auto_cooldown=0.5)
    batches = _train(loader, 1000)
    # Three windows until every cluster has stopped, then ceil(0.5 x 3) = 2 windows of cool-down.
    assert loader.finished and len(batches) == (3 + 2) * 2 * 2
    assert loader.run_end().steps == (6, 10)  # (first step, end step), in optimizer steps
    assert loader.run_end().fraction == 0.5
    lines = [json.loads(line) for line in (tmp_path / "schedule.jsonl").read_text().splitlines()]
    assert lines[2]["cooldown"] == [6, 10] and not lines[2]["finished"]
    natural = np.array(SIZES) / sum(SIZES)
    assert lines[2]["shares"] == pytest.approx(natural.tolist())  # stopped clusters come back, none forgotten
    cooling = [LABELS[i] for batch in batches[12:] for i in batch]
    assert set(cooling) == {0, 1, 2}
    assert lines[-1]["finished"] and lines[-1]["shares"] == [0.0, 0.0, 0.0]


def test_auto_cooldown_resumes_from_a_state_saved_inside_it(tmp_path):
    keys = dict(budget_ratio="auto", auto_patience=2, auto_tolerance=0.01, auto_cooldown=0.5)
    expected = _train(_loader(tmp_path / "a", **keys), 1000)
    first = _loader(tmp_path / "b", **keys)
    done = _train(first, 15)  # inside the cool-down's second window
    state = json.loads(json.dumps(first.state_dict(global_step=7)))
    resumed = _loader(tmp_path / "b", **keys)
    resumed.load_state_dict(state)
    assert resumed.schedule.state.cooldown == {"start": 6, "end": 10}
    assert done + _train(resumed, 1000) == expected and resumed.finished
    assert resumed.run_end().steps == (6, 10)


@pytest.mark.parametrize("signal", ["curve", "floor"])
def test_a_fitted_signal_stops_flat_clusters_logs_why_and_resumes_inside_the_cool_down(tmp_path, signal):
    keys = dict(budget_ratio="auto", auto_signal=signal, auto_fit_windows=2, auto_patience=1, auto_cooldown=0.5)
    expected = _train(_loader(tmp_path / "a", **keys), 1000)  # losses never fall: flat curves, every cluster stops
    lines = [json.loads(line) for line in (tmp_path / "a" / "schedule.jsonl").read_text().splitlines()]
    stopping = next(line for line in lines if len(line["stopped"]) == 3)
    assert stopping["window"] == 1 and all(stop["signal"] == signal and stop["step"] == 4
                                           for stop in stopping["stops"])
    assert all(abs(stop["predicted_gain"]) < 1e-9 for stop in stopping["stops"])  # a flat curve predicts no gain
    first = _loader(tmp_path / "b", **keys)
    done = _train(first, 10)  # inside the cool-down (windows 2 and 3)
    state = json.loads(json.dumps(first.state_dict(global_step=5)))
    resumed = _loader(tmp_path / "b", **keys)
    resumed.load_state_dict(state)
    assert done + _train(resumed, 1000) == expected and resumed.finished


def test_auto_maintenance_keeps_a_stopped_cluster_at_its_share_of_the_natural(tmp_path):
    loader = _loader(tmp_path, budget_ratio="auto", auto_patience=2, auto_tolerance=0.01, auto_maintenance=0.5,
                     adaptive_rule="loss", exploration=0.0)
    for window in range(5):  # clusters 0 and 1 improve by 10% a window, cluster 2 never: only it stops
        _train(loader, 4, loss_of_cluster=(2.0 * 0.9 ** window, 1.0 * 0.9 ** window, 0.5))
    lines = [json.loads(line) for line in (tmp_path / "schedule.jsonl").read_text().splitlines()]
    assert [line["stopped"] for line in lines] == [[], [], [2], [2]]
    natural = np.array(SIZES) / sum(SIZES)
    for line in lines[2:]:
        assert line["shares"][2] == pytest.approx(0.5 * natural[2]) and sum(line["shares"]) == pytest.approx(1.0)
    assert not loader.finished


def test_probe_set_is_held_out_of_training(tmp_path):
    loader = _loader(tmp_path, probe_size=3)
    assert loader.schedule.probe.size == 9
    drawn = {i for batch in _train(loader, 40) for i in batch}
    assert not drawn & set(loader.schedule.probe.tolist())


def test_the_config_refuses_auto_without_the_adaptive_schedule():
    with pytest.raises(ValueError, match="budget_ratio 'auto'.*schedule 'adaptive'"):
        ClusterSamplingConfig.from_dict({"enabled": True, "budget_ratio": "auto"})
    with pytest.raises(ValueError, match="'adaptive_rule'.*'progress', 'exp3', 'loss'"):
        ClusterSamplingConfig.from_dict({"enabled": True, "adaptive_rule": "greedy"})


# ------------------------------------------------------------------------------------------ the pure parts
@settings(max_examples=100, deadline=None)
@given(shares=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=8).filter(lambda s: sum(s) > 0),
       samples=st.integers(1, 500))
def test_window_draws_add_up_and_follow_the_shares(shares, samples):
    shares = np.array(shares) / sum(shares)
    draws = window_draws(shares, samples)
    assert draws.sum() == samples and (np.abs(draws - samples * shares) < 1.0 + 1e-9).all()


@settings(max_examples=50, deadline=None)
@given(size=st.integers(1, 30), counts=st.lists(st.integers(0, 50), min_size=1, max_size=6))
def test_a_stream_uses_a_pool_up_before_repeating_it(size, counts):
    pool = np.arange(100, 100 + size)
    stream, taken = [0, 0], []
    for count in counts:
        part, stream = _draw(pool, 7, 0, stream, count)
        assert part.size == count
        taken += part.tolist()
    for start in range(0, len(taken) - len(taken) % size, size):
        assert sorted(taken[start:start + size]) == pool.tolist()


@pytest.mark.parametrize("name", list(ADAPTIVE_RULES))
def test_every_rule_gives_shares_over_the_active_clusters(name):
    rule = ADAPTIVE_RULES[name]
    natural = np.array([0.5, 0.3, 0.2])
    active = np.array([True, False, True])
    state = rule.initial_state(3)
    for window, losses in enumerate(([3.0, 2.0, 1.0], [2.0, 2.0, 0.9], [1.5, 1.9, 0.9])):
        figures = WindowFigures(to_fixed_point(losses), np.array([4, 4, 4]))
        shares, state = rule.update(state, figures, natural, active, window + 1, 0.1)
        assert shares.sum() == pytest.approx(1.0) and shares[1] == 0 and (shares >= 0).all()
        json.dumps(state)  # plain JSON: checkpoints keep it


def test_fixed_point_sums_do_not_depend_on_their_order():
    values = np.random.default_rng(0).random(1000) * 10
    a = to_fixed_point(values).sum()
    b = to_fixed_point(values[::-1][:500]).sum() + to_fixed_point(values[::-1][500:]).sum()
    assert a == b and abs(a / FIXED_POINT - values.sum()) < 1e-3


def test_auto_stop_needs_patience_windows_without_improvement():
    best, stale, stopped = np.array([np.nan]), np.array([0]), np.array([False])
    for loss, expect_stopped in ((1.0, False), (0.999, False), (0.998, True)):
        best, stale, stopped = auto_stop(best, stale, stopped, np.array([loss]), 0.01, 2)
        assert bool(stopped[0]) == expect_stopped
