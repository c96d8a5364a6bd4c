"""The quality benchmark (bench/quality.py and its harness, bench/harness/): end to end on a tiny mixture (one 2-rank
DeepSpeed job, the gate, the report), the real-data arms' job spec, the typed arms against the spec's JSON, the
near-duplicate arm's rule, and the gzipped data path.

One epoch cannot pass the calibration gate, so the end-to-end test also checks the rule that matters
most: a run that misses the gate says so and stops before any method comparison.
"""
from __future__ import annotations

import gzip
import json
import math
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from bench.toy.tasks import write_mixture

REPO = Path(__file__).resolve().parents[1]


def _settings(argv: list[str]):
    from bench import quality

    settings = quality.settings_from_args(quality.parse_args(argv), argv)
    settings.work_dir.mkdir(parents=True, exist_ok=True)
    return settings


def _spec(settings) -> dict:
    from bench.harness.builders import build_arms
    from bench.harness.data import prepare_data
    from bench.harness.launch import write_spec

    data = prepare_data(settings)
    arms, analyses = build_arms(settings, data)
    return json.loads(Path(write_spec(settings, data, arms, analyses)).read_text())


def _arm(setting: str, seed: int, method: str = "random", fraction=0.3, analysis: str = "one_cluster", **fields):
    """A typed arm for the summary's tests (its block and epochs as the builders would give them)."""
    from bench.harness.arms import Arm

    return Arm(name=f"{setting}_s{seed}", setting=setting, method=method, seed=seed, analysis=analysis,
               fraction=fraction, cluster_sampling={"seed": seed}, epochs=2, **fields)


def _real_slice(folder: Path, train_per_family: int = 40, heldout_per_family: int = 4) -> Path:
    """A few records per family of the shipped T0 slice, gzipped like the shipped files."""
    from ds_cluster.data.dataset import read_jsonl
    from bench.real import T0_DIR

    folder.mkdir(parents=True, exist_ok=True)
    for name, per_family in (("train", train_per_family), ("heldout", heldout_per_family)):
        taken: dict[str, int] = defaultdict(int)
        kept = []
        for record in read_jsonl(T0_DIR / f"{name}.jsonl.gz"):
            if taken[record["family"]] < per_family:
                taken[record["family"]] += 1
                kept.append(record)
        with gzip.open(folder / f"{name}.jsonl.gz", "wt", encoding="utf-8") as handle:
            handle.writelines(json.dumps(record) + "\n" for record in kept)
    return folder


@pytest.mark.integration
def test_a_run_that_misses_the_gate_says_so_and_stops(tmp_path):
    write_mixture(tmp_path / "data", seed=5, total=240, heldout_per_family=3)
    command = [sys.executable, str(REPO / "bench" / "quality.py"), "--synthetic", "--data", str(tmp_path / "data"),
               "--work-dir", str(tmp_path / "work"), "--results-dir", str(tmp_path / "results"),
               "--name", "tiny", "--seeds", "1", "--test-epochs", "1"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=420)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "calibration gate: FAILED" in result.stdout
    gate = json.loads((tmp_path / "work" / "gate.json").read_text())
    assert not gate["passed"] and set(gate["checks"]) == {
        "copy_probe", "full_every_family", "full_plateau", "random30_loses_on_a_small_family"}
    assert gate["checks"]["copy_probe"]["passed"]  # the shipped base model copies
    # Only the two gate arms ran: no method was compared on an instrument that failed its gate.
    assert sorted(p.stem for p in (tmp_path / "work" / "arms").iterdir()) == ["full_s0", "random_f0.3_s0"]
    report = (tmp_path / "results" / "tiny.md").read_text()
    assert "calibration gate: FAILED" in report
    # The next recipe is chosen on validation: the report of a missed gate shows no held-out figure.
    results = json.loads((tmp_path / "results" / "tiny.json").read_text())
    assert "heldout" not in report and "heldout" not in json.dumps(results)
    assert all("heldout" in json.loads(p.read_text()) for p in (tmp_path / "work" / "arms").iterdir())
    assert (tmp_path / "results" / "tiny.png").stat().st_size > 0
    validation = json.loads((tmp_path / "work" / "data" / "validation.jsonl").read_text().splitlines()[0])
    train = (tmp_path / "work" / "data" / "train.jsonl").read_text()
    assert json.dumps(validation) not in train  # validation is carved out of train


def test_base_model_flag_reaches_the_job_spec(tmp_path):
    """--base-model DIR is the checkpoint every arm loads; without it, stories260K, or the toy model with
    --synthetic."""
    from bench.real import STORIES260K_DIR
    from bench.toy.models import base_model_path

    write_mixture(tmp_path / "data", seed=5, total=240, heldout_per_family=3)
    for flags, expected in ((["--base-model", str(tmp_path / "other")], str(tmp_path / "other")),
                            ([], str(STORIES260K_DIR)), (["--synthetic"], base_model_path())):
        argv = ["--data", str(tmp_path / "data"), "--work-dir", str(tmp_path / f"work{len(flags)}"),
                "--gate-only", *flags]
        assert _spec(_settings(argv))["base_model"] == expected


def test_arms_flag_runs_only_the_named_arms_beside_full_data(tmp_path):
    """--arms random,recommended --no-ablations: full data and those arms on every seed and fraction, nothing else."""
    from bench import quality
    from bench.harness.builders import build_arms
    from bench.harness.data import prepare_data

    write_mixture(tmp_path / "data", seed=5, total=240, heldout_per_family=3)
    argv = ["--data", str(tmp_path / "data"), "--work-dir", str(tmp_path / "work"),
            "--arms", "random,recommended", "--no-ablations"]
    settings = _settings(argv)
    arms, _ = build_arms(settings, prepare_data(settings))
    assert {arm.method for arm in arms} == {"full", "random", "recommended"}
    assert len([arm for arm in arms if arm.method == "recommended"]) == len(settings.seeds) * len(settings.fractions)
    with pytest.raises(SystemExit, match="oracel"):
        quality.settings_from_args(quality.parse_args(["--arms", "random,oracel"]), [])


