"""One per-cluster accumulator of per-sample training losses: what the monitors, the adaptive schedule's windows
and its probe set all count with.

Losses are summed as integers of 2**-24 (fixed point): sums are then exact whatever their order (over ranks, over
a checkpoint and its resumption), so a resumed run sees the very same figures. A tally only grows; each reader
keeps a mark (`snapshot`) and reads what came since (`since`), so readers with their own cadence (a monitor at
every optimizer step, a window every `adapt_every` steps) share one count. Pure numpy: the sum over the
data-parallel ranks is the caller's.
"""
from __future__ import annotations

from typing import Any

import numpy as np

FIXED_POINT = float(2 ** 24)


def to_fixed_point(values: Any) -> np.ndarray:
    """Losses as int64 multiples of 2**-24."""
    return np.rint(np.asarray(values, dtype=np.float64) * FIXED_POINT).astype(np.int64)


class ClusterTally:
    """Per cluster, the summed per-sample losses (fixed point) and how many samples, since the tally was made.

    `totals` is int64 (2K,): K sums, then K counts, the layout every reader sums over the ranks.
    """

    def __init__(self, labels: np.ndarray, num_clusters: int) -> None:
        self.labels = np.asarray(labels)
        self.num_clusters = int(num_clusters)
        self.totals = np.zeros(2 * self.num_clusters, dtype=np.int64)

    def add(self, sample_index: Any, losses: Any) -> None:
        """One micro-batch's per-sample losses (each sample's mean response-token loss) on this rank."""
        clusters = self.labels[np.asarray(sample_index, dtype=np.int64).reshape(-1)]
        np.add.at(self.totals, clusters, to_fixed_point(np.asarray(losses, dtype=np.float64).reshape(-1)))
        np.add.at(self.totals, self.num_clusters + clusters, 1)

    def snapshot(self) -> np.ndarray:
        """A mark: the totals now (a reader's starting point)."""
        return self.totals.copy()

    def since(self, mark: np.ndarray) -> np.ndarray:
        """What was added after `mark` (same layout)."""
        return self.totals - mark


def mean_losses(summed: np.ndarray) -> list:
    """Per cluster, the mean loss of a (summed) tally array; None where a cluster counted no sample."""
    num_clusters = summed.size // 2
    sums, counts = summed[:num_clusters], summed[num_clusters:]
    return [float(s / FIXED_POINT / c) if c > 0 else None for s, c in zip(sums.tolist(), counts.tolist())]
