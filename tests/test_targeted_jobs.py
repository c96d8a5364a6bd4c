"""Targeted selection in real 2-rank DeepSpeed jobs on CPU, ZeRO-3, `hidden` features: `ds-cluster analyze
--target` (mpirun) then plan, report and export; the hook's training job computing the analysis with its target
(deepspeed launcher) and resuming exactly (mpirun); ClusterTrainer given a changed target set (its features computed
again, the records' kept); ClusterSFTTrainer computing the analysis with a target; a bad target file failing every
rank before anything is written. Six launches, each read by several tests."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from ds_cluster import Plan
from ds_cluster.analysis.folder import AnalysisDir
from ds_cluster.batching import BatchShape
from ds_cluster.cli import main as cli_main
from ds_cluster.clustering.samples import cluster_samples
from ds_cluster.config import ClusterSamplingConfig
from ds_cluster.data.dataset import read_jsonl, write_jsonl
from ds_cluster.data.target import read_target_fingerprint
from ds_cluster.planning.plan import build_plan
from ds_cluster.planning.targeted import round_robin
from bench.toy.tasks import DEFAULT_DATA
from tests.launching import REPO, check, run_deepspeed, run_mpirun
from tests.training import TRAIN, assert_run_follows_plan, read_trace

pytestmark = pytest.mark.integration

SHAPE = BatchShape(2, 4, 2)  # zero3.json's micro batch and accumulation, 2 ranks
HF_WORKER = str(REPO / "tests" / "workers" / "hf_trainer_worker.py")
TRL_WORKER = str(REPO / "tests" / "workers" / "trl_trainer_worker.py")


@pytest.fixture(scope="module")
def job(small_job: Path, tmp_path_factory) -> Path:
    """Two target files from the held-out records (never in the training slice): `first.jsonl`, 4 examples each of
    two families (two targets, by `family`); `second.jsonl`, 6 of a third family."""
    root = tmp_path_factory.mktemp("targeted")
    heldout = read_jsonl(DEFAULT_DATA / "heldout.jsonl")

    def of(family: str, count: int) -> list[dict]:
        return [record for record in heldout if record["family"] == family][:count]

    write_jsonl(of("double", 4) + of("swap_case", 4), root / "first.jsonl")
    write_jsonl(of("km_to_m", 6), root / "second.jsonl")
    return root


def targeted_config(job: Path, name: str, target: str, analysis: Path, **keys) -> Path:
    """zero3.json with a targeted block: hidden features, round_robin over `target`, a quarter of the data kept;
    `keys` added to the block."""
    config = json.loads((REPO / "ds_configs" / "zero3.json").read_text())
    config["data_efficiency"]["data_sampling"]["cluster_sampling"] = {
        "enabled": True, "feature_kind": "hidden", "num_clusters": 4, "selection": "round_robin",
        "budget_ratio": 0.25, "weighting": "none", "analysis_path": str(analysis), "seed": 7,
        "target": {"data": str(job / target), "group_field": "family", "min_examples": 4}, **keys}
    path = job / f"{name}.json"
    path.write_text(json.dumps(config))
    return path


def train(small_job: Path, config: Path, out: Path, *extra: str) -> list[str]:
    return [*TRAIN, "--deepspeed", str(config), "--model", str(small_job / "model"), "--data",
            str(small_job / "train.jsonl"), "--output-dir", str(out), "--max-length", "64", "--trace", *extra]


def rule_pick(analysis: Path, config: Path) -> np.ndarray:
    """What round_robin picks from the analysis's features, clusters and target, computed here from the folder."""
    folder = AnalysisDir(analysis)
    inputs = folder.load_inputs(folder.num_samples())
    settings = ClusterSamplingConfig.from_ds_config(config).stages().selection
    rows = np.flatnonzero(~inputs.exclude) if inputs.exclude is not None else np.arange(folder.num_samples())
    return round_robin(inputs.features, rows, folder.load_target(), round(0.25 * rows.size), settings.dedup_similarity,
                       inputs.labels[rows], dedup_centre=settings.dedup_centre)