def test_real_data_arms_job_spec(tmp_path):
    """The default instrument: stories260K, every arm at 30% and 50% on 4 seeds, features extracted once per
    feature model, exact match on the label families, SmolLM2's arms only with its checkpoint."""
    from dataclasses import replace

    from bench.harness.data import categorical_families, prepare_data
    from bench.harness.instrument import REAL_ARMS, SMOLLM2_FEATURE_MAX_LENGTH, with_feature_models
    from ds_cluster.data.dataset import read_jsonl
    from bench.real import STORIES260K_DIR, T0_DIR

    data = _real_slice(tmp_path / "t0")
    settings = _settings(["--data", str(data), "--work-dir", str(tmp_path / "work"), "--equal-steps"])
    assert settings.instrument == "real" and not settings.ablations
    settings = with_feature_models(replace(settings, arms=REAL_ARMS, smollm2=tmp_path / "absent", skipped=()))
    assert "recommended_smollm2" not in settings.arms and "absent" in settings.skipped[0]  # skipped, with why
    spec = _spec(settings)
    assert spec["base_model"] == str(STORIES260K_DIR) and spec["gate"]["kind"] == "real"
    # Judged on the whole train file (a property of the family), not on the carved or sliced split.
    assert spec["exact_match_families"] == categorical_families(read_jsonl(data / "train.jsonl.gz"))
    # The rule on the shipped slice's whole training file: the three label families.
    assert categorical_families(read_jsonl(T0_DIR / "train.jsonl.gz")) == [
        "paraphrase_identification", "sentiment", "topic_classification"]
    # A 7% slice (the SmolLM2 instrument's size) has a few underlying examples per free-text family, each answer
    # among its most frequent: judged on the slice, summaries and closed-book QA would pass for labels.
    sliced = prepare_data(replace(settings, data=T0_DIR, train_fraction=0.07, work_dir=tmp_path / "slice"))
    assert sliced.exact_match_families == ["paraphrase_identification", "sentiment", "topic_classification"]
    assert "summarization" in categorical_families(read_jsonl(sliced.paths["train"]))
    assert spec["skipped"] == list(settings.skipped)
    arms = spec["arms"]
    assert [arm["name"] for arm in arms[:2]] == ["full_s0", "random_f0.3_s0"]  # the gate's arms first
    for method in ("full_cut", "random", "paper", "recommended", "oracle", "neardup"):
        taken = [a for a in arms if a["method"] == method and "steps" not in a["setting"]]
        assert sorted((a["seed"], a["fraction"]) for a in taken) == [
            (seed, fraction) for seed in range(4) for fraction in (0.3, 0.5)], method
    assert sorted(a["setting"] for a in arms if a.get("stretch")) == ["random_steps_f0.3"] * 4 + \
        ["recommended_steps_f0.3"] * 4
    analyses = spec["analyses"]
    # The paper preset reads the paper's proxy; the recommended preset its chosen output-layer gradient.
    assert sorted(name for name, a in analyses.items() if a.get("source")) == [
        "features_own_lm_head", "features_own_proxy"]
    clustering = {name: a for name, a in analyses.items() if a.get("features")}
    assert len(clustering) == 8
    assert {a["features"] for name, a in clustering.items() if name.startswith("paper_")} == {"features_own_proxy"}
    assert {a["features"] for name, a in clustering.items() if not name.startswith("paper_")} == {
        "features_own_lm_head"}
    neardup = [a for a in arms if a["method"] == "neardup"]
    assert all(analyses[a["analysis"]]["seed"] == a["seed"] for a in neardup)
    assert (tmp_path / "work" / "analyses" / "near_duplicates" / "groups.npy").exists()

    # With a SmolLM2 checkpoint folder, its arms read their own features (extracted once, at its own length).
    fake = tmp_path / "smollm2"
    fake.mkdir()
    (fake / "config.json").write_text("{}")
    with_smollm2 = with_feature_models(replace(settings, arms=REAL_ARMS, smollm2=fake, skipped=(), equal_steps=False))
    spec = _spec(with_smollm2)
    smollm2_arms = [a for a in spec["arms"] if a["method"] == "recommended_smollm2"]
    assert len(smollm2_arms) == 8
    assert all(a["cluster_sampling"]["feature_model"] == str(fake) for a in smollm2_arms)
    assert all(a["cluster_sampling"]["feature_kind"] == "proxy" for a in smollm2_arms)  # the candidate measured
    sources = {a["source"]: a for a in spec["analyses"].values() if a.get("source")}
    assert set(sources) == {"own", "smollm2"}
    assert sources["smollm2"]["feature_max_length"] == SMOLLM2_FEATURE_MAX_LENGTH


def test_the_job_spec_is_typed_and_its_gate_reads_its_arms_by_kind_not_by_place(tmp_path):
    from dataclasses import replace

    from bench.harness.spec import GateSpec, JobSpec

    write_mixture(tmp_path / "data", seed=5, total=240, heldout_per_family=3)
    settings = _settings(["--synthetic", "--data", str(tmp_path / "data"), "--work-dir", str(tmp_path / "work")])
    written = _spec(settings)
    spec = JobSpec.from_json(written)
    assert spec.to_json() == written  # the job reads exactly what the parent wrote
    assert [arm.method for arm in spec.arms[:2]] == ["full", "random"]
    assert (spec.gate.full, spec.gate.random, spec.gate_after) == (spec.arms[0].name, spec.arms[1].name,
                                                                   spec.arms[1].name)
    shuffled = list(reversed(spec.arms))
    gate = GateSpec.of(spec.gate.kind, shuffled, spec.gate.small_families, settings.seeds[0])
    assert (gate.full, gate.random) == (spec.gate.full, spec.gate.random)
    assert gate.after(shuffled) == spec.gate.full  # the later of the two in the new order
    with pytest.raises(ValueError, match="needs a random arm"):
        GateSpec.of(spec.gate.kind, [arm for arm in spec.arms if arm.method != "random"], [], settings.seeds[0])
    assert replace(spec, launched_at=1.0).to_json()["launched_at"] == 1.0


def test_gzipped_data_is_read_when_plain_is_absent(tmp_path):
    from bench.harness.data import prepare_data
    from bench.harness.instrument import data_file

    folder = _real_slice(tmp_path / "data", train_per_family=2, heldout_per_family=1)
    assert data_file(folder, "train") == folder / "train.jsonl.gz"
    (folder / "train.jsonl").write_text("")
    assert data_file(folder, "train") == folder / "train.jsonl"  # the plain file wins when both are there
    with pytest.raises(FileNotFoundError, match="validation.jsonl.gz"):
        data_file(folder, "validation")
    settings = _settings(["--data", str(_real_slice(tmp_path / "gz")), "--work-dir", str(tmp_path / "work")])
    data = prepare_data(settings)
    assert data.num_train + sum(1 for _ in open(data.paths["validation"])) == 7 * 40


def test_near_duplicate_selection_is_deterministic_and_removes_exact_duplicates():
    from bench import near_duplicates

    rng = np.random.default_rng(0)
    vocabulary = [f"word{i}" for i in range(500)]
    texts = [" ".join(rng.choice(vocabulary, size=30)) for _ in range(60)]
    texts += texts[:10]  # exact duplicates of records 0..9
    near = texts[10].split()
    near[-1] = "changed"  # one word of 30 changed: Jaccard of the 3-gram sets 27 / 29
    texts.append(" ".join(near))
    records = [{"instruction": text, "input": "", "output": "x", "family": "f"} for text in texts]
    groups = near_duplicates.near_duplicate_groups([near_duplicates.prompt_text(r) for r in records])
    assert all(groups[i] == groups[60 + i] for i in range(10))
    assert groups[10] == groups[70]
    assert len(set(groups[:60].tolist())) == 60  # unrelated texts stay apart
    assert np.array_equal(groups, near_duplicates.near_duplicate_groups(texts))
    for kept in (20, 60, 71):
        first = near_duplicates.select_kept(groups, kept, seed=3)
        assert np.array_equal(first, near_duplicates.select_kept(groups, kept, seed=3))
        assert first.size == kept and np.unique(first).size == kept
        if kept <= 60:  # one representative per group while the kept count allows
            assert np.unique(groups[first]).size == kept
            assert len({texts[i] for i in first}) == kept  # no exact duplicate kept
    assert not np.array_equal(near_duplicates.select_kept(groups, 20, seed=3),
                              near_duplicates.select_kept(groups, 20, seed=4))


