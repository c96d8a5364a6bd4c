"""What users read about a plan: its table, its coverage per step and rank, a finished run's summary, and the
2-D projection and category counts the page plots. Reads only what the other stages wrote.
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Sequence, Union

import numpy as np

from ds_cluster.clustering.kmeans import category_counts, purity
from ds_cluster.planning.plan import Plan


def plan_table(plan: Plan) -> str:
    """Clusters, sizes, kept counts and weights, one line per cluster, then the batch shape."""
    summary = plan.summary()
    lines = [f"{'cluster':>7} {'size':>8} {'kept':>8} {'weight':>8}"]
    weight_of = np.zeros(plan.num_clusters)
    kept_labels = plan.labels[plan.selected]
    weight_of[kept_labels] = plan.weights[plan.selected]
    for cluster in range(plan.num_clusters):
        lines.append(f"{cluster:>7} {int(plan.cluster_sizes[cluster]):>8} {int(plan.kept_sizes[cluster]):>8} "
                     f"{weight_of[cluster]:>8.3f}")
    lines.append(
        f"kept {summary['num_kept']} of {summary['num_samples']} ({100 * summary['kept_fraction']:.1f}%), "
        f"weights {summary['weight_min']:.3f}..{summary['weight_max']:.3f}, effective sample size "
        f"{summary['effective_sample_size']:.0f}; {summary['steps_per_epoch']} steps per epoch of "
        f"{summary['global_batch_size']} samples (world {summary['world_size']} x micro "
        f"{summary['micro_batch_size']} x gas {summary['gradient_accumulation_steps']}), allocation "
        f"{summary['allocation']}, plan {summary['fingerprint']}"
    )
    return "\n".join(lines)


def run_summary(output_dir: Union[str, Path]) -> dict[str, Any]:
    """Coverage per optimizer step and per rank, time and losses of a train.py run with --trace."""
    output = Path(output_dir)
    plan = Plan.load(output / "plan")
    rank_summaries = [json.loads(path.read_text()) for path in sorted(output.glob("summary_rank*.json"))]
    clusters_per_step: dict[tuple[int, int], set] = {}
    clusters_per_rank_step: list[int] = []
    losses: list[float] = []
    for rank in range(plan.world_size):
        trace_path = output / "trace" / f"rank{rank}.jsonl"
        if not trace_path.exists():
            continue
        per_rank_step: dict[tuple[int, int], set] = {}
        for line in trace_path.read_text().splitlines():
            record = json.loads(line)
            step = (record["epoch"], record["micro"] // plan.gradient_accumulation_steps)
            clusters = set(plan.labels[record["indices"]].tolist())
            clusters_per_step.setdefault(step, set()).update(clusters)
            per_rank_step.setdefault(step, set()).update(clusters)
            if rank == 0:
                losses.append(record["loss"])
        clusters_per_rank_step.extend(len(c) for c in per_rank_step.values())
    coverage = [len(c) for c in clusters_per_step.values()]
    return {
        "num_samples": plan.num_samples,
        "num_kept": plan.num_kept,
        "num_clusters": plan.num_clusters,
        "steps": len(coverage),
        "clusters_per_step_min": min(coverage) if coverage else 0,
        "clusters_per_step_mean": float(np.mean(coverage)) if coverage else 0.0,
        "clusters_per_rank_step_mean": float(np.mean(clusters_per_rank_step)) if clusters_per_rank_step else 0.0,
        "train_seconds": max((s["train_seconds"] for s in rank_summaries), default=0.0),
        "first_loss": losses[0] if losses else None,
        "final_loss": float(np.mean(losses[-8:])) if losses else None,
        "parameter_digests_agree": len({s["parameter_digest"] for s in rank_summaries}) == 1,
    }


def format_run_summary(summary: dict[str, Any]) -> str:
    return (
        f"kept {summary['num_kept']} of {summary['num_samples']} samples in {summary['num_clusters']} clusters\n"
        f"{summary['steps']} optimizer steps; clusters per step: min {summary['clusters_per_step_min']}, "
        f"mean {summary['clusters_per_step_mean']:.2f} of {summary['num_clusters']} "
        f"(per rank and step: {summary['clusters_per_rank_step_mean']:.2f})\n"
        f"training time {summary['train_seconds']:.1f} s; loss {summary['first_loss']:.3f} -> "
        f"{summary['final_loss']:.3f} (mean of the last 8 micro-steps on rank 0); "
        f"ranks' parameters agree: {summary['parameter_digests_agree']}"
    )


# --------------------------------------------------------------------------- plan coverage
def cluster_counts_per_rank_step(plan: Plan, epoch: int = 0) -> np.ndarray:
    """How many samples of each cluster every rank trains in every optimizer step: int64 (steps, world, K)."""
    layout = plan.epoch_layout(epoch)
    steps, world = layout.shape[:2]
    labels = plan.labels[layout.reshape(steps, world, -1)]
    # One bincount over (step, rank, cluster) cells instead of a Python loop over steps and ranks.
    cells = (np.arange(steps)[:, None, None] * world + np.arange(world)[None, :, None]) * plan.num_clusters + labels
    counts = np.bincount(cells.ravel(), minlength=steps * world * plan.num_clusters)
    return counts.reshape(steps, world, plan.num_clusters)


def layout_coverage(plan: Plan, epoch: int = 0) -> dict[str, Any]:
    """Distinct clusters per global step and per rank-step of one epoch's layout (min and mean)."""
    counts = cluster_counts_per_rank_step(plan, epoch)
    if counts.size == 0:
        return {"epoch": epoch, "steps": 0, "clusters_per_step_min": 0, "clusters_per_step_mean": 0.0,
                "clusters_per_rank_step_min": 0, "clusters_per_rank_step_mean": 0.0}
    per_step = (counts.sum(axis=1) > 0).sum(axis=1)
    per_rank_step = (counts > 0).sum(axis=2)
    return {
        "epoch": epoch,
        "steps": int(counts.shape[0]),
        "clusters_per_step_min": int(per_step.min()),
        "clusters_per_step_mean": float(per_step.mean()),
        "clusters_per_rank_step_min": int(per_rank_step.min()),
        "clusters_per_rank_step_mean": float(per_rank_step.mean()),
    }


