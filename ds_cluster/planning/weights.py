"""Stage 5c, the loss weights: what each kept sample's loss is multiplied by, so the subset keeps the full data's
distribution. Pure numpy. Each rule is an object in `WEIGHTINGS` (the `weighting` key):

- "cluster": w = (n_c / N) / (s_c / S) for a kept sample of cluster c (s_c kept of n_c, S kept of N): the
  kept samples of c carry n_c / N of the total weight, so the weighted mean over the subset estimates the
  full-data mean, and the mean weight over kept samples is 1. A temperature t in [0, 1] makes them w ** t,
  rescaled to a mean of 1 over the kept samples (t = 1 these weights, t = 0 all 1s): some bias for a larger
  effective sample size.
- "none": every kept sample weighs 1 (the subset's own distribution).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Union

import numpy as np

from ds_cluster.registry import Registry


class WeightingRule(ABC):
    """The loss weight of a kept sample of each cluster, from the clusters' sizes and what they keep."""

    name: ClassVar[str]
    # Whether the weights give each cluster back its share of the whole data (what a targeted selection does not want).
    rebalances: ClassVar[bool] = True

    @abstractmethod
    def cluster_weights(self, cluster_sizes: np.ndarray, kept_sizes: np.ndarray, temperature: float) -> np.ndarray:
        """(K,) float64 weights; `kept_sizes` may be fractional (expected draws of a schedule)."""


class ClusterWeighting(WeightingRule):
    """Natural share over kept share, (n_c / N) / (s_c / S), tempered by t."""

    name = "cluster"

    def cluster_weights(self, cluster_sizes: np.ndarray, kept_sizes: np.ndarray, temperature: float) -> np.ndarray:
        sizes = np.asarray(cluster_sizes, dtype=np.float64)
        kept = np.asarray(kept_sizes, dtype=np.float64)
        with np.errstate(divide="ignore"):  # a cluster keeping nothing: an infinite weight no sample carries
            per_cluster = (sizes / sizes.sum()) / (kept / kept.sum())
        if temperature != 1.0:  # w ** t, rescaled to a mean of 1 over the kept samples; t = 1 stays bit for bit
            has_kept = kept > 0
            per_cluster = np.where(has_kept, per_cluster, 1.0) ** temperature
            per_cluster *= kept.sum() / float(np.dot(kept[has_kept], per_cluster[has_kept]))
        return per_cluster


class NoWeighting(WeightingRule):
    """Every kept sample weighs 1."""

    name = "none"
    rebalances = False

    def cluster_weights(self, cluster_sizes: np.ndarray, kept_sizes: np.ndarray, temperature: float) -> np.ndarray:
        return np.ones(np.asarray(cluster_sizes).shape[0], dtype=np.float64)


WEIGHTINGS: Registry[WeightingRule] = Registry("weighting", (ClusterWeighting(), NoWeighting()))


def sample_weights(
    labels: np.ndarray,
    selected: np.ndarray,
    cluster_sizes: np.ndarray,
    kept_sizes: np.ndarray,
    weighting: Union[str, WeightingRule],
    *,
    temperature: float = 1.0,
) -> np.ndarray:
    """Per-sample loss weight (N,) float64: the rule's weight of the sample's cluster when kept, 0 otherwise."""
    rule = WEIGHTINGS.get_rule(weighting)
    if not 0.0 <= temperature <= 1.0:
        raise ValueError(f"weight temperature must be in [0, 1], got {temperature}")
    labels = np.asarray(labels, dtype=np.int64)
    per_cluster = rule.cluster_weights(cluster_sizes, kept_sizes, temperature)
    if selected.size == labels.size:  # everything kept: one gather, no scatter
        return per_cluster[labels]
    weights = np.zeros(labels.size, dtype=np.float64)
    weights[selected] = per_cluster[labels[selected]]
    return weights
