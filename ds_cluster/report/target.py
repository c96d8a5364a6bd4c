"""What a report shows of an analysis's target examples: per cluster, its affinity to the target (the target examples
nearest its centre, and the mean similarity of its records to the target), which examples and targets it serves,
and what the plan took from it. Plain numpy in, plain rows out; page.py renders them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ds_cluster.planning.plan import Plan
from ds_cluster.planning.targeted import member_centroids, nearest_clusters, target_scores


@dataclass(frozen=True)
class ClusterAffinity:
    """One cluster against the target: the target examples nearest its centre (and their targets), its records'
    mean similarity to the target (each record's largest cosine to a target example), what the plan kept of it and
    their mean similarity, and the prompts of (up to 3 of) the examples it serves."""

    cluster: int
    nearest_examples: int
    served: tuple[tuple[str, int], ...]
    mean_similarity: float
    kept: int
    kept_mean_similarity: float
    prompts: tuple[str, ...]


def cluster_affinities(plan: Plan, features: np.ndarray, target: Any, max_prompts: int = 3) -> list[ClusterAffinity]:
    """Every cluster's `ClusterAffinity` for an analysis's features (N, d) and its `AnalysedTarget`."""
    labels = plan.labels
    rows = np.flatnonzero(labels >= 0)
    scores = np.full(labels.size, np.nan)
    scores[rows] = target_scores(features, rows, target)[0]
    centres = member_centroids(features, labels, plan.num_clusters, plan.centroids)
    nearest = nearest_clusters(centres, target)
    kept = np.zeros(labels.size, dtype=bool)
    kept[plan.selected] = True
    names = list(target.group_names)
    prompts = list(target.prompts)
    out = []
    for cluster in range(plan.num_clusters):
        members = labels == cluster
        serving = np.flatnonzero(nearest == cluster)
        groups = np.asarray(target.groups)[serving]
        served = tuple((names[group], int((groups == group).sum())) for group in np.unique(groups))
        out.append(ClusterAffinity(
            cluster=cluster, nearest_examples=int(serving.size), served=served,
            mean_similarity=float(np.mean(scores[members])) if members.any() else float("nan"),
            kept=int((members & kept).sum()),
            kept_mean_similarity=float(np.mean(scores[members & kept])) if (members & kept).any() else float("nan"),
            prompts=tuple(prompts[index] for index in serving[:max_prompts]) if prompts else ()))
    return out
