"""Per-cluster figures for the user's dashboard: each cluster's mean training loss since the last report, the
samples of each cluster trained so far, and (with the adaptive schedule) the window's sampling shares. They read
the loader's one tally of what `record_losses` hands it (`planning.tally.ClusterTally`); an integration sums them
over the data-parallel ranks at its report cadence (DeepSpeed's monitor at every optimizer step, the Trainer's
`log`) and names the figures with `figure_events`. Plain numpy: the sum is passed in.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ds_cluster.planning.tally import ClusterTally, mean_losses

# How the figures are named in a monitor (TensorBoard groups by the slashes; the CSV monitor writes one file per
# name, headed by the last part).
EVENT_PREFIX = "Train/Samples/ds_cluster"


class ClusterFigures:
    """A monitor's reading of the loader's tally: per cluster, the mean training loss since the last `report`, and
    the samples of each cluster reported so far (since the job started)."""

    def __init__(self, tally: Any, num_clusters: Optional[int] = None) -> None:
        if num_clusters is not None:  # 0.5.0's ClusterFigures(labels, num_clusters), with a tally of its own
            warnings.warn("ClusterFigures(labels, num_clusters) is ClusterFigures(ClusterTally(labels, num_clusters)) "
                          "since 0.6.0", DeprecationWarning, stacklevel=2)
            tally = ClusterTally(tally, num_clusters)
        self.tally = tally
        self.num_clusters = tally.num_clusters
        self._mark = tally.snapshot()
        self.samples_trained = np.zeros(self.num_clusters, dtype=np.int64)  # summed over the ranks

    def add(self, sample_index: np.ndarray, losses: np.ndarray) -> None:
        """One micro-batch's per-sample losses on this rank (into the tally; the loader's `record_losses` does it)."""
        self.tally.add(sample_index, losses)

    def report(self, sum_over_ranks: Callable[[np.ndarray], np.ndarray]) -> dict[str, list]:
        """Collective (every data-parallel rank calls it): the figures since the last report, over all ranks.

        Returns {"train_loss": per cluster mean loss (None for a cluster not trained since), "samples": per
        cluster samples trained so far}.
        """
        totals = np.asarray(sum_over_ranks(self.tally.since(self._mark)), dtype=np.int64)
        self._mark = self.tally.snapshot()
        self.samples_trained += totals[self.num_clusters:]
        return {"train_loss": mean_losses(totals), "samples": self.samples_trained.tolist()}


def _named_figures(figures: dict[str, list], shares: Optional[Sequence[float]]) -> list[tuple[str, float]]:
    """`cluster_<c>/train_loss` (clusters trained since the last report only), `cluster_<c>/samples` and, with
    shares, `cluster_<c>/share`, with their values."""
    named: list[tuple[str, float]] = []
    for cluster, (loss, samples) in enumerate(zip(figures["train_loss"], figures["samples"])):
        if loss is not None:
            named.append((f"cluster_{cluster}/train_loss", loss))
        named.append((f"cluster_{cluster}/samples", float(samples)))
        if shares is not None:
            named.append((f"cluster_{cluster}/share", float(shares[cluster])))
    return named


def figure_events(figures: dict[str, list], shares: Optional[Sequence[float]], step: int,
                  prefix: str = EVENT_PREFIX) -> list[tuple[str, float, int]]:
    """DeepSpeed monitor events `(PREFIX/cluster_<c>/<figure>, value, step)`."""
    return [(f"{prefix}/{name}", value, step) for name, value in _named_figures(figures, shares)]


def figure_logs(figures: dict[str, list], shares: Optional[Sequence[float]]) -> dict[str, Any]:
    """The same figures as a Trainer `log` dict: `cluster_<c>/train_loss`, `cluster_<c>/samples`,
    `cluster_<c>/share`."""
    return dict(_named_figures(figures, shares))
