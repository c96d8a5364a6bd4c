"""The adaptive schedule's arithmetic: from one window's per-cluster figures to the next window's shares.

Pure numpy, the same on every rank: the figures are all-reduced before they get here (per cluster, the summed
training losses of the window and their count, and optionally a probe set's), so the same figures, rule and
seed give the same shares everywhere. Each update rule is an object in `ADAPTIVE_RULES` (the `adaptive_rule`
key):

- "progress": learning progress, each cluster's relative drop of its loss since the previous window (the probe
  set's where there is one, else the training loss), times its natural share;
- "exp3": Online Data Mixing's EXP3 with a Gibbs policy (Albalak et al. 2023): the window's training loss of
  a cluster is its reward, accumulated into its log-weight; the exploration rate decays as sqrt(ln K / (K t));
- "loss": each cluster's loss times its natural share (the clusters the model knows least draw most).

"progress" and "loss" keep a floor of `exploration` x the natural share, so no active cluster starves.
`auto_stop` is the automatic budget: a cluster whose loss has not improved by `tolerance` (relative) for
`patience` windows stops being drawn.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import numpy as np

from ds_cluster.planning.budget import apportion
from ds_cluster.planning.tally import FIXED_POINT, to_fixed_point
from ds_cluster.registry import Registry

__all__ = ["ADAPTIVE_RULES", "AdaptiveRule", "WindowFigures", "auto_stop", "window_draws", "FIXED_POINT",
           "to_fixed_point"]


@dataclass(frozen=True)
class WindowFigures:
    """One window's all-reduced figures per cluster: losses summed (fixed point) and counted, training and probe."""

    train_sum: np.ndarray  # int64 (K,), fixed point
    train_count: np.ndarray  # int64 (K,)
    probe_sum: Optional[np.ndarray] = None
    probe_count: Optional[np.ndarray] = None

    @classmethod
    def of(cls, train: np.ndarray, probe: Optional[np.ndarray] = None) -> "WindowFigures":
        """From summed tallies (`ClusterTally` arrays: K fixed-point sums, then K counts)."""
        num_clusters = train.size // 2
        if probe is None:
            return cls(train[:num_clusters], train[num_clusters:])
        return cls(train[:num_clusters], train[num_clusters:], probe[:num_clusters], probe[num_clusters:])

    @staticmethod
    def _mean(total: np.ndarray, count: np.ndarray) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(count > 0, total / FIXED_POINT / np.maximum(count, 1), np.nan)

    @property
    def train_loss(self) -> np.ndarray:
        return self._mean(self.train_sum, self.train_count)

    @property
    def probe_loss(self) -> Optional[np.ndarray]:
        return None if self.probe_sum is None else self._mean(self.probe_sum, self.probe_count)

    @property
    def tracked_loss(self) -> np.ndarray:
        """The loss progress and stopping read: the probe set's where a cluster has one, else the training loss."""
        probe = self.probe_loss
        return self.train_loss if probe is None else np.where(np.isnan(probe), self.train_loss, probe)


class AdaptiveRule(ABC):
    """How a window's figures move the sampling shares; its state is plain JSON (saved in checkpoints)."""

    name: ClassVar[str]

    def initial_state(self, num_clusters: int) -> dict[str, Any]:
        return {}

    @abstractmethod
    def update(self, state: dict[str, Any], figures: WindowFigures, natural: np.ndarray, active: np.ndarray,
               window: int, exploration: float) -> tuple[np.ndarray, dict[str, Any]]:
        """(the next window's shares over the clusters, summing to 1 over `active` ones; the new state)."""


def _with_floor(weights: np.ndarray, natural: np.ndarray, active: np.ndarray, exploration: float) -> np.ndarray:
    """Shares proportional to `weights` mixed with `exploration` x the natural shares, over active clusters."""
    natural_active = np.where(active, natural, 0.0)
    natural_active = natural_active / natural_active.sum()
    weights = np.where(active & np.isfinite(weights), np.maximum(weights, 0.0), 0.0)
    if weights.sum() <= 0:
        return natural_active
    return (1.0 - exploration) * weights / weights.sum() + exploration * natural_active


