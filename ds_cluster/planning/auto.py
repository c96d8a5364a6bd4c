"""The automatic budget's stopping signals: when a cluster has nothing left to learn that is worth its steps.

With budget_ratio "auto" the adaptive schedule asks, after every window, whether each cluster is still
improving; a cluster that has not been for `patience` windows in a row stops being drawn (or keeps its
maintenance share). What "improving" means is the signal (`AUTO_SIGNALS`, the `auto_signal` key), read from the
cluster's tracked loss (its probe loss, else its training loss of the window):

- "relative": the loss is at least `tolerance` (relative) below its best so far (0.5.0's rule);
- "curve": a power law fitted to the cluster's last `fit_windows` losses (log loss on log step, least squares; the
  per-cluster learning curves of online data mixing) predicts how much lower the loss gets in as many steps again
  as the run has taken; the cluster still improves while that is at least `remaining` of its loss now (a relative
  figure: the same rule on any mixture and run length);
- "floor": the same fitted curve falls by at least `floor` (in loss units, nats) over the next window: an absolute
  floor on the improvement a window of steps still buys.

Pure numpy, the same on every rank (the figures are all-reduced before they get here); the state is plain JSON.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Optional, Sequence

import numpy as np

from ds_cluster.registry import Registry
from ds_cluster.settings import ScheduleSettings


@dataclass(frozen=True)
class Reading:
    """One cluster after one window: whether it still improves, and the gain its loss curve predicts over as many
    steps again as it has had (None: no curve yet, or a signal without one)."""

    improving: bool
    predicted_gain: Optional[float] = None
    why: str = ""  # what the signal read, in words (a stop record keeps it)


class AutoSignal(ABC):
    """Whether a cluster still improves, from its history: (optimizer step, tracked loss) of its last windows,
    oldest first, its first window's loss and its best loss so far."""

    name: ClassVar[str]
    # Whether "best" is the loss the signal measures improvement against (moved only by an improvement), rather
    # than the lowest loss seen.
    best_is_reference: ClassVar[bool] = False

    @abstractmethod
    def read(self, history: Sequence[Sequence[float]], first: float, best: float, rule: ScheduleSettings) -> Reading:
        """The cluster's reading after the window whose figure is history[-1]."""


def fitted_curve(history: Sequence[Sequence[float]]) -> Optional[tuple[float, float]]:
    """(the fitted loss at the last step, the power law's exponent beta: loss ~ step ** beta) of a least-squares
    line through (log step, log loss); None with fewer than two points or a loss that is not positive."""
    steps = np.array([point[0] for point in history], dtype=np.float64)
    losses = np.array([point[1] for point in history], dtype=np.float64)
    if steps.size < 2 or (losses <= 0).any() or (steps <= 0).any() or np.ptp(steps) == 0:
        return None
    beta, intercept = np.polyfit(np.log(steps), np.log(losses), 1)
    return float(math.exp(intercept + beta * math.log(steps[-1]))), float(beta)


class RelativeSignal(AutoSignal):
    name = "relative"
    best_is_reference = True

    def read(self, history: Sequence[Sequence[float]], first: float, best: float, rule: ScheduleSettings) -> Reading:
        latest = history[-1][1]
        return Reading(math.isnan(best) or latest < best * (1.0 - rule.tolerance),
                       why=f"loss {latest:.4f}, not {rule.tolerance:.0%} below its best {best:.4f}")


class CurveSignal(AutoSignal):
    name = "curve"

    def read(self, history: Sequence[Sequence[float]], first: float, best: float, rule: ScheduleSettings) -> Reading:
        curve = fitted_curve(history[-rule.fit_windows:]) if len(history) >= rule.fit_windows else None
        if curve is None:
            return Reading(True)  # not enough windows to read a curve from yet
        now, beta = curve
        gain_ahead = now * (1.0 - 2.0 ** beta) if beta < 0 else 0.0  # as many steps again: step x 2
        return Reading(gain_ahead >= rule.remaining * now, gain_ahead,
                       f"its learning curve predicts {gain_ahead / now:.1%} lower loss after as many steps again "
                       f"(the bar: {rule.remaining:.0%})")


class FloorSignal(AutoSignal):
    name = "floor"

    def read(self, history: Sequence[Sequence[float]], first: float, best: float, rule: ScheduleSettings) -> Reading:
        curve = fitted_curve(history[-rule.fit_windows:]) if len(history) >= rule.fit_windows else None
        if curve is None:
            return Reading(True)
        now, beta = curve
        step = history[-1][0]
        fall_next_window = now * (1.0 - ((step + rule.adapt_every) / step) ** beta) if beta < 0 else 0.0
        gain_ahead = now * (1.0 - 2.0 ** beta) if beta < 0 else 0.0
        return Reading(fall_next_window >= rule.floor, gain_ahead,
                       f"its learning curve falls {fall_next_window:.4f} nats over the next window (the bar: "
                       f"{rule.floor:g})")


AUTO_SIGNALS: Registry[AutoSignal] = Registry("auto_signal", (RelativeSignal(), CurveSignal(), FloorSignal()))


@dataclass
class AutoState:
    """Every cluster's bookkeeping (plain JSON lists in checkpoints): best loss so far, windows in a row without
    improving, stopped, its last windows' (step, loss), its first loss, and its stop record once stopped."""

    best: list
    stale: list
    stopped: list
    history: list
    first: list
    stops: list  # per cluster None, or {"step", "signal", "loss", "predicted_gain"}

    @classmethod
    def empty(cls, num_clusters: int) -> "AutoState":
        return cls([None] * num_clusters, [0] * num_clusters, [False] * num_clusters, [[] for _ in range(num_clusters)],
                   [None] * num_clusters, [None] * num_clusters)


def auto_step(state: AutoState, tracked: np.ndarray, step: int, rule: ScheduleSettings) -> tuple[AutoState, list]:
    """The state after one window whose tracked losses (per cluster; NaN where a cluster had no figure) ended at
    optimizer `step`, under the schedule's auto_* thresholds (`rule`), and each cluster's predicted gain (None where
    there is none). A cluster that has not improved for `patience` windows in a row stops, for good; clusters without
    a figure, or stopped, keep their state."""
    signal = AUTO_SIGNALS.get_rule(rule.signal)
    keep = max(rule.fit_windows, 2)
    best, stale, stopped = list(state.best), list(state.stale), list(state.stopped)
    history, first, stops = [list(h) for h in state.history], list(state.first), list(state.stops)
    predicted: list = [None] * len(best)
    for cluster, loss in enumerate(np.asarray(tracked, dtype=np.float64).tolist()):
        if math.isnan(loss) or stopped[cluster]:
            continue
        history[cluster] = (history[cluster] + [[int(step), float(loss)]])[-keep:]
        first[cluster] = float(loss) if first[cluster] is None else first[cluster]
        reading = signal.read(history[cluster], first[cluster], math.nan if best[cluster] is None else best[cluster],
                              rule)
        predicted[cluster] = reading.predicted_gain
        if best[cluster] is None or (reading.improving if signal.best_is_reference else loss < best[cluster]):
            best[cluster] = float(loss)
        stale[cluster] = 0 if reading.improving else stale[cluster] + 1
        if stale[cluster] >= rule.patience:
            stopped[cluster] = True
            stops[cluster] = {"step": int(step), "signal": rule.signal, "loss": float(loss),
                              "predicted_gain": reading.predicted_gain,
                              "why": f"{reading.why}, {rule.patience} window{'s' * (rule.patience > 1)} in a row"}
    return AutoState(best, stale, stopped, history, first, stops), predicted
