"""The time-to-quality benchmark (bench/quality.py) end to end at a tiny size, so its code cannot rot.

Real 2-rank `deepspeed` launches: one `ds-cluster analyze`, then full data, a random subset and the
CluSTER paper preset, each cut to a few optimizer steps, evaluated on two held-out records per family.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.quality_lib import (
    ONE_CLUSTER,
    PAPER_ANALYSIS,
    build_run_plan,
    prepare_analyses,
    run_all,
    tiny_settings,
    write_report,
)
from ds_cluster.data.tasks import generate_mixture, write_jsonl
from tests.launching import REPO


@pytest.mark.integration
def test_benchmark_pipeline_at_a_tiny_size(tmp_path: Path):
    train, heldout = generate_mixture(seed=0, total=200, heldout_per_family=2)
    write_jsonl(train, tmp_path / "train.jsonl")
    write_jsonl(heldout, tmp_path / "heldout.jsonl")
    settings = tiny_settings(tmp_path / "bench", tmp_path / "train.jsonl", tmp_path / "heldout.jsonl",
                             REPO / "ds_configs" / "zero2.json")

    analyses = prepare_analyses(settings)
    assert set(analyses) == {ONE_CLUSTER, PAPER_ANALYSIS}
    assert analyses[PAPER_ANALYSIS].job_cpu_s > 0 and analyses[PAPER_ANALYSIS].purity is not None
    runs = build_run_plan(settings, analyses)
    assert [spec.setting for spec in runs] == ["full", "random_r0.5", "paper_r0.5"]
    run_all(settings, analyses, runs)
    report = write_report(settings, analyses, runs)

    document = json.loads(report["json_path"].read_text())
    assert document["runs_missing"] == []
    by_setting = {result["spec"]["setting"]: result for result in document["runs"]}
    full, subset, paper = by_setting["full"], by_setting["random_r0.5"], by_setting["paper_r0.5"]
    assert full["kept_fraction"] == 1.0 and full["steps"] == settings.max_steps
    assert subset["num_kept"] == paper["num_kept"] < full["num_kept"]  # the random subset matches the paper size
    for result in document["runs"]:
        assert result["train_job_cpu_s"] > 0 and result["train_loop_cpu_s"] > 0
        assert set(result["accuracy_by_family"]) == set(result["heldout_loss"]) == {r["family"] for r in heldout}
        assert 0.0 <= result["accuracy"]["worst"] <= result["accuracy"]["macro_avg"] <= 1.0
        assert sum(result["kept_by_family"].values()) == result["num_kept"]
    assert paper["total_cpu_s"] == pytest.approx(paper["selection_job_cpu_s"] + paper["train_job_cpu_s"])
    assert full["selection_job_cpu_s"] == 0.0 and paper["selection_job_cpu_s"] > 0.0
    markdown = report["markdown_path"].read_text()
    assert "| full data |" in markdown and "total / full (CPU)" in markdown
    assert any(goal["met"] is not None for goal in report["goals"])
    assert report["plot_path"].stat().st_size > 0

    # Resumable: a second call finds every run done and launches nothing.
    run_all(settings, analyses, runs)