class ProgressRule(AdaptiveRule):
    name = "progress"

    def initial_state(self, num_clusters: int) -> dict[str, Any]:
        return {"previous": [None] * num_clusters}

    def update(self, state: dict[str, Any], figures: WindowFigures, natural: np.ndarray, active: np.ndarray,
               window: int, exploration: float) -> tuple[np.ndarray, dict[str, Any]]:
        now = figures.tracked_loss
        previous = np.array([np.nan if value is None else value for value in state["previous"]], dtype=np.float64)
        with np.errstate(invalid="ignore", divide="ignore"):
            progress = np.where(previous > 0, (previous - now) / previous, np.nan)
        kept = np.where(np.isnan(now), previous, now)
        new_state = {"previous": [None if math.isnan(value) else float(value) for value in kept]}
        if np.isnan(progress).all():  # the first window: no progress yet
            return _with_floor(natural.copy(), natural, active, 1.0), new_state
        return _with_floor(natural * np.nan_to_num(progress, nan=0.0), natural, active, exploration), new_state


class Exp3Rule(AdaptiveRule):
    name = "exp3"

    def initial_state(self, num_clusters: int) -> dict[str, Any]:
        return {"log_weights": [0.0] * num_clusters}

    def update(self, state: dict[str, Any], figures: WindowFigures, natural: np.ndarray, active: np.ndarray,
               window: int, exploration: float) -> tuple[np.ndarray, dict[str, Any]]:
        num_active = max(int(active.sum()), 1)
        rate = min(1.0 / num_active, math.sqrt(math.log(max(num_active, 2)) / (num_active * (window + 1))))
        loss = np.nan_to_num(figures.train_loss, nan=0.0)
        reward = loss / loss.max() if loss.max() > 0 else loss  # in [0, 1]
        log_weights = np.asarray(state["log_weights"], dtype=np.float64) + rate * np.where(active, reward, 0.0)
        gibbs = np.where(active, np.exp(log_weights - log_weights[active].max()), 0.0)
        shares = (1.0 - num_active * rate) * gibbs / gibbs.sum() + rate * active
        return shares / shares.sum(), {"log_weights": log_weights.tolist()}


class LossRule(AdaptiveRule):
    name = "loss"

    def update(self, state: dict[str, Any], figures: WindowFigures, natural: np.ndarray, active: np.ndarray,
               window: int, exploration: float) -> tuple[np.ndarray, dict[str, Any]]:
        return _with_floor(natural * figures.tracked_loss, natural, active, exploration), state


ADAPTIVE_RULES: Registry[AdaptiveRule] = Registry("adaptive_rule", (ProgressRule(), Exp3Rule(), LossRule()))


def auto_stop(best: np.ndarray, stale: np.ndarray, stopped: np.ndarray, tracked: np.ndarray, tolerance: float,
              patience: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(best loss so far, windows without improvement, stopped) of every cluster after one window.

    A loss at least `tolerance` (relative) below the best so far is an improvement; a cluster without one
    for `patience` windows in a row stops, for good. Clusters without a figure this window keep theirs.
    """
    best, stale, stopped = best.copy(), stale.copy(), stopped.copy()
    seen = ~np.isnan(tracked) & ~stopped
    improved = seen & (np.isnan(best) | (tracked < best * (1.0 - tolerance)))
    best[improved] = tracked[improved]
    stale[improved] = 0
    stale[seen & ~improved] += 1
    stopped |= stale >= patience
    return best, stale, stopped


def window_draws(shares: np.ndarray, samples: int) -> np.ndarray:
    """Samples of each cluster in a window of `samples`: within one of samples x share (largest remainder)."""
    shares = np.asarray(shares, dtype=np.float64)
    return apportion(samples, shares, np.full(shares.shape, samples, dtype=np.int64))
