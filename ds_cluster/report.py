"""What users look at: a plan's summary, its coverage, a finished run's time and loss, and an HTML report.

Reads only what the other stages wrote (a Plan, an analysis's features and
the data's categories, per-rank traces and summaries); computes nothing of the
plan again. `write_report` takes plain data and writes a self-contained
folder: index.html and PNG plots (matplotlib, Agg), relative links only, no
script, no external resource.
"""
from __future__ import annotations

import html
import json
import logging
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import numpy as np

from ds_cluster.clustering import category_counts, purity
from ds_cluster.fileio import write_text_atomic
from ds_cluster.plan import Plan
from ds_cluster.plots import (plot_cluster_sizes, plot_category_heatmap, plot_projection, plot_rank_step_heatmap,
                              plot_weights)

logger = logging.getLogger(__name__)


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
    schedule = plan.schedule(epoch)
    steps, world = schedule.shape[:2]
    labels = plan.labels[schedule.reshape(steps, world, -1)]
    # One bincount over (step, rank, cluster) cells instead of a Python loop over steps and ranks.
    cells = (np.arange(steps)[:, None, None] * world + np.arange(world)[None, :, None]) * plan.num_clusters + labels
    counts = np.bincount(cells.ravel(), minlength=steps * world * plan.num_clusters)
    return counts.reshape(steps, world, plan.num_clusters)


def schedule_coverage(plan: Plan, epoch: int = 0) -> dict[str, Any]:
    """Distinct clusters per global step and per rank-step of one epoch's schedule (min and mean)."""
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


def cluster_category_counts(labels: np.ndarray, categories: Sequence[str],
                          num_clusters: int) -> tuple[list[str], np.ndarray, float]:
    """Per cluster, how many samples of each category (a task family, say): (names, counts (K, F), purity)."""
    names, counts = category_counts(labels, categories, num_clusters)
    return names, counts, purity(counts)


# --------------------------------------------------------------------------- the HTML report
_CSS = """
body { font-family: sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.9em; }
td, th { border: 1px solid #ccc; padding: 2px 8px; text-align: right; }
th { background: #f0f0f0; } td.name, th.name { text-align: left; }
img { max-width: 100%; border: 1px solid #eee; }
p.note { color: #555; font-size: 0.9em; }
"""


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]], names: int = 1) -> str:
    """An HTML table; the first `names` columns are left-aligned text."""
    def cell(tag: str, index: int, value: Any) -> str:
        css = ' class="name"' if index < names else ""
        return f"<{tag}{css}>{html.escape(str(value))}</{tag}>"

    lines = ["<table>", "<tr>" + "".join(cell("th", i, h) for i, h in enumerate(header)) + "</tr>"]
    lines += ["<tr>" + "".join(cell("td", i, v) for i, v in enumerate(row)) + "</tr>" for row in rows]
    lines.append("</table>")
    return "\n".join(lines)


def _figure(name: str, alt: str) -> str:
    return f'<p><img src="{html.escape(name)}" alt="{html.escape(alt)}"></p>'


def _plan_section(plan: Plan, out: Path) -> list[str]:
    summary = plan.summary()
    coverage = schedule_coverage(plan, epoch=0)
    weight_of = np.zeros(plan.num_clusters)
    weight_of[plan.labels[plan.selected]] = plan.weights[plan.selected]
    return [
        "<h2>Plan</h2>",
        _table(["", "value"], [
            ("samples", summary["num_samples"]),
            ("left out (no response tokens)", summary["num_excluded"]),
            ("clusters", summary["num_clusters"]),
            ("kept", f"{summary['num_kept']} ({100 * summary['kept_fraction']:.1f}%)"),
            ("weights", f"{summary['weight_min']:.3f} .. {summary['weight_max']:.3f}"),
            ("effective sample size", f"{summary['effective_sample_size']:.1f}"),
            ("batch", f"world {summary['world_size']} x micro {summary['micro_batch_size']} x accumulation "
                      f"{summary['gradient_accumulation_steps']} = {summary['global_batch_size']}"),
            ("steps per epoch", summary["steps_per_epoch"]),
            ("allocation", summary["allocation"]),
            ("clusters per global step (epoch 0)",
             f"min {coverage['clusters_per_step_min']}, mean {coverage['clusters_per_step_mean']:.2f}"),
            ("clusters per rank and step (epoch 0)",
             f"min {coverage['clusters_per_rank_step_min']}, mean {coverage['clusters_per_rank_step_mean']:.2f}"),
            ("plan fingerprint", summary["fingerprint"]),
        ]),
        _table(["cluster", "size", "kept", "weight"], [
            (c, int(plan.cluster_sizes[c]), int(plan.kept_sizes[c]), f"{weight_of[c]:.3f}")
            for c in range(plan.num_clusters)]),
        _figure(plot_cluster_sizes(plan, out / "cluster_sizes.png"), "cluster sizes against kept sizes"),
        _figure(plot_weights(plan, out / "weights.png"), "distribution of sample weights"),
    ]