def test_real_gate_and_time_to_target():
    from bench.harness.gate import real_gate
    from bench.harness.report import gate_text
    from bench.harness.summary import time_to_target

    base = {"validation": {"loss": {"a": 4.0, "b": 6.0}}}
    curve = [{"epoch": 1, "loop": {"cpu": 10.0, "wall": 5.0}, "loss": {"a": 2.2, "b": 3.2}},
             {"epoch": 2, "loop": {"cpu": 20.0, "wall": 10.0}, "loss": {"a": 2.0, "b": 3.0}}]
    full = {"validation": {"loss": {"a": 2.0, "b": 3.0}}, "validation_loss_per_epoch": [p["loss"] for p in curve],
            "validation_curve": curve}
    random30 = {"validation": {"loss": {"a": 2.2, "b": 3.4}}}
    gate = real_gate(base, full, random30)
    assert gate["checks"]["full_learns"]["passed"]  # 5.0 -> 2.5
    assert not gate["checks"]["full_plateau"]["passed"]  # 2.7 -> 2.5 is 7.4%
    assert gate["checks"]["random30_worse_than_full"]["passed"] and not gate["passed"]
    assert gate_text(gate).splitlines()[0].startswith("calibration gate: FAILED (real instrument")
    assert "last epoch 7.41%, falling (< 2%" in gate_text(gate)  # still learning, not overfitting
    rising = real_gate(base, {**full, "validation_loss_per_epoch": [p["loss"] for p in reversed(curve)]}, random30)
    assert "last epoch 8.00%, rising (< 2%" in gate_text(rising)
    synthetic = {"kind": "synthetic", "passed": True, "checks": {
        "copy_probe": {"value": 1.0}, "full_every_family": {"value": 0.9, "worst_family": "a"},
        "full_plateau": {"value": 0.01, "per_epoch_macro_loss": [0.30, 0.31]},
        "random30_loses_on_a_small_family": {"exact_match_drop": {"a": 0.2}, "loss_margin": {"a": 0.1}}}}
    assert "over the last epoch 0.0100, rising (< " in gate_text(synthetic)
    # Target 2.5 + 0.05 x 2.5 = 2.625: the first epoch (2.7) misses it, the second reaches it.
    reached = time_to_target(full, base, full, {"cpu": 1.0, "wall": 1.0}, {"cpu": 2.0, "wall": 2.0})
    assert reached["reached"] and reached["epoch"] == 2 and reached["cpu"] == 23.0
    assert not time_to_target({"validation_curve": curve[:1]}, base, full, {"cpu": 0, "wall": 0},
                              {"cpu": 0, "wall": 0})["reached"]


# The real instrument's --ablations rows at 30% (bench/harness/builders.py real_ablations): setting -> the random subset
# that keeps its count (random_f0.3: the paper arm's count; random_as_SETTING: matched to its own clustering).
REAL_ABLATION_ROWS = {
    "paper_f0.3_weighting-none": "random_f0.3",
    "paper_f0.3_selection-random": "random_f0.3",
    "paper_f0.3_selection-core": "random_f0.3",
    "paper_f0.3_allocation-stratified": "random_f0.3",
    "paper_f0.3_num_clusters-4_allocation-stratified": "random_as_paper_f0.3_num_clusters-4_allocation-stratified",
    "paper_f0.3_num_clusters-8_allocation-stratified": "random_as_paper_f0.3_num_clusters-8_allocation-stratified",
    "paper_f0.3_capacity_factor-None": "random_as_paper_f0.3_capacity_factor-None",
    "paper_f0.3_num_clusters-8_allocation-stratified_capacity_factor-None":
        "random_as_paper_f0.3_num_clusters-8_allocation-stratified_capacity_factor-None",
    "recommended_f0.3_loss_reduction-sample": "random_f0.3",
}
RATIO_ROWS = {f"paper_budget_ratio-{r}": f"random_as_paper_budget_ratio-{r}" for r in ("0.25", "0.5", "0.75")}


def _kept(arm: dict, spec: dict, sizes: dict) -> int:
    """The count an arm keeps once the job has resolved its match (bench/harness/job.py resolve_arm), with
    `sizes` as every clustering's cluster sizes: a paper arm by its budget rule, any other by budget_samples."""
    from bench.harness.arms import Arm
    from bench.harness.job import resolve_arm
    from bench.harness.spec import JobSpec
    from ds_cluster.planning.budget import cluster_budgets

    block, _, kept = resolve_arm(Arm.from_json(arm), JobSpec.from_json(spec))
    if arm["method"] != "paper":
        return kept
    return int(cluster_budgets(np.array(sizes[arm["analysis"]]), "min", block["budget_ratio"]).sum())


def test_real_ablations_job_spec(tmp_path):
    """--ablations on the real instrument: every ablation row on each of the 4 seeds at 30%, each beside a random
    subset of exactly its kept count and seed; a K or capacity change clusters anew, the rest read the paper's."""
    data = _real_slice(tmp_path / "t0")
    argv = ["--data", str(data), "--arms", "random,paper,recommended"]
    settings = _settings(argv + ["--work-dir", str(tmp_path / "work"), "--ablations", "--name", "quality_ablations"])
    assert settings.instrument == "real" and settings.ablations and settings.ablation_ratios == (0.25, 0.5, 0.75)
    spec = _spec(settings)
    arms, analyses = spec["arms"], spec["analyses"]
    assert len({arm["name"] for arm in arms}) == len(arms)
    by_setting: dict[str, dict[int, dict]] = defaultdict(dict)
    for arm in arms:
        by_setting[arm["setting"]][arm["seed"]] = arm
    # Cluster sizes as the job's k-means would write them: K = 8 with a small cluster, so its arm keeps less
    # than 30% and only a random subset matched to its own clustering keeps as many.
    sizes = {}
    for name, analysis in analyses.items():
        if analysis.get("features"):
            k = analysis["cluster_sampling"]["num_clusters"]
            sizes[name] = {"auto": [130, 70], 4: [80, 60, 40, 20], 8: [60, 40, 30, 20, 20, 15, 10, 5]}[k]
            Path(analysis["path"]).mkdir(parents=True, exist_ok=True)
            (Path(analysis["path"]) / "summary.json").write_text(json.dumps({"cluster_sizes": sizes[name]}))
    kept_counts = set()
    for setting, partner in REAL_ABLATION_ROWS.items():
        assert sorted(by_setting[setting]) == [0, 1, 2, 3], setting
        for seed, arm in by_setting[setting].items():
            assert arm["fraction"] == 0.3 and (arm.get("baseline") or "random_f0.3") == partner
            assert by_setting[partner][seed]["method"] == "random"
            kept = _kept(arm, spec, sizes)
            assert kept == _kept(by_setting[partner][seed], spec, sizes), (setting, seed)
            kept_counts.add(kept)
    assert len(kept_counts) > 1  # some rows keep another count than the paper arm: their own random subsets
    for seed in range(4):
        paper = by_setting["paper_f0.3"][seed]
        for setting in REAL_ABLATION_ROWS:  # what each row changes of the paper preset, and its clustering
            block = by_setting[setting][seed]["cluster_sampling"]
            assert block["seed"] == seed and (setting.startswith("recommended") or block["preset"] == "paper")
        for setting in ("weighting-none", "selection-random", "selection-core", "allocation-stratified"):
            assert by_setting[f"paper_f0.3_{setting}"][seed]["analysis"] == paper["analysis"] == f"paper_s{seed}"
        for k in (4, 8):
            analysis = analyses[by_setting[f"paper_f0.3_num_clusters-{k}_allocation-stratified"][seed]["analysis"]]
            assert analysis["cluster_sampling"]["num_clusters"] == k and analysis["cluster_sampling"]["seed"] == seed
        uncapped = analyses[by_setting["paper_f0.3_capacity_factor-None"][seed]["analysis"]]["cluster_sampling"]
        assert uncapped["capacity_factor"] is None and uncapped["num_clusters"] == "auto"
        uncapped_k8 = analyses[by_setting["paper_f0.3_num_clusters-8_allocation-stratified_capacity_factor-None"][seed]
                               ["analysis"]]["cluster_sampling"]
        assert uncapped_k8["capacity_factor"] is None and uncapped_k8["num_clusters"] == 8
    # The paper's rows read its proxy features; the recommended preset's rows its own (lm_head).
    assert {a["features"] for a in analyses.values()
            if a.get("features") and a["cluster_sampling"].get("preset") == "paper"} == {"features_own_proxy"}
    assert {a["features"] for a in analyses.values()
            if a.get("features") and a["cluster_sampling"].get("preset") != "paper"} == {"features_own_lm_head"}

    # The r-arms: r itself on the paper's clustering, and a random partner whose match names the same analysis
    # and r; the job keeps K x floor(r x smallest cluster) for both.
    rows = defaultdict(dict)
    for arm in arms:
        rows[arm["setting"]][arm["seed"]] = arm
    for setting, partner in RATIO_ROWS.items():
        ratio = float(setting.rsplit("-", 1)[1])
        assert sorted(rows[setting]) == sorted(rows[partner]) == [0, 1, 2, 3]
        for seed, arm in rows[setting].items():
            assert arm["cluster_sampling"]["budget_ratio"] == ratio and "match" not in arm
            assert arm["analysis"] == f"paper_s{seed}" and arm["baseline"] == partner
            assert rows[partner][seed]["match"] == {"analysis": f"paper_s{seed}", "budget_ratio": ratio}
            assert _kept(rows[partner][seed], spec, sizes) == _kept(arm, spec, sizes) == 2 * math.floor(ratio * 70)

    # Without --ablations, none of them.
    plain = _spec(_settings(argv + ["--work-dir", str(tmp_path / "plain")]))
    assert not {arm["setting"] for arm in plain["arms"]} & (set(REAL_ABLATION_ROWS) | set(RATIO_ROWS))
    assert not any("baseline" in arm for arm in plain["arms"])
    assert not any(name.startswith("k_num_clusters") or "capacity" in name for name in plain["analyses"])


