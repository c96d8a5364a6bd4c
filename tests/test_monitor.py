"""Per-cluster figures for the user's dashboard: the counts (exact small cases), their names, and a real 2-rank
hook job whose DeepSpeed CSV monitor receives them at every optimizer step beside DeepSpeed's own figures."""
from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

from ds_cluster.loader.figures import ClusterFigures, figure_events, figure_logs
from ds_cluster.planning.plan import Plan
from ds_cluster.planning.tally import ClusterTally
from tests.test_adaptive_jobs import STEPS
from tests.training import read_trace


def test_figures_count_per_cluster_over_ranks_and_reset_the_loss_each_report():
    labels = np.array([0, 1, 1, 2, 0])
    ranks = [ClusterFigures(ClusterTally(labels, 3)), ClusterFigures(ClusterTally(labels, 3))]
    ranks[0].tally.add(np.array([0, 1]), np.array([1.0, 2.0]))
    ranks[1].tally.add(np.array([2, 4]), np.array([4.0, 3.0]))
    # What the all-reduce gives: both ranks' arrays summed, each rank calling with its own.
    local = [f.tally.totals.copy() for f in ranks]
    reports = [figures.report(lambda _: local[0] + local[1]) for figures in ranks]
    assert reports[0] == reports[1] == {"train_loss": [2.0, 3.0, None], "samples": [2, 2, 0]}
    ranks[0].tally.add(np.array([3]), np.array([5.0]))
    assert ranks[0].report(lambda values: values) == {"train_loss": [None, None, 5.0], "samples": [2, 2, 1]}


def test_figures_are_named_for_the_monitors_and_the_trainer_log():
    figures = {"train_loss": [0.5, None], "samples": [3, 0]}
    assert figure_events(figures, None, 64) == [
        ("Train/Samples/ds_cluster/cluster_0/train_loss", 0.5, 64),
        ("Train/Samples/ds_cluster/cluster_0/samples", 3.0, 64),
        ("Train/Samples/ds_cluster/cluster_1/samples", 0.0, 64)]
    assert figure_logs(figures, [0.25, 0.75]) == {"cluster_0/train_loss": 0.5, "cluster_0/samples": 3.0,
                                                  "cluster_0/share": 0.25, "cluster_1/samples": 0.0,
                                                  "cluster_1/share": 0.75}


def read_csv(path: Path) -> list[tuple[int, float]]:
    rows = list(csv.reader(path.open()))
    return [(int(step), float(value)) for step, value in rows[1:]]


@pytest.mark.integration
def test_the_hook_writes_per_cluster_figures_to_deepspeeds_csv_monitor(adaptive_run):
    """The adaptive ZeRO-3 run of tests/test_adaptive_jobs.py (deepspeed launcher, 2 ranks, 9 steps) had
    DeepSpeed's CSV monitor on."""
    out, steps = adaptive_run, STEPS
    folder = out / "monitor" / "job"
    plan = Plan.load(out / "plan")
    lr_steps = [step for step, _ in read_csv(folder / "Train_Samples_lr.csv")]
    assert len(lr_steps) == steps  # DeepSpeed's own figure, once per optimizer step
    # Samples trained so far, per cluster and step: exactly what the two ranks' traces hold.
    traced = [read_trace(out, rank) for rank in range(2)]
    micro_per_step = len(traced[0]) // steps
    natural = plan.cluster_sizes / plan.cluster_sizes.sum()
    for cluster in range(plan.num_clusters):
        samples = read_csv(folder / f"Train_Samples_ds_cluster_cluster_{cluster}_samples.csv")
        assert [step for step, _ in samples] == lr_steps  # the same cadence and the same x-axis
        for number, (_, value) in enumerate(samples):
            indices = [i for trace in traced for record in trace[:(number + 1) * micro_per_step]
                       for i in record["indices"]]
            assert value == int((plan.labels[indices] == cluster).sum()), (cluster, number)
        shares = read_csv(folder / f"Train_Samples_ds_cluster_cluster_{cluster}_share.csv")
        assert [step for step, _ in shares] == lr_steps
        assert shares[0][1] == pytest.approx(natural[cluster])  # window 0 is drawn at the natural shares
        losses = read_csv(folder / f"Train_Samples_ds_cluster_cluster_{cluster}_train_loss.csv")
        assert losses and all(np.isfinite(value) and value > 0 for _, value in losses)