# ------------------------------------------------------------------------------------------------ launches
@pytest.fixture(scope="module")
def cli_analysis(small_job: Path, job: Path) -> Path:
    """`ds-cluster analyze --kind hidden --target first.jsonl` on 2 ranks, ZeRO-3, under mpirun."""
    config = targeted_config(job, "cli", "first.jsonl", job / "unused")
    check(run_mpirun(["-m", "ds_cluster.cli", "analyze", "--deepspeed", str(config), "--model",
                      str(small_job / "model"), "--data", str(small_job / "train.jsonl"), "--out",
                      str(job / "cli_analysis"), "--kind", "hidden", "--target", str(job / "first.jsonl"),
                      "--max-length", "64", "--no-progress"], timeout=300))
    return job / "cli_analysis"


@pytest.fixture(scope="module")
def hook_run(small_job: Path, job: Path) -> Path:
    """The hook's training job (deepspeed launcher, ZeRO-3): it computes the analysis with the target, then trains 2
    steps and checkpoints."""
    config = targeted_config(job, "hook", "first.jsonl", job / "hook_analysis")
    out = job / "hook_run"
    check(run_deepspeed(train(small_job, config, out, "--max-steps", "2", "--save-every", "2"), timeout=300))
    return out


@pytest.fixture(scope="module")
def resumed_run(small_job: Path, job: Path, hook_run: Path) -> Path:
    """The same job resumed from its step-2 checkpoint under mpirun, to step 4 (the trace files grow)."""
    modified = (job / "hook_analysis" / "manifest.json").stat().st_mtime_ns
    check(run_mpirun(train(small_job, job / "hook.json", hook_run, "--resume", "--max-steps", "4"), timeout=300))
    assert (job / "hook_analysis" / "manifest.json").stat().st_mtime_ns == modified  # the analysis was read as it is
    return hook_run


@pytest.fixture(scope="module")
def retargeted(small_job: Path, job: Path, hook_run: Path) -> Path:
    """ClusterTrainer (deepspeed launcher) on a copy of the hook's analysis, configured with another target set and
    the near-duplicate test on the centred rows."""
    shutil.copytree(job / "hook_analysis", job / "retarget_analysis")
    config = targeted_config(job, "retarget", "second.jsonl", job / "retarget_analysis", dedup_centre=True)
    out = job / "retarget_run"
    check(run_deepspeed([HF_WORKER, "--deepspeed", str(config), "--model", str(small_job / "model"), "--data",
                         str(small_job / "train.jsonl"), "--out", str(out), "--max-steps", "2", "--save-steps",
                         "100"], timeout=300))
    return out


# --------------------------------------------------------------------------------------- the CLI's analysis
def test_analyze_records_the_targets_features_and_plan_report_export_honour_it(cli_analysis, job, tmp_path,
                                                                               capsys):
    folder = AnalysisDir(cli_analysis)
    target = folder.load_target()
    assert target.group_names == ("double", "swap_case") and target.groups.tolist() == [0] * 4 + [1] * 4
    assert folder.target_fingerprint() == read_target_fingerprint(job / "first.jsonl", group_field="family")
    assert target.features.shape == (8, folder.load_inputs(folder.num_samples()).features.shape[1])
    np.testing.assert_allclose(np.linalg.norm(target.features, axis=1), 1.0, atol=1e-5)

    config = job / "cli.json"
    plan_inputs = ["--analysis", str(cli_analysis), "--deepspeed", str(config), "--world-size", "2"]
    assert cli_main(["plan", *plan_inputs, "--out", str(tmp_path / "plan")]) == 0
    plan = Plan.load(tmp_path / "plan")
    assert plan.selected.tolist() == rule_pick(cli_analysis, config).tolist()
    # The selection takes the targets' families far beyond their share of the pool.
    families = [record["family"] for record in read_jsonl(folder.manifest()["data"])]
    share = np.isin(families, ["double", "swap_case"])
    assert share[plan.selected].mean() > 2 * share.mean(), (share[plan.selected].mean(), share.mean())

    assert cli_main(["export", *plan_inputs, "--data", folder.manifest()["data"], "--out",
                     str(tmp_path / "subset.jsonl")]) == 0
    exported = read_jsonl(tmp_path / "subset.jsonl")
    assert len(exported) == plan.num_kept and {"target_score", "target_group"} <= set(exported[0])
    assert {row["target_group"] for row in exported} <= {"double", "swap_case"}
    assert cli_main(["report", *plan_inputs, "--out", str(tmp_path / "report")]) == 0
    page = (tmp_path / "report" / "index.html").read_text()
    assert "<h2>Target</h2>" in page and "target examples nearest" in page and "double 4" in page

    # The config's target changed: plan refuses the analysis's target rather than plan with a stale one.
    stale = targeted_config(job, "stale", "second.jsonl", job / "unused")
    capsys.readouterr()
    assert cli_main(["plan", "--analysis", str(cli_analysis), "--deepspeed", str(stale), "--world-size", "2"]) == 2