def test_synthetic_ablations_are_unchanged(tmp_path):
    """The synthetic instrument keeps its three ablation rows on its first 2 seeds (its results depend on them)."""
    write_mixture(tmp_path / "data", seed=5, total=240, heldout_per_family=3)
    spec = _spec(_settings(["--synthetic", "--data", str(tmp_path / "data"), "--work-dir", str(tmp_path / "work")]))
    rows = {"paper_f0.3_weighting-none", "paper_f0.3_selection-random", "recommended_f0.3_loss_reduction-sample"}
    assert sorted((a["setting"], a["seed"]) for a in spec["arms"] if a["setting"] in rows or "baseline" in a) == \
        sorted((row, seed) for row in rows for seed in (0, 1))
    assert {a["analysis"] for a in spec["arms"] if a["setting"].startswith("paper_f0.3_")} == {"paper_s0", "paper_s1"}
    # Its preset and its candidates were chosen on the proxy features and keep them, so its figures reproduce.
    assert {name for name, a in spec["analyses"].items() if a.get("source")} == {"features_own_proxy"}
    choose = _spec(_settings(["--synthetic", "--choose", "--data", str(tmp_path / "data"),
                              "--work-dir", str(tmp_path / "choose")]))
    assert {name for name, a in choose["analyses"].items() if a.get("source")} == {"features_own_proxy"}


def test_report_pairs_an_ablation_with_its_own_random_subset(tmp_path):
    """An arm naming a `baseline` is paired with that random subset, not with random_fF; the partner itself is
    no row of the minus-random table."""
    from bench.harness.summary import summarize
    from bench.harness.tables import paired_table

    def result(arm, loss: float) -> dict:
        timing = {"wall": 1.0, "cpu": 2.0}
        return {"arm": arm.to_json(), "kept_fraction": 0.2, "steps": 10, "time": {"loop": timing, "evaluation": timing},
                "validation": {"loss": {"a": loss, "b": loss + 1.0}}}

    k4 = "paper_f0.3_num_clusters-4_allocation-stratified"
    partner = REAL_ABLATION_ROWS[k4]
    arms, results = [], {}
    for seed in (0, 1, 2):
        for setting, method, loss, baseline, changes in (
                ("random_f0.3", "random", 3.0, None, ()),
                (k4, "paper", 2.0 + seed, partner, (("num_clusters", 4), ("allocation", "stratified"))),
                (partner, "random", 2.5, partner, ())):
            arm = _arm(setting, seed, method, baseline=baseline, changes=changes)
            arms.append(arm)
            results[arm.name] = result(arm, loss)
    summary = summarize(arms, results, tmp_path, "validation")
    assert summary["settings"][k4]["vs_random"]["loss_macro"]["mean"] == pytest.approx(0.5)  # 3.0 - 2.5, not - 3.0
    assert "vs_random" not in summary["settings"][partner]
    table = paired_table(summary, sorted(summary["settings"]))
    assert f"| {k4} | 3 |" in table and f"| {partner} |" not in table


def test_runs_on_one_mixture_share_its_feature_extractions(tmp_path):
    """With features_cache set, the default run, --choose and --ablations on the same mixture read one feature
    folder per feature model (extracted once, its cost charged in each); another max length is another folder."""
    from dataclasses import replace

    data = _real_slice(tmp_path / "t0")
    cache = tmp_path / "cache"

    def feature_paths(*argv: str, **changes) -> dict[str, str]:
        settings = replace(_settings(["--data", str(data), *argv]), **{"features_cache": cache, **changes})
        analyses = _spec(settings)["analyses"]
        return {name: a["path"] for name, a in analyses.items() if name.startswith("features_")}

    default = feature_paths("--work-dir", str(tmp_path / "a"))
    choose = feature_paths("--work-dir", str(tmp_path / "b"), "--choose")
    assert default["features_own_proxy"] == choose["features_own_proxy"]
    assert all(Path(path).parent == cache for path in {**default, **choose}.values())
    assert "features_own_lm_head" in choose and choose["features_own_lm_head"] != choose["features_own_proxy"]
    other = feature_paths("--work-dir", str(tmp_path / "c"), max_length=96)
    assert other["features_own_proxy"] != default["features_own_proxy"]
    plain = feature_paths("--work-dir", str(tmp_path / "d"), features_cache=None)
    assert Path(plain["features_own_proxy"]).parent == tmp_path / "d" / "analyses"


