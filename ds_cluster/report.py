"""What users look at: a plan's summary and a finished run's coverage, time and loss, as text.

Reads only what the other stages wrote (a saved Plan, per-rank traces and
summaries); computes nothing of the plan again.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Union

import numpy as np

from ds_cluster.plan import Plan


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