def _features_section(plan: Plan, features: Optional[np.ndarray], max_points: int, out: Path) -> list[str]:
    parts = ["<h2>Features</h2>"]
    included = np.flatnonzero(plan.labels >= 0)
    if features is not None and included.size >= 2:
        rows, coords, explained = pca_projection(features, included, max_points=max_points, seed=plan.seed)
        parts.append(_figure(plot_projection(plan, rows, coords, explained, out / "projection.png"),
                             "2-D projection of the features coloured by cluster"))
    else:
        parts.append('<p class="note">No features in the analysis (labels only): no projection.</p>')
    return parts


def _categories_section(plan: Plan, categories: Optional[Sequence[str]], out: Path) -> list[str]:
    parts = ["<h2>Clusters and categories</h2>"]
    if categories is None or len(categories) != plan.num_samples or not any(categories):
        parts.append('<p class="note">The data has no category (or family) column: no cluster-versus-category table.</p>')
        return parts
    names, category_counts_, purity_value = cluster_category_counts(plan.labels, categories, plan.num_clusters)
    parts.append(f"<p>Purity {purity_value:.3f}: the share of samples in their cluster's most common category.</p>")
    parts.append(_figure(plot_category_heatmap(names, category_counts_, purity_value, out / "categories.png"),
                         "heat map of clusters against categories"))
    majority = [names[int(row.argmax())] if row.sum() else "" for row in category_counts_]
    parts.append(_table(["cluster", "majority", *names],
                        [(c, majority[c], *category_counts_[c].tolist()) for c in range(plan.num_clusters)], names=2))
    return parts


def write_report(
    out_dir: Union[str, Path],
    plan: Plan,
    *,
    features: Optional[np.ndarray] = None,
    categories: Optional[Sequence[str]] = None,
    title: str = "ds_cluster plan report",
    sources: Optional[dict[str, str]] = None,
    max_projection_points: int = 4000,
) -> Path:
    """Write `out_dir/index.html` and its PNG plots for a plan; returns the HTML's path.

    features: the analysis's (N, d) features, for the 2-D projection (skipped when None);
    categories: a category per sample (N; a task family, say), for the cluster-versus-category table
    (skipped when None); sources: name -> value lines shown at the top (config, analysis...).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    parts = [f"<h1>{html.escape(title)}</h1>"]
    if sources:
        parts.append(_table(["input", "value"], sorted(sources.items()), names=2))
    parts += _plan_section(plan, out)
    parts.append("<h2>Schedule: samples of each cluster per rank and step</h2>")
    parts.append(_figure(plot_rank_step_heatmap(cluster_counts_per_rank_step(plan, epoch=0),
                                                out / "rank_step_heatmap.png"),
                         "heat map of cluster counts per rank per step"))
    parts += _features_section(plan, features, max_projection_points, out)
    parts += _categories_section(plan, categories, out)
    document = ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
                f"<title>{html.escape(title)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n"
                + "\n".join(parts) + "\n</body>\n</html>\n")
    index = out / "index.html"
    write_text_atomic(index, document)
    logger.info("report written to %s", index)
    return index