def test_a_clustering_shared_by_several_candidates_keeps_features_for_the_one_that_reads_them(tmp_path):
    """--choose: K 8's clustering is shared by random, spread, kcenter and semdedup candidates; the first to
    claim it reads no features, yet kcenter and semdedup need features.npy in it."""
    from ds_cluster.planning.selection import SELECTIONS

    data = _real_slice(tmp_path / "t0")
    spec = _spec(_settings(["--data", str(data), "--work-dir", str(tmp_path / "w"), "--choose"]))
    needing = {arm["analysis"] for arm in spec["arms"]
               if SELECTIONS.get_rule(arm.get("cluster_sampling", {}).get("selection", "random")).reads_features}
    assert needing, "the declared candidates include a selection that reads features"
    assert all(spec["analyses"][name].get("keep_features") for name in needing)
    others = {arm["analysis"] for arm in spec["arms"]} - needing
    assert not any(spec["analyses"][name].get("keep_features") for name in others)


def test_real_goals_judge_worst_group_neardup_and_the_other_fraction_by_their_intervals():
    """Issue-level goals on real data: worse beyond the noise fails, inside the noise holds; beating near-duplicate
    removal needs the whole interval below 0; the headline fraction alone needs macro strictly below random."""
    from types import SimpleNamespace

    from bench.harness.goals import evaluate_goals

    def stat(mean, ci):
        return {"mean": mean, "ci": ci, "n": 4}

    def entry(macro, worst, neardup):
        return {"ratio_total_cpu": stat(0.3, 0.01), "kept_fraction": stat(0.3, 0.0), "em_macro": stat(0.1, 0.0),
                "vs_random": {"loss_macro": stat(*macro), "loss_worst": stat(*worst)},
                "vs_neardup": {"loss_macro": stat(*neardup)}}

    summary = {"settings": {"full": {"em_macro": stat(0.3, 0.0)},
                            "recommended_f0.3": entry((-0.05, 0.04), (0.03, 0.05), (-0.05, 0.06)),
                            "recommended_f0.5": entry((0.05, 0.04), (0.10, 0.05), (-0.05, 0.04))}}
    settings = SimpleNamespace(instrument="real", fractions=(0.3, 0.5), headline_fraction=0.3)
    met = {row["goal"]: row["met"] for row in evaluate_goals(summary, settings)}
    assert met["recommended preset, 30% kept: macro answer loss below random's (95% CI of the paired difference < 0)"]
    assert met["recommended preset, 30% kept: worst-group answer loss no worse than random's beyond the noise"]
    assert not met["recommended preset, 30% kept: macro answer loss below near-duplicate removal's (95% CI of the "
                   "paired difference < 0)"]
    assert not met["recommended preset, 50% kept: macro answer loss no worse than random's beyond the noise"]
    assert not met["recommended preset, 50% kept: worst-group answer loss no worse than random's beyond the noise"]
    assert met["recommended preset, 50% kept: macro answer loss below near-duplicate removal's (95% CI of the "
               "paired difference < 0)"]
    assert "recommended preset, 30% kept: macro answer loss no worse than random's beyond the noise" not in met
    synthetic = evaluate_goals(summary, SimpleNamespace(instrument="synthetic", fractions=(0.3,),
                                                        headline_fraction=0.3))
    assert not any("near-duplicate" in row["goal"] for row in synthetic)


def test_the_automatic_budget_is_judged_against_full_data_only_with_an_interval_and_on_its_own_time_goal():
    """budget_ratio auto: within the noise of full data needs at least 2 paired seeds (one seed has no interval, so
    the goal is not met and says why); its time goal is the instrument's (0.5, the capable model's 0.6)."""
    from types import SimpleNamespace

    from bench.harness.goals import evaluate_goals

    def auto_rows(seeds: int, ratio: float, **instrument) -> dict[str, tuple[bool, str]]:
        summary = {"settings": {"auto": {
            "vs_full": {"loss_macro": {"mean": 0.01, "ci": 0.05 if seeds > 1 else float("nan"), "n": seeds}},
            "ratio_total_cpu": {"mean": ratio, "ci": 0.01, "n": seeds}, "kept_fraction": {"mean": 0.5}}}}
        settings = SimpleNamespace(instrument="real", fractions=(0.3,), headline_fraction=0.3, **instrument)
        return {row["goal"].split(": ", 1)[1]: (row["met"], row["measured"])
                for row in evaluate_goals(summary, settings) if "budget_ratio auto" in row["goal"]}

    within = "macro answer loss within the noise of full data's or below (the paired interval reaches 0)"
    assert auto_rows(3, 0.55)[within][0] and not auto_rows(3, 0.55)["total CPU time <= 0.5 of full data"][0]
    assert auto_rows(3, 0.55, auto_time_goal=0.6)["total CPU time <= 0.6 of full data"][0]
    met, measured = auto_rows(1, 0.55, auto_time_goal=0.6)[within]
    assert not met and "one paired seed: no interval, not judged" in measured


def test_ablations_are_read_beside_the_papers_claims():
    """Each ablation is a paired difference over shared seeds, read as claimed, the opposite, within the noise, or
    identical (a change that left the subset as it was); a comparison missing a side is left out."""
    from bench.harness.ablations import ablation_rows
    from bench.harness.tables import ablation_table

    losses = {  # setting -> macro held-out loss per seed (two families: loss and loss + 1)
        "paper_f0.3": [2.0, 2.1, 2.2, 2.3],
        "paper_f0.3_weighting-none": [2.2, 2.3, 2.4, 2.5],  # weighting helps: as claimed
        "paper_f0.3_selection-random": [1.8, 1.9, 2.0, 2.1],  # peripheral worse than random: the opposite
        "paper_f0.3_selection-core": [1.9, 1.8, 2.1, 2.0],  # random minus core: +0.1, -0.1, ...: within the noise
        "paper_f0.3_capacity_factor-None": [2.0, 2.1, 2.2, 2.3],  # the cap did not bind
        "full": [1.5, 1.5, 1.5],  # seed 3 missing: r = 0.25 is paired over three seeds
        "paper_budget_ratio-0.25": [2.5, 2.6, 2.4, 2.5],
    }
    arms, results = [], {}
    for setting, per_seed in losses.items():
        for seed, loss in enumerate(per_seed):
            arm = _arm(setting, seed)
            arms.append(arm)
            results[arm.name] = {"arm": arm.to_json(), "heldout": {"loss": {"a": loss, "b": loss + 1.0}}}
    by_first_second = {(row["first"], row["second"]): row for row in ablation_rows(arms, results, "heldout", 0.3)}
    weighting = by_first_second[("paper_f0.3", "paper_f0.3_weighting-none")]
    assert weighting["loss_macro"]["mean"] == pytest.approx(-0.2) and weighting["reading"] == "as claimed"
    assert by_first_second[("paper_f0.3", "paper_f0.3_selection-random")]["reading"] == "the opposite, beyond the noise"
    core = by_first_second[("paper_f0.3_selection-random", "paper_f0.3_selection-core")]
    assert core["reading"] == "within the noise"
    capacity = by_first_second[("paper_f0.3", "paper_f0.3_capacity_factor-None")]
    assert capacity["reading"] == "identical runs: the change did not alter the subset"
    ratio = by_first_second[("paper_budget_ratio-0.25", "full")]
    assert ratio["loss_macro"]["n"] == 3 and ratio["loss_macro"]["mean"] == pytest.approx(1.0)
    assert ratio["reading"] == "first higher beyond the noise"  # "gentle" is a size: no direction to judge
    # Comparisons with a side that never ran (K, allocation, the other r, the loss reduction) are left out.
    assert len(by_first_second) == 5
    table = ablation_table(list(by_first_second.values()))
    assert table.count("\n") == 6 and "weighting helps" in table and "peripheral beats random" in table