def format_coverage(coverage: dict[str, Any], num_clusters: int) -> str:
    return (f"coverage (epoch {coverage['epoch']}, {coverage['steps']} steps): clusters per global step min "
            f"{coverage['clusters_per_step_min']}, mean {coverage['clusters_per_step_mean']:.2f} of {num_clusters}; "
            f"per rank and step min {coverage['clusters_per_rank_step_min']}, mean "
            f"{coverage['clusters_per_rank_step_mean']:.2f}")


# --------------------------------------------------------------------------- projections and categories
def pca_projection(features: np.ndarray, rows: np.ndarray, max_points: int = 4000,
                   seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """2-D PCA (scikit-learn) of a bounded random subsample of `rows` of `features`.

    Returns (sample indices, coordinates (n, 2), explained variance ratio (2,)); the
    same inputs give the same subsample and the same signs of the axes.
    """
    from sklearn.decomposition import PCA

    rows = np.asarray(rows)
    if rows.size > max_points:
        rows = np.sort(np.random.default_rng(seed).choice(rows, size=max_points, replace=False))
    points = np.asarray(features[rows], dtype=np.float64)
    components = min(2, points.shape[0], points.shape[1])
    pca = PCA(n_components=components, svd_solver="full")
    coords = pca.fit_transform(points)
    explained = pca.explained_variance_ratio_
    if components < 2:
        coords = np.pad(coords, ((0, 0), (0, 2 - components)))
        explained = np.pad(explained, (0, 2 - components))
    return rows, coords, explained


def schedule_coverage(plan: Plan, epoch: int = 0) -> dict[str, Any]:
    """0.5.0's name of `layout_coverage`."""
    warnings.warn("schedule_coverage is layout_coverage since 0.6.0", DeprecationWarning, stacklevel=2)
    return layout_coverage(plan, epoch)


def cluster_category_counts(labels: np.ndarray, categories: Sequence[str],
                          num_clusters: int) -> tuple[list[str], np.ndarray, float]:
    """Per cluster, how many samples of each category (a task family, say): (names, counts (K, F), purity)."""
    names, counts = category_counts(labels, categories, num_clusters)
    return names, counts, purity(counts)