# ----------------------------------------------------------------------------------------- the hook's job
def test_the_hooks_job_computes_the_target_with_its_analysis_and_trains_on_the_rules_pick(hook_run, cli_analysis,
                                                                                         job):
    analysis = job / "hook_analysis"
    plan = Plan.load(hook_run / "plan")
    assert plan.selected.tolist() == rule_pick(analysis, job / "hook.json").tolist()
    assert plan.settings["target"]["fingerprint"] == AnalysisDir(analysis).target_fingerprint()
    assert_run_follows_plan(hook_run, loss_falls=False)
    # The job's engine and the CLI's forward-only one give the same features, pool and target alike.
    for name in ("features.npy", "target_features.npy"):
        np.testing.assert_allclose(np.load(analysis / name), np.load(cli_analysis / name), atol=1e-5)


def test_a_resumed_targeted_job_continues_the_same_sequence(resumed_run):
    # Both launches' micro-steps, each on its plan batch: steps 0-1 by the first, 2-3 by the resumed one.
    assert_run_follows_plan(resumed_run, loss_falls=False)
    for rank in (0, 1):
        assert [record["micro"] for record in read_trace(resumed_run, rank)] == list(range(8))  # 4 steps x 2


# ------------------------------------------------------------------------------------------ a changed target
def test_a_changed_target_makes_a_new_selection_and_keeps_the_records_features(retargeted, hook_run, job):
    old, new = AnalysisDir(job / "hook_analysis"), AnalysisDir(job / "retarget_analysis")
    assert new.target_fingerprint() == read_target_fingerprint(job / "second.jsonl", group_field="family")
    assert new.target_fingerprint() != old.target_fingerprint()
    for name in ("features.npy", "labels.npy", "centroids.npy"):
        assert (new.path / name).read_bytes() == (old.path / name).read_bytes(), name
    assert (new.path / ".feature_store").is_dir()
    config = ClusterSamplingConfig.from_ds_config(job / "retarget.json")
    inputs = new.load_inputs(new.num_samples())
    plan = build_plan(cluster_samples(inputs, config.stages().clustering, 2), config, SHAPE, target=new.load_target())
    assert (retargeted / "plan_fingerprint.txt").read_text() == plan.fingerprint()  # the job's plan, key included
    assert plan.settings["dedup_centre"] is True
    assert plan.selected.tolist() == rule_pick(new.path, job / "retarget.json").tolist()
    assert plan.selected.tolist() != Plan.load(hook_run / "plan").selected.tolist()


# ------------------------------------------------------------------------------------- TRL, and bad input
def test_cluster_sft_trainer_computes_the_analysis_with_its_target(small_job, job):
    config = targeted_config(job, "trl", "first.jsonl", job / "trl_analysis")
    out = job / "trl_run"
    check(run_deepspeed([TRL_WORKER, "--deepspeed", str(config), "--model", str(small_job / "model"), "--data",
                         str(small_job / "train.jsonl"), "--out", str(out), "--max-steps", "1", "--save-steps",
                         "100"], timeout=300))
    folder = AnalysisDir(job / "trl_analysis")
    run = json.loads((out / "run.json").read_text())
    assert folder.load_target().group_names == ("double", "swap_case")
    assert run["settings"]["target"]["fingerprint"] == folder.target_fingerprint()
    assert (out / "plan_fingerprint.txt").exists()


def test_a_missing_target_file_fails_every_rank_before_anything_is_written(small_job, job):
    config = targeted_config(job, "missing", "nowhere.jsonl", job / "missing_analysis")
    result = run_mpirun(train(small_job, config, job / "missing_run", "--max-steps", "1"), timeout=300)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "failed on ranks [0, 1]" in output and "cluster_sampling.target.data: no file or folder at" in output
    assert not (job / "missing_analysis").exists() and not (job / "missing_run" / "plan").exists()