def test_each_arm_is_charged_the_start_up_of_the_job_that_trained_it(tmp_path):
    """A run resumed by a later job (equal steps, ablations) keeps the figures of the arms it did not retrain:
    each arm carries its own job's start-up; an arm without one is charged the work folder's."""
    from bench.harness.summary import summarize

    (tmp_path / "startup.json").write_text(json.dumps({"cpu": 50.0, "wall": 40.0}))
    arms, results = [], {}
    for setting, method, fraction, loop_cpu, startup in (("full", "full", None, 100.0, {"cpu": 20.0, "wall": 10.0}),
                                                          ("random_f0.3", "random", 0.3, 30.0, None)):
        arm = _arm(setting, 0, method, fraction)
        timing = {"wall": loop_cpu / 2, "cpu": loop_cpu}
        arms.append(arm)
        results[arm.name] = {"arm": arm.to_json(), "kept_fraction": fraction or 1.0, "steps": 10,
                                "time": {"loop": timing, "evaluation": timing},
                                "validation": {"loss": {"a": 1.0}}, **({"startup": startup} if startup else {})}
    summary = summarize(arms, results, tmp_path, "validation")
    # random: the folder's 50 + 30 loop; full: its own 20 + 100 loop.
    assert summary["settings"]["random_f0.3"]["ratio_total_cpu"]["mean"] == pytest.approx(80.0 / 120.0)
    assert summary["job_startups"] == [(20.0, 10.0), (50.0, 40.0)]


def test_each_feature_source_is_reported_with_its_cost_share_and_purity(tmp_path):
    """The results file gives every feature source's selection cost as a share of full data's run on the same
    seed, and its k-means purity against the task groups, from the analyses the arms read."""
    from bench.harness.summary import feature_sources, summarize
    from bench.harness.tables import feature_source_table

    (tmp_path / "startup.json").write_text(json.dumps({"cpu": 20.0, "wall": 10.0}))
    arms, results = [], {}
    for setting, method, analysis, source, purity in (("full", "full", "one_cluster", None, None),
                                                      ("recommended_f0.3", "recommended", "k_own", "own", 0.5),
                                                      ("recommended_small_f0.3", "recommended_small", "k_small",
                                                       "small", 0.75)):
        arm = _arm(setting, 0, method, None if setting == "full" else 0.3, analysis, source=source or "own")
        arms.append(arm)
        results[arm.name] = {"arm": arm.to_json(), "kept_fraction": 1.0, "steps": 10,
                                "time": {"loop": {"cpu": 180.0, "wall": 90.0}, "evaluation": {"cpu": 1.0, "wall": 1.0}},
                                "validation": {"loss": {"a": 1.0}}}
        if source:
            folder = tmp_path / "analyses" / analysis
            folder.mkdir(parents=True)
            cost = 40.0 if source == "own" else 2.0
            (folder / "cost.json").write_text(json.dumps({"cpu": cost, "wall": cost / 2, "extract_cpu": cost - 1.0,
                                                          "cluster_cpu": 1.0, "source": source}))
            (folder / "summary.json").write_text(json.dumps({"purity": purity, "num_clusters": 8}))
    summary = summarize(arms, results, tmp_path, "validation")
    costs = {arm.analysis: json.loads((tmp_path / "analyses" / arm.analysis / "cost.json").read_text())
             for arm in arms if arm.analysis != "one_cluster"}
    rows = {row["source"]: row for row in feature_sources(tmp_path, arms, summary, costs, {"own": "m/smollm2"})}
    # Full data's whole run: 20 start-up + 180 loop CPU s.
    assert rows["own"]["share_of_full"] == pytest.approx(40.0 / 200.0) and rows["own"]["purity"] == 0.5
    assert rows["small"]["share_of_full"] == pytest.approx(2.0 / 200.0) and rows["small"]["purity"] == 0.75
    assert "| own | `smollm2` | 1 | 39.0 | 1.0 | 0.200 | 0.500 | 8 |" in feature_source_table(list(rows.values()))


def test_the_smollm2_instrument_runs_its_chosen_recipe_and_names_each_mode_apart(tmp_path):
    """--model smollm2: the power candidate the declared rule kept (bench/candidates.json's "smollm2_power"), every
    held-out record, the arms its issue asks for with full data and the automatic budget on the first seed, and a
    results file of its own per mode (a gate or quick run never overwrites the grid's)."""
    from bench.harness.builders import build_arms
    from bench.harness.data import prepare_data
    from bench.harness.instrument import ADAPTIVE_PRESET, AUTO_PRESET

    chosen = json.loads((REPO / "bench" / "candidates.json").read_text())["smollm2_power"]["b8_slice10_e3_lr3e-5"]
    work = ["--work-dir", str(tmp_path / "work")]
    settings = _settings(["--model", "smollm2", *work])
    assert {key: getattr(settings, key) for key in chosen} == chosen
    assert settings.heldout_per_family is None and settings.precision == "bf16" and settings.time_goal == 0.33
    assert settings.auto_time_goal == 0.6  # issue 42's bound on the automatic budget's time
    assert settings.seeds == (0, 1, 2) and settings.full_seeds == 1
    assert set(settings.arms) == {"full_cut", "random", "recommended", "recommended_small", "adaptive", "auto"}
    # Its 93-step arms close the benchmark's chosen adaptive window (20 steps) four times: no special preset.
    assert settings.adaptive == ADAPTIVE_PRESET and settings.auto == AUTO_PRESET
    names = {mode: _settings(["--model", "smollm2", *work, *flags]).results_name
             for mode, flags in (("grid", []), ("quick", ["--quick"]), ("gate", ["--gate-only"]))}
    assert names == {"grid": "quality_smollm2", "quick": "quality_smollm2_quick", "gate": "quality_smollm2_gate"}
    quick = _settings(["--model", "smollm2", "--quick", *work])
    assert quick.seeds == (0,) and quick.fractions == (0.3,) and set(quick.arms) == {"random", "recommended_small"}
    # A smoke run on the recipe before issue 42 (7% slice, global batch 32), whose gate passes in ~6 min.
    assert (quick.train_fraction, quick.micro_batch_size, quick.gradient_accumulation_steps) == (0.07, 8, 2)
    assert quick.learning_rate == 1e-4 and quick.heldout_per_family == 40
    # The grid's arms on a small mixture: full data and the automatic budget beside it on seed 0 only.
    write_mixture(tmp_path / "data", seed=5, total=240, heldout_per_family=3)
    small = _settings(["--model", "smollm2", "--data", str(tmp_path / "data"), *work, "--recipe",
                       "train_fraction=1.0"])
    arms, _ = build_arms(small, prepare_data(small))
    assert sorted((arm.method, arm.seed) for arm in arms if arm.method in ("full", "auto")) == [("auto", 0),
                                                                                                ("full", 0)]
    assert sorted(arm.seed for arm in arms if arm.setting == "adaptive_f0.3") == [0, 1, 2]


