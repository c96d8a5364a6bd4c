"""Targeted selection in one process: the target block, reading target examples, the two rules against direct
computations, the plan, the analysis folder's target, the report and the export (the jobs: test_targeted_jobs.py)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from ds_cluster.analysis.compute import AnalysedData, AnalysedFeatures, write_analysis
from ds_cluster.analysis.folder import AnalysedTarget, AnalysisDir
from ds_cluster.batching import BatchShape
from ds_cluster.clustering.samples import PlanInputs, cluster_samples
from ds_cluster.config import ClusterSamplingConfig
from ds_cluster.data.target import read_target, read_target_fingerprint
from ds_cluster.planning import targeted
from ds_cluster.planning.plan import build_plan
from ds_cluster.settings import TargetSettings, default_of
from tests.fixtures.tokenizers import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer("smollm2", tmp_path_factory.mktemp("smollm2"))


def _unit(rows):
    rows = np.asarray(rows, dtype=np.float64)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def _pool(count=400, dim=16, seed=0):
    rng = np.random.default_rng(seed)
    return _unit(rng.normal(size=(count, dim))).astype(np.float32)


def _target(features, groups):
    return SimpleNamespace(features=np.asarray(features, dtype=np.float32), groups=np.asarray(groups))


def _config(**block):
    return ClusterSamplingConfig.from_dict({"enabled": True, "weighting": "none", **block})


# ------------------------------------------------------------------------------------------------ the block
def test_the_target_block_is_checked_against_the_rule_and_the_schedule():
    with pytest.raises(ValueError, match="selection 'round_robin' takes the records most like"):
        _config(selection="round_robin")
    with pytest.raises(ValueError, match="selection 'random' does not read it: set selection to 'round_robin', "
                                         "'clusters'"):
        _config(target={"data": "t.jsonl"})
    with pytest.raises(ValueError, match="adaptive schedule .* does not read a target"):
        _config(selection="clusters", target={"data": "t.jsonl"}, schedule="adaptive")
    with pytest.raises(ValueError, match="sharded_clustering"):
        _config(selection="clusters", target={"data": "t.jsonl"}, sharded_clustering=True)
    with pytest.raises(ValueError, match="'target.cluster_floor'"):
        _config(selection="clusters", target={"data": "t.jsonl", "cluster_floor": -1})
    with pytest.raises(ValueError, match="'target.floor'"):
        _config(selection="clusters", target={"data": "t.jsonl", "floor": 1})
    with pytest.raises(ValueError, match="target.groups names targets by the field target.group_field"):
        _config(selection="clusters", target={"data": "t.jsonl", "groups": ["a"]})


def test_the_target_keys_have_one_default_and_a_plan_records_them_but_not_the_path():
    config = _config(selection="round_robin", target={"data": "here/t.jsonl"})
    assert config.target.settings() == TargetSettings(data="here/t.jsonl")
    for key in ("group_field", "min_examples", "groups", "cluster_floor"):
        assert getattr(config.target, key) == default_of(f"target.{key}") == getattr(TargetSettings(), key)
    record = config.stages().plan_record()
    assert record["target"] == {"group_field": None, "min_examples": 1, "groups": None, "cluster_floor": 1}
    assert "target" not in ClusterSamplingConfig(enabled=True).stages().plan_record()


# ---------------------------------------------------------------------------------------------- the examples
ALPACA = {"instruction": "Reverse the letters.", "input": "abc", "output": "cba", "family": "reverse"}
CHAT = {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}],
        "family": "greet"}
SHAREGPT = {"conversations": [{"from": "human", "value": "Say bye."}, {"from": "gpt", "value": "bye"}],
            "family": "greet"}
PROMPT = {"prompt": "Q: 2+2? A:", "completion": " 4"}


def test_target_examples_in_every_format_are_tokenized_like_the_data_and_grouped(tokenizer, tmp_path):
    path = tmp_path / "target.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in (ALPACA, CHAT, SHAREGPT, PROMPT)))
    examples = read_target(path, tokenizer, 64, group_field="family")
    assert examples.group_names == ("(no group)", "greet", "reverse")
    assert examples.groups.tolist() == [2, 1, 1, 0]
    assert len(examples.dataset) == 4 and examples.dataset.max_length == 64
    assert examples.source == str(path)
    # The fingerprint is of the records and their targets: the same from records in memory, from the file without
    # tokenizing, and with another tokenizer's max length; other targets, or another record, change it.
    same = read_target([ALPACA, CHAT, SHAREGPT, PROMPT], tokenizer, 80, group_field="family")
    assert same.fingerprint == examples.fingerprint == read_target_fingerprint(path, group_field="family")
    assert read_target(path, tokenizer, 64).fingerprint != examples.fingerprint
    assert read_target([ALPACA, CHAT], tokenizer, 64, group_field="family").fingerprint != examples.fingerprint
    assert read_target(path, tokenizer, 64).group_names == ("target",)


@pytest.mark.parametrize("records, options, message", [
    ([], {}, "holds no examples"),
    ([{"instruction": "x"}], {}, "cannot be rendered or tokenized: record 0: field 'output' is missing"),
    ([{"prompt": "p", "completion": 3}], {}, "field 'completion' must be a string"),
    ([dict(ALPACA, input="a" * 400)], {}, "target example 0 is .* tokens long, more than the max length 64"),
    ([ALPACA, CHAT], {"group_field": "family", "min_examples": 2}, "min_examples = 2: 'greet' has 1, 'reverse' has 1"),
    ([ALPACA], {"group_field": "family", "groups": ["reverse", "rotate"]}, r"groups \['rotate'\] have no examples"),
    ([ALPACA, CHAT], {"group_field": "family", "groups": ["reverse"]}, r"does not name: \['greet'\]"),
])
def test_bad_target_examples_are_a_clear_error(tokenizer, tmp_path, records, options, message):
    path = tmp_path / "target.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    with pytest.raises(ValueError, match=message):
        read_target(path, tokenizer, 64, **options)


def test_a_missing_target_file_names_the_key(tokenizer, tmp_path):
    with pytest.raises(FileNotFoundError, match="cluster_sampling.target.data: no file or folder at .*nowhere"):
        read_target(tmp_path / "nowhere.jsonl", tokenizer, 64)


# ------------------------------------------------------------------------------------------- round robin
def _reference_round_robin(features, target, total, similarity, clusters=None, dedup_rows=None):
    """The rule computed directly: the whole similarity matrix, each query's full order, turns in order, a
    near-duplicate of a record taken from its cluster skipped (tested on `dedup_rows`' unit rows when given)."""
    clusters = np.zeros(len(features), int) if clusters is None else np.asarray(clusters)
    units, examples = _unit(features), _unit(target.features)
    tested = units if dedup_rows is None else _unit(dedup_rows)
    table = np.round(units @ examples.T, 9)
    groups = np.asarray(target.groups)
    names = np.unique(groups)
    scores = table if names.size == 1 else np.stack([table[:, groups == g].max(axis=1) for g in names], axis=1)
    orders = [list(np.lexsort((np.arange(len(units)), -scores[:, q]))) for q in range(scores.shape[1])]
    taken, skipped = [], set()
    while len(taken) < total and any(orders):
        for order in orders:
            while order and len(taken) < total:
                row = order.pop(0)
                if row in taken or row in skipped:
                    continue
                same = [other for other in taken if clusters[other] == clusters[row]]
                if same and np.round((tested[same] @ tested[row]).max(), 9) >= similarity:
                    skipped.add(row)
                    continue
                taken.append(row)
                break
    return sorted(taken)


@pytest.mark.parametrize("groups", [[0] * 6, [0, 0, 0, 1, 1, 2]])
@pytest.mark.parametrize("similarity", [0.95, 0.5])  # 0.5: many records skipped as near-duplicates, refills
def test_round_robin_is_the_rule_computed_directly_in_blocks(monkeypatch, groups, similarity):
    pool = _pool()
    rng = np.random.default_rng(1)
    target = _target(pool[rng.choice(len(pool), 6, replace=False)] + rng.normal(0, 0.3, (6, 16)), groups)
    clusters = rng.integers(0, 3, len(pool))
    monkeypatch.setattr(targeted, "SIMILARITY_BLOCK", 37)  # blocks of 2 rows: many merges of the best lists
    chosen = targeted.round_robin(pool, np.arange(len(pool)), target, 60, similarity, clusters)
    assert chosen.tolist() == _reference_round_robin(pool, target, 60, similarity, clusters)
    assert chosen.dtype == np.int64 and len(chosen) == 60


def test_round_robin_takes_the_target_examples_themselves_first_and_no_near_duplicates():
    pool = _pool()
    target = _target(pool[[5, 50, 150]], [0, 0, 0])  # examples injected in the pool: each takes itself first
    assert targeted.round_robin(pool, np.arange(len(pool)), target, 3, 0.95).tolist() == [5, 50, 150]
    # 60 copies of one record (one example rendered under many templates): at most one of them is taken, even when
    # every example asks for it; the copies come back only when nothing else is left.
    copies = np.concatenate([pool, np.repeat(pool[[7]] * 1.0001, 60, axis=0)])
    target = _target(np.repeat(pool[[7]], 4, axis=0) + np.random.default_rng(2).normal(0, 1e-3, (4, 16)), [0] * 4)
    chosen = targeted.round_robin(copies, np.arange(len(copies)), target, 30, 0.95)
    assert np.isin(chosen, np.r_[7, np.arange(len(pool), len(copies))]).sum() == 1
    assert chosen.tolist() == _reference_round_robin(copies, target, 30, 0.95)
    everything = targeted.round_robin(copies, np.arange(len(copies)), target, len(copies), 0.95)
    assert everything.tolist() == list(range(len(copies)))


def test_several_targets_take_turns_whatever_their_score_scale():
    pool = _pool()
    near, far = pool[[1, 2]], pool[[3]] * 0.2 + _pool(1, seed=9) * 0.8  # one target close to the pool, one not
    target = _target(np.concatenate([near, far]), [0, 0, 1])
    chosen = targeted.round_robin(pool, np.arange(len(pool)), target, 20, 0.95)
    scores = _unit(pool) @ _unit(target.features).T
    best_of = np.where(scores[:, :2].max(axis=1) >= scores[:, 2], 0, 1)
    assert abs(int((best_of[chosen] == 0).sum()) - 10) <= 1  # half each, not all to the closer target
    with pytest.raises(ValueError, match="budget of 2 records is smaller than the 3 targets"):
        targeted.round_robin(pool, np.arange(len(pool)), _target(pool[:3], [0, 1, 2]), 2, 0.95)


def _anisotropic_pool(seed=4):
    """A pool where one direction carries most of every row (as in a language model's last hidden layer): 300
    records of five groups around their own points in the other dimensions, group 2 tight (every pair's cosine at
    or above 0.95 but a few), the others spread."""
    rng = np.random.default_rng(seed)
    groups = np.repeat(np.arange(5), 60)
    spread = np.where(groups == 2, 0.2, 0.6)[:, None]
    small = _unit(rng.normal(size=(5, 15)))[groups] + rng.normal(0, 1, (300, 15)) * spread
    rows = np.concatenate([np.full((300, 1), 5.0), small], axis=1)
    return rows.astype(np.float32), groups


def test_centred_rows_are_the_unit_rows_less_the_pools_mean_unit_row(monkeypatch):
    pool = _pool(50) * np.random.default_rng(5).uniform(0.5, 3.0, (50, 1)).astype(np.float32)
    rows = np.arange(0, 50, 3)
    monkeypatch.setattr(targeted, "SIMILARITY_BLOCK", 37)  # blocks of 2 rows
    centred = targeted.centred_rows(pool, rows)
    expected = _unit(pool) - _unit(pool[rows]).mean(axis=0)
    assert centred.dtype == np.float32 and np.allclose(centred, expected, atol=1e-6)
    symmetric = np.concatenate([pool, -pool])  # a pool whose mean unit row is zero: centring changes nothing
    assert np.allclose(targeted.centred_rows(symmetric, np.arange(100)), _unit(symmetric), atol=1e-6)


def test_dedup_centre_keeps_an_anisotropic_pools_target_group_from_being_skipped():
    pool, groups = _anisotropic_pool()
    units = _unit(pool)
    same = (units[groups == 2] @ units[groups == 2].T)[np.triu_indices(60, 1)]
    assert (same >= 0.95).mean() > 0.99 and np.median(units[groups == 2] @ units[groups != 2].T) < 0.9
    examples = pool[groups == 2][:8] + np.random.default_rng(6).normal(0, 0.05, (8, 16)).astype(np.float32)
    target = _target(examples, [0] * 8)
    plain = targeted.round_robin(pool, np.arange(300), target, 30, 0.95)
    centred = targeted.round_robin(pool, np.arange(300), target, 30, 0.95, dedup_centre=True)
    # Plain: the first take from the target group makes the rest of it near-duplicates: the other groups fill in.
    assert (groups[plain] == 2).sum() == 1
    assert centred.tolist() == _reference_round_robin(pool, target, 30, 0.95,
                                                      dedup_rows=_unit(pool) - _unit(pool).mean(axis=0))
    assert (groups[centred] == 2).mean() >= 0.9
    # Through the config and the plan, for both targeted rules and semdedup; the key is recorded once set.
    for selection in ("round_robin", "clusters"):
        config = _config(selection=selection, num_clusters=5, budget_samples=30, dedup_centre=True,
                         target={"data": "t.jsonl", "cluster_floor": 0})
        clusters = cluster_samples(PlanInputs(pool, groups, None), config.stages().clustering, 1)
        plan = build_plan(clusters, config, BatchShape(1, 5, 1), target=target)
        assert plan.settings["dedup_centre"] is True and (groups[plan.selected] == 2).mean() >= 0.9
    plain_config = _config(selection="round_robin", num_clusters=5, budget_samples=30, target={"data": "t.jsonl"})
    clusters = cluster_samples(PlanInputs(pool, groups, None), plain_config.stages().clustering, 1)
    assert "dedup_centre" not in build_plan(clusters, plain_config, BatchShape(1, 5, 1), target=target).settings
    # semdedup keeps what random keeps where there are no near-duplicates: on the centred rows this pool has none;
    # on the raw rows the shared direction makes the tight group look like one and the pick departs from random's.
    def picked(selection: str, **keys) -> set:
        config = _config(selection=selection, num_clusters=5, budget_samples=50, weighting="none", **keys)
        return set(build_plan(clusters, config, BatchShape(1, 5, 1)).selected.tolist())

    random_pick = picked("random")
    assert picked("semdedup", dedup_centre=True) == random_pick and picked("semdedup") != random_pick


# -------------------------------------------------------------------------------------------- clusters rule
def _clustered_pool():
    rng = np.random.default_rng(3)
    centres = _unit(rng.normal(size=(4, 16))) * 3
    labels = np.repeat(np.arange(4), [60, 50, 40, 30])
    return (centres[labels] + rng.normal(0, 0.3, (180, 16))).astype(np.float32), labels, centres


def test_the_clusters_rule_budgets_by_the_examples_nearest_each_centre_with_a_floor():
    features, labels, centres = _clustered_pool()
    target = _target(centres[[0, 0, 0, 2]] + 0.01, [0, 0, 0, 0])
    # The members of a cluster here are within 0.95 of each other: only exact repeats count as near-duplicates.
    config = _config(selection="clusters", num_clusters=4, budget_samples=24, dedup_similarity=1.0,
                     target={"data": "t.jsonl", "cluster_floor": 1})
    clusters = cluster_samples(PlanInputs(features, labels, None), config.stages().clustering, 1)
    plan = build_plan(clusters, config, BatchShape(1, 4, 1), target=SimpleNamespace(**vars(target), fingerprint="t"))
    assert plan.kept_sizes.tolist() == [1 + 15, 1, 1 + 5, 1]  # 20 beyond the floors, 3 : 1
    assert plan.settings["target"]["fingerprint"] == "t" and np.all(plan.weights[plan.selected] == 1.0)
    # Inside a cluster, the records most similar to the target.
    scores, _ = targeted.target_scores(features, np.arange(len(features)), target)
    for cluster in (0, 2):
        members = np.flatnonzero(labels == cluster)
        best = members[np.lexsort((members, -scores[members]))][:plan.kept_sizes[cluster]]
        assert sorted(best.tolist()) == sorted(np.intersect1d(plan.selected, members).tolist())
    # Floor 0: a cluster no example is near is left out.
    no_floor = _config(selection="clusters", num_clusters=4, budget_samples=24,
                       target={"data": "t.jsonl", "cluster_floor": 0})
    assert targeted.cluster_budgets_toward(np.bincount(labels), centres, target, 24, 0).tolist() == [18, 0, 6, 0]
    assert build_plan(clusters, no_floor, BatchShape(1, 4, 1), target=target).kept_sizes.tolist() == [18, 0, 6, 0]
    with pytest.raises(ValueError, match="cannot give each of the 4 clusters its floor of 7"):
        targeted.cluster_budgets_toward(np.bincount(labels), centres, target, 24, 7)


def test_a_targeted_plan_needs_the_targets_features_of_the_same_space():
    features, labels, centres = _clustered_pool()
    config = _config(selection="round_robin", num_clusters=4, budget_samples=24, target={"data": "t.jsonl"})
    clusters = cluster_samples(PlanInputs(features, labels, None), config.stages().clustering, 1)
    with pytest.raises(ValueError, match="reads the target examples' features, and there are none"):
        build_plan(clusters, config, BatchShape(1, 4, 1))
    with pytest.raises(ValueError, match=r"shape \(2, 3\) .* dimension 16"):
        build_plan(clusters, config, BatchShape(1, 4, 1), target=_target(np.ones((2, 3)), [0, 0]))


# ----------------------------------------------------------------------------------------- analysis folder
def test_an_analysis_records_its_target_and_takes_another_without_touching_its_records(tmp_path):
    features, labels, centres = _clustered_pool()
    config = _config(selection="round_robin", num_clusters=4, target={"data": "t.jsonl"})
    first = AnalysedTarget(features[:3], np.array([0, 0, 1]), ("a", "b"), "f1", "t.jsonl", ("p", "q", "r"))
    folder = AnalysisDir(tmp_path / "analysis")
    (tmp_path / "analysis" / ".feature_store").mkdir(parents=True)  # kept through every rewrite
    write_analysis(folder, AnalysedFeatures(features, np.zeros(len(features), bool), "hidden", 16,
                                            store=folder.store_path()),
                   config, AnalysedData([{}] * len(features), "data"), 1, target=first)
    assert folder.target_fingerprint() == "f1" and folder.summary()["target"]["examples"] == {"a": 2, "b": 1}
    loaded = folder.load_target()
    np.testing.assert_array_equal(loaded.features, features[:3])
    assert (loaded.groups.tolist(), loaded.group_names, loaded.prompts) == ([0, 0, 1], ("a", "b"), ("p", "q", "r"))

    before = {name: (folder.path / name).stat().st_ino for name in ("features.npy", "labels.npy")}
    second = AnalysedTarget(features[10:12], np.array([0, 0]), ("c",), "f2")
    folder.replace_target(second)
    assert folder.target_fingerprint() == "f2" and folder.load_target().group_names == ("c",)
    # The records' arrays are the same files (linked, not rewritten), the store is still there.
    assert {name: (folder.path / name).stat().st_ino for name in before} == before
    assert folder.store_path().is_dir()
    np.testing.assert_array_equal(folder.load_inputs(len(features)).features, features)
    (folder.path / "target.json").write_text(json.dumps({**second.to_json(), "fingerprint": "other"}))
    with pytest.raises(ValueError, match="do not match its manifest's target_fingerprint f2"):
        folder.load_target()


# ---------------------------------------------------------------------- features of a real (toy) model
@pytest.fixture(scope="module")
def toy():
    from bench.toy.models import base_model_path
    from bench.toy.tasks import DEFAULT_DATA
    from ds_cluster.data.dataset import load_instruction_dataset, read_jsonl
    from ds_cluster.data.models import load_model_and_tokenizer
    from ds_cluster.features.extract import run_extraction

    model, tokenizer = load_model_and_tokenizer(base_model_path())
    records = read_jsonl(DEFAULT_DATA / "train.jsonl")[:300]
    dataset = load_instruction_dataset(records, tokenizer, max_length=64)
    features = run_extraction(model, dataset, kind="hidden", show_progress=False).features
    heldout = read_jsonl(DEFAULT_DATA / "heldout.jsonl")
    return SimpleNamespace(model=model, tokenizer=tokenizer, records=records, dataset=dataset, features=features,
                           heldout=heldout)


def test_records_features_once_many_targets_and_another_target_for_an_analysis(toy, tmp_path):
    """The benchmark's path: the records' features extracted once, an analysis written per target without
    extracting them again; the selection takes the target's family far beyond its share; `retarget` gives an
    analysis another target set, and refuses a model other than the one it was made with."""
    import torch

    from ds_cluster.analysis.target import extract_target, retarget
    from ds_cluster.features.model_info import model_fingerprint

    config = _config(selection="round_robin", feature_kind="hidden", num_clusters=4, budget_samples=30,
                     target={"data": "t.jsonl"})
    analysed = AnalysedFeatures(toy.features, np.zeros(len(toy.records), bool), "hidden", toy.features.shape[1],
                                model_fingerprint=model_fingerprint(toy.model))
    families = np.array([record["family"] for record in toy.records])
    folders = {}
    for family in ("double", "swap_case"):
        examples = read_target([r for r in toy.heldout if r["family"] == family][:6], toy.tokenizer, 64)
        target = extract_target(toy.model, examples, config)
        folders[family] = AnalysisDir(tmp_path / family)
        write_analysis(folders[family], analysed, config, AnalysedData(toy.dataset), 1, target=target)
        loaded = folders[family].load_target()
        plan = build_plan(cluster_samples(folders[family].load_inputs(len(toy.records)), config.stages().clustering,
                                          1), config, BatchShape(1, 2, 1), target=loaded)
        assert plan.num_kept == 30
        assert (families[plan.selected] == family).mean() > 2 * (families == family).mean()
    other = read_target([r for r in toy.heldout if r["family"] == "swap_case"][:6], toy.tokenizer, 64)
    retarget(toy.model, folders["double"], other)
    np.testing.assert_allclose(folders["double"].load_target().features, folders["swap_case"].load_target().features,
                               atol=1e-6)
    assert folders["double"].target_fingerprint() == folders["swap_case"].target_fingerprint()
    with torch.no_grad():
        toy.model.lm_head.weight[0, 0] += 1.0
    try:
        with pytest.raises(ValueError, match="was made with another model"):
            retarget(toy.model, folders["double"], other)
    finally:
        with torch.no_grad():
            toy.model.lm_head.weight[0, 0] -= 1.0


def test_the_report_shows_each_clusters_affinity_and_the_export_each_records_score(toy, tmp_path):
    from ds_cluster.analysis.target import extract_target
    from ds_cluster.report.export import export_subset, record_scores
    from ds_cluster.report.page import ReportInputs, write_report

    config = _config(selection="clusters", feature_kind="hidden", num_clusters=4, budget_samples=40,
                     target={"data": "t.jsonl", "group_field": "family"})
    examples = read_target([r for r in toy.heldout if r["family"] in ("double", "rotate")][:8], toy.tokenizer, 64,
                           group_field="family")
    target = extract_target(toy.model, examples, config)
    clusters = cluster_samples(PlanInputs(toy.features, None, None), config.stages().clustering, 1)
    plan = build_plan(clusters, config, BatchShape(1, 2, 1), target=target)
    page = write_report(tmp_path / "report", plan, ReportInputs(features=toy.features, target=target)).read_text()
    assert "<h2>Target</h2>" in page and "kept: mean similarity" in page and "examples it serves" in page
    hidden = write_report(tmp_path / "no_text", plan, ReportInputs(features=toy.features, target=target,
                                                                    include_text=False)).read_text()
    assert "examples it serves" not in hidden
    manifest = export_subset(plan, toy.records, tmp_path / "subset.jsonl", scores=record_scores(toy.features, target))
    rows = [json.loads(line) for line in (tmp_path / "subset.jsonl").read_text().splitlines()]
    assert len(rows) == plan.num_kept and set(manifest["fields_added"]) == {"cluster", "weight", "target_score",
                                                                            "target_group"}
    scores, _ = targeted.target_scores(toy.features, plan.selected, target)
    np.testing.assert_allclose([row["target_score"] for row in rows], scores)
    assert {row["target_group"] for row in rows} <= set(examples.group_names)


def test_the_configuration_page_lists_every_target_key_with_its_default():
    from tests.launching import REPO
    from ds_cluster.config import TargetConfig

    rows = {}
    for line in (REPO / "docs" / "configuration.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("target."):
            rows[cells[0].removeprefix("target.")] = cells[1]
    assert set(rows) == set(TargetConfig.model_fields)
    for key, written in rows.items():
        if key != "data":
            assert json.loads(written) == default_of(f"target.{key}"), key
    assert "## Measured" in (REPO / "docs" / "targeted.md").read_text()


def test_a_job_refuses_a_budget_smaller_than_its_targets_before_any_feature(tokenizer, tmp_path):
    from ds_cluster.collectives import LOCAL
    from ds_cluster.data.dataset import InstructionDataset
    from ds_cluster.integrations.setup import ClusterSetup

    path = tmp_path / "target.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in (ALPACA, CHAT, PROMPT)))
    config = _config(selection="round_robin", budget_samples=2, target={"data": str(path), "group_field": "family"})
    data = InstructionDataset([ALPACA] * 10, tokenizer, max_length=64)
    with pytest.raises(ValueError, match="budget of 2 records is smaller than the 3 targets"):
        ClusterSetup(config, data, everyone=LOCAL).read_target()
    examples = ClusterSetup(config.model_copy(update={"budget_samples": 3}), data, everyone=LOCAL).read_target()
    assert examples.group_names == ("(no group)", "greet", "reverse")


def test_a_feature_models_tokenizer_re_encodes_the_examples_and_checks_them_again(tokenizer, tmp_path):
    from ds_cluster.features.feature_model import feature_dataset

    examples = read_target([ALPACA, CHAT], tokenizer, 64, group_field="family")
    gpt2 = load_tokenizer("gpt2", tmp_path / "gpt2")  # no chat template: the chat example becomes prompt/completion
    again = examples.encoded_with(lambda data: feature_dataset(data, gpt2, 128))
    assert again.dataset.tokenizer is gpt2 and again.fingerprint == examples.fingerprint
    assert again.dataset.records[1]["completion"] == "hi"
    with pytest.raises(ValueError, match="target example 0 is .* tokens long, more than the max length 8"):
        examples.encoded_with(lambda data: feature_dataset(data, gpt2, 8))