def test_a_chat_record_of_the_benchmark_keeps_its_metadata_prompt_and_reference_answer():
    from bench import near_duplicates
    from bench.harness.data import to_chat_record

    record = {"instruction": "Is this review positive?", "input": "A fine film.", "output": "yes",
              "family": "sentiment", "example_id": "x1"}
    chat = to_chat_record(record)
    assert chat["messages"] == [{"role": "user", "content": "Is this review positive?\nA fine film."},
                                {"role": "assistant", "content": "yes"}]
    assert (chat["family"], chat["example_id"], chat["output"]) == ("sentiment", "x1", "yes")
    # Near-duplicate groups and the report read the same prompt text from either form.
    assert near_duplicates.prompt_text(chat) == near_duplicates.prompt_text(record)


def test_the_overhead_choice_runs_its_declared_list_and_only_picks_a_setting_under_the_limit(tmp_path):
    from bench.harness.choice import choose
    from bench.harness.report import choice_lines

    def adaptive_choice_lines(*arguments) -> list[str]:  # the declared rule's decision, as the report writes it
        return choice_lines(choose(*arguments))

    settings = _settings(["--choose-overhead", "--work-dir", str(tmp_path)])
    declared = json.loads((REPO / "bench" / "candidates.json").read_text())["adaptive_overhead"]
    assert settings.results_name == "quality_choose_overhead" and settings.overhead_limit == 0.01
    assert set(settings.candidates) == {name for name in declared if not name.startswith("_")}

    def row(loss: float) -> dict:
        return {"loss_macro": {"mean": loss}}

    summary = {"settings": {"fast_f0.3": row(1.9), "slow_f0.3": row(1.8), "cheaper_f0.3": row(2.0)}}
    candidates = {"fast": {}, "slow": {}, "cheaper": {}}
    shares = {"fast_f0.3": [0.008, 0.009], "slow_f0.3": [0.02, 0.02], "cheaper_f0.3": [0.004, 0.005]}
    # The lowest loss (slow) costs 2%: the lowest loss among those under 1% is chosen.
    lines = adaptive_choice_lines(summary, candidates, 0.3, shares, 0.01)
    assert "**fast**" in lines[2] and "slow 1.8000 (loader 2.00%)" in lines[2]
    # A mean at the limit is not under it; none under it: the goal is reported as not met.
    lines = adaptive_choice_lines(summary, candidates, 0.3, {k: [0.01, 0.03] for k in shares}, 0.01)
    assert "**none**" in lines[2] and "not met" in lines[2]
    # Without a limit the rule is the earlier one: the lowest loss.
    assert "**slow**" in adaptive_choice_lines(summary, candidates, 0.3)[2]
    # The rule itself returns its decision and the figures it read, no text.
    decision = choose(summary, candidates, 0.3, shares, 0.01).fixed
    assert decision is not None and decision.chosen == "fast" and decision.shares == pytest.approx(
        {"fast": 0.0085, "slow": 0.02, "cheaper": 0.0045}) and decision.losses["slow"] == 1.8


def test_the_auto_overhead_choice_takes_the_fastest_cheap_candidate_within_the_noise_of_full_data(tmp_path):
    from bench.harness.choice import choose
    from bench.harness.report import choice_lines

    def adaptive_choice_lines(*arguments) -> list[str]:  # the declared rule's decision, as the report writes it
        return choice_lines(choose(*arguments))

    settings = _settings(["--choose-auto-overhead", "--work-dir", str(tmp_path)])
    assert settings.results_name == "quality_choose_auto_overhead" and settings.overhead_limit == 0.01
    assert all(block["budget_ratio"] == "auto" for block in settings.candidates.values())

    def row(vs_full: float, ci: float, time: float) -> dict:
        return {"loss_macro": {"mean": 2.0 + vs_full}, "vs_full": {"loss_macro": {"mean": vs_full, "ci": ci}},
                "ratio_total_cpu": {"mean": time}, "kept_fraction": {"mean": 0.9}}

    candidates = {"fast_worse": {"budget_ratio": "auto"}, "level": {"budget_ratio": "auto"},
                  "level_slower": {"budget_ratio": "auto"}, "costly": {"budget_ratio": "auto"}}
    summary = {"settings": {"fast_worse": row(0.05, 0.02, 0.4), "level": row(0.01, 0.02, 0.9),
                            "level_slower": row(-0.01, 0.02, 1.0), "costly": row(-0.02, 0.01, 0.3)}}
    shares = {"fast_worse": [0.005], "level": [0.006], "level_slower": [0.004], "costly": [0.02]}
    # fast_worse is above full data beyond the noise and costly over 1%: the faster of the other two.
    lines = adaptive_choice_lines(summary, candidates, 0.3, shares, 0.01)
    assert "**level**" in lines[2]
    assert choose(summary, candidates, 0.3, shares, 0.01).auto.chosen == "level"
    lines = adaptive_choice_lines(summary, candidates, 0.3, {**shares, "level": [0.02], "level_slower": [0.03]}, 0.01)
    assert "**none**" in lines[2] and "not met" in lines[2]


def test_the_overhead_report_pairs_each_candidate_with_the_first_declared_over_the_same_seeds():
    from bench.harness.report import against_first_candidate_lines as against_first_candidate
    from bench.harness.summary import against_first_candidate as differences_from_the_first

    def result(macro_shift: float) -> dict:
        return {"validation": {"loss": {"a": 1.0 + macro_shift, "b": 2.0 + macro_shift}, "exact_match": {"a": 0.5}}}

    candidates = {"base": {}, "cheap": {}, "auto_one": {"budget_ratio": "auto"}}
    arms = [_arm(f"{kind}_f0.3", seed, kind, candidate=kind) for kind in ("base", "cheap") for seed in (0, 1)]
    # cheap is 0.1 and 0.3 above base on seeds 0 and 1: a paired mean of +0.2 whatever the seeds' own levels.
    results = {"base_f0.3_s0": result(0.0), "base_f0.3_s1": result(5.0),
               "cheap_f0.3_s0": result(0.1), "cheap_f0.3_s1": result(5.3)}
    lines = against_first_candidate(arms, results, candidates, 0.3, "validation")
    assert "minus the first declared (base_f0.3)" in lines[0]
    row = next(line for line in "\n".join(lines).splitlines() if line.startswith("| cheap_f0.3 "))
    assert row.split("|")[2].strip() == "2" and row.split("|")[3].strip().startswith("0.200")
    differences = differences_from_the_first(arms, results, candidates, 0.3, "validation")
    assert differences["base"] == "base_f0.3"
    assert differences["settings"]["cheap_f0.3"]["vs_first"]["loss_macro"]["mean"] == pytest.approx(0.2)
    # One candidate alone has nothing to be paired with.
    assert against_first_candidate(arms[:2], results, candidates, 0.3, "validation") == []
    assert differences_from_the_first(arms[:2], results, candidates, 0.3, "validation") is None


def _frozen_case(name: str, tmp_path: Path) -> tuple[list, list]:
    """tests/fixtures/quality_arms.json's arms of one spec (built by the harness before its arms were typed), and
    the arms the harness builds for the same flags now, paths as the fixture writes them."""
    from dataclasses import replace

    from bench.harness.builders import build_arms
    from bench.harness.data import prepare_data

    frozen = json.loads((REPO / "tests" / "fixtures" / "quality_arms.json").read_text())[name]
    if name == "real":
        data = _real_slice(tmp_path / "t0")
    else:
        data = tmp_path / "toy"
        write_mixture(data, seed=5, total=240, heldout_per_family=3)
    argv = [str(data) if value in ("T0", "TOY") else value for value in frozen["argv"]]
    settings = replace(_settings(argv + ["--work-dir", str(tmp_path / "work")]), features_cache=tmp_path / "cache")
    arms, _ = build_arms(settings, prepare_data(settings))
    built = json.loads(json.dumps([arm.to_json() for arm in arms], default=str).replace(str(REPO), "REPO"))
    return frozen["arms"], built


@pytest.mark.parametrize("name", ["real", "synthetic"])
def test_every_built_arm_is_the_dict_the_spec_held_before_arms_were_typed(name, tmp_path):
    """to_json of every arm, keys in their order, is what the untyped harness wrote in spec.json (one real spec
    with every kind of arm and the ablations, one synthetic); from_json reads it back to the same arm."""
    from bench.harness.arms import Arm

    frozen, built = _frozen_case(name, tmp_path)
    assert [arm["name"] for arm in built] == [arm["name"] for arm in frozen]
    for now, before in zip(built, frozen):
        assert json.dumps(now) == json.dumps(before), now["name"]  # same keys in the same order, same values
    for arm in frozen:
        assert Arm.from_json(arm).to_json() == arm and list(Arm.from_json(arm).to_json()) == list(arm)


def test_an_arm_round_trips_through_its_json_and_carries_what_it_was_built_as(tmp_path):
    """Arm.from_json(arm.to_json()) == arm for every built arm; the partners the summary pairs a setting with come
    from the typed fields (method, fraction, stretch, baseline, changes), never from the name."""
    from bench.harness.arms import Arm
    from bench.harness.builders import build_arms
    from bench.harness.data import prepare_data
    from bench.harness.summary import partners

    data = _real_slice(tmp_path / "t0")
    settings = _settings(["--data", str(data), "--work-dir", str(tmp_path / "work"), "--seeds", "1", "--ablations",
                          "--equal-steps", "--arms", "full_cut,random,paper,recommended,neardup,adaptive,auto"])
    arms, analyses = build_arms(settings, prepare_data(settings))
    for arm in arms:
        assert Arm.from_json(arm.to_json()) == arm
        assert Arm.from_json(json.loads(json.dumps(arm.to_json()))).to_json() == arm.to_json()
    for analysis in analyses.values():
        assert type(analysis).from_json(analysis.to_json()) == analysis
    by_setting = {arm.setting: arm for arm in arms}
    assert by_setting["paper_f0.3_weighting-none"].changes == (("weighting", "none"),)
    assert by_setting["recommended_steps_f0.3"].stretch and by_setting["adaptive_f0.3"].cut
    found = partners(arms)
    assert found["recommended_f0.3"] == type(found["recommended_f0.3"])(
        random="random_f0.3", neardup="neardup_f0.3", full_cut="full_cut_f0.3", recommended=None)
    assert found["recommended_steps_f0.3"].random == "random_steps_f0.3"
    assert found["recommended_steps_f0.3"].neardup is None and found["recommended_steps_f0.3"].full_cut is None
    # The adaptive schedule against the static preset, not its ablation row (which changes its loss reduction).
    assert found["adaptive_f0.3"].recommended == "recommended_f0.3"
    assert found["recommended_f0.3_loss_reduction-sample"].random == "random_f0.3"
    k8 = "paper_f0.3_num_clusters-8_allocation-stratified"
    assert found[k8].random == f"random_as_{k8}" and found[f"random_as_{k8}"].random == f"random_as_{k8}"
    assert found["paper_budget_ratio-0.25"].random == "random_as_paper_budget_ratio-0.25"
    assert found["full"] == type(found["full"])(None, None, None, None) and found["auto"].random is None



def test_a_power_pilot_is_validation_only_with_its_own_seed_count_and_recipe(tmp_path):
    """--model smollm2 --validation-only --seeds 4 --recipe ...: the job evaluates validation only (held-out is never
    seen while choosing), on 4 seeds (not the recipe's 3), with the pilot's batch."""
    write_mixture(tmp_path / "data", seed=5, total=240, heldout_per_family=3)
    argv = ["--model", "smollm2", "--data", str(tmp_path / "data"), "--work-dir", str(tmp_path / "work"),
            "--validation-only", "--seeds", "4", "--arms", "full_cut,random",
            "--recipe", "micro_batch_size=4,gradient_accumulation_steps=1,train_fraction=0.5"]
    settings = _settings(argv)
    assert settings.seeds == (0, 1, 2, 3) and settings.validation_only and settings.train_fraction == 0.5
    spec = _spec(settings)
    assert spec["evaluate_splits"] == ["validation"]
    assert spec["ds_config"]["train_micro_batch_size_per_gpu"] == 4
    assert spec["ds_config"]["gradient_accumulation_steps"] == 1
    assert _settings(argv[:-6] + ["--seeds", "8"]).seeds == tuple(range(8))
    # --full-seeds 1 (the recipe's): full data only on the first seed (the gate's), the subsets' arms on all four.
    from bench.harness.builders import build_arms
    from bench.harness.data import prepare_data

    fewer = _settings(argv + ["--full-seeds", "1"])
    arms, _ = build_arms(fewer, prepare_data(fewer))
    assert [arm.seed for arm in arms if arm.method == "full"] == [0]
    assert sorted(arm.seed for arm in arms if arm.setting == "full_cut_f0.3") == [0, 1, 2, 3]
    every = _settings(argv + ["--full-seeds", "4"])  # the recipe's own is 1
    assert settings.full_seeds == 1
    assert sorted(arm.seed for arm in build_arms(every, prepare_data(every))[0] if arm.method == "full") == [0, 1, 2, 3]
    with pytest.raises(SystemExit, match="--full-seeds"):
        _settings(argv + ["--full-seeds", "5"])
    assert "heldout" in _spec(_settings([a for a in argv if a != "--validation-only"]))["evaluate_splits"]


def test_the_power_projection_rescales_a_pilots_interval_to_more_seeds():
    """A half-width over n seeds is t(n-1) sd / sqrt(n): the projection keeps sd and changes n."""
    from bench.harness.power import power_rows, projected_half_width

    assert projected_half_width(0.1, 4, 4) == pytest.approx(0.1)
    # sd = 0.1 x 2 / 3.182; at 8 seeds: 2.365 x sd / sqrt(8)
    assert projected_half_width(0.1, 4, 8) == pytest.approx(2.365 * (0.2 / 3.182) / math.sqrt(8))
    with pytest.raises(ValueError, match="at least 2 seeds"):
        projected_half_width(0.1, 1, 8)
    summary = {"settings": {
        "full_cut_f0.3": {"vs_random": {"loss_macro": {"mean": 0.02, "ci": 0.08, "n": 4}}},
        "recommended_small_f0.3": {"vs_random": {"loss_macro": {"mean": -0.01, "ci": 0.05, "n": 4}}}}}
    rows = power_rows(summary, target_seeds=8)
    assert [row["setting"] for row in rows] == ["full_cut_f0.3", "recommended_small_f0.3"]
    assert [row["within_goal"] for row in rows] == [False, True]
    assert power_rows({"settings": {}}) == []
