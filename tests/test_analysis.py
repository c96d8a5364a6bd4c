"""The analysis stage and the `ds-cluster analyze` command: unit checks, then 2-rank runs end to end."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ds_cluster.ds_config import forward_only_config
from ds_cluster.analysis.folder import AnalysisDir
from ds_cluster.cli import build_parser, main
from ds_cluster.clustering.kmeans import category_counts, purity
from tests.launching import check, run_deepspeed, run_mpirun

ANALYZE = ["-m", "ds_cluster.cli", "analyze"]

NUM_RECORDS = 60
ANALYSIS_FILES = ("features.npy", "labels.npy", "centroids.npy", "distances.npy", "empty_mask.npy",
                  "manifest.json", "summary.json")


def test_family_purity():
    labels = np.array([0, 0, 0, 1, 1, 1, -1])
    names, counts = category_counts(labels, ["a", "a", "b", "b", "b", "b", "c"], num_clusters=2)
    assert names == ["a", "b"] and counts.tolist() == [[2, 1], [0, 3]]  # label -1 is not counted
    assert purity(counts) == pytest.approx(5 / 6)


def test_forward_only_config_drops_training_parts():
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"}, "scheduler": {},
              "data_efficiency": {"enabled": True}, "zero_optimization": {"stage": 3}}
    assert forward_only_config(config) == {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}
    config["zero_optimization"] = {"stage": 2, "overlap_comm": True}
    assert forward_only_config(config)["zero_optimization"] == {"stage": 0, "overlap_comm": True}


def test_publish_replaces_atomically_and_keeps_old_analysis_on_failure(tmp_path):
    out = tmp_path / "analysis"
    store = out / ".feature_store"
    store.mkdir(parents=True)
    (store / "manifest.json").write_text("{}")
    AnalysisDir(out).write({"labels.npy": np.arange(3)}, {}, {"n": 3}, store)
    assert json.loads((out / "summary.json").read_text()) == {"n": 3}
    assert (out / ".feature_store" / "manifest.json").exists()  # the store moved with the directory
    with pytest.raises(ValueError):  # an object array cannot be saved without pickle
        AnalysisDir(out).write({"labels.npy": np.array([None, 1], dtype=object)}, {}, {"n": 4}, store)
    assert json.loads((out / "summary.json").read_text()) == {"n": 3}
    assert np.load(out / "labels.npy").tolist() == [0, 1, 2] and (out / ".feature_store").exists()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["analysis"]  # no staging left over


def test_cli_help_explains_options_with_an_example(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["analyze", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--deepspeed", "--model", "--data", "--out", "--kind", "--dim", "--batch-size",
                   "--max-length", "--recompute", "--store"):
        assert option in text
    assert "examples:" in text and "deepspeed --num_gpus 2" in text and "mpirun -np 2" in text
    assert "--model-seed" not in text  # a model is a checkpoint folder: its seed is in its weights
    # The deepspeed launcher puts --local_rank before the subcommand.
    args = build_parser().parse_args(["--local_rank=1", "analyze", "--deepspeed", "c.json", "--model", "tiny",
                                      "--data", "d.jsonl", "--out", "o"])
    assert args.local_rank == 1 and args.command == "analyze"


# ----------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    from ds_cluster.data.dataset import write_jsonl
    from bench.toy.models import save_tiny_model
    from bench.toy.tasks import generate_mixture

    root = tmp_path_factory.mktemp("analyze_inputs")
    save_tiny_model(root / "model", seed=0)
    records, _ = generate_mixture(seed=0, total=NUM_RECORDS, heldout_per_family=0)
    write_jsonl(records, root / "train.jsonl")

    def config(stage: int) -> Path:
        path = root / f"zero{stage}.json"
        path.write_text(json.dumps({
            "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
            "data_efficiency": {"enabled": True, "data_sampling": {"enabled": True, "cluster_sampling": {
                "enabled": True, "num_clusters": "auto", "kmeans_n_init": 2, "seed": 5}}},
        }))
        return path

    return {"data": root / "train.jsonl", "families": [r["family"] for r in records], "config": config,
            "model": str(root / "model")}


def _check_analysis(out: Path, families: list[str], kind: str, dim: int, world_size: int = 2) -> dict:
    assert all((out / name).exists() for name in ANALYSIS_FILES), sorted(p.name for p in out.iterdir())
    features, labels = np.load(out / "features.npy"), np.load(out / "labels.npy")
    centroids, empty = np.load(out / "centroids.npy"), np.load(out / "empty_mask.npy")
    summary = json.loads((out / "summary.json").read_text())
    manifest = json.loads((out / "manifest.json").read_text())
    assert features.dtype == np.float32 and features.shape == (NUM_RECORDS, dim)
    assert labels.dtype == np.int64 and labels.shape == (NUM_RECORDS,)
    assert centroids.shape == (world_size, dim) and empty.shape == (NUM_RECORDS,)
    assert np.isfinite(features).all()
    np.testing.assert_allclose(np.linalg.norm(features[~empty], axis=1), 1.0, atol=1e-5)
    assert summary["num_samples"] == NUM_RECORDS and summary["num_empty"] == int(empty.sum()) == 0
    assert summary["kind"] == kind and summary["dim"] == dim and summary["num_clusters"] == world_size
    assert summary["cluster_sizes"] == np.bincount(labels, minlength=world_size).tolist()
    assert sum(summary["cluster_sizes"]) == NUM_RECORDS
    names, counts = category_counts(labels, families, world_size)
    assert summary["purity"] == pytest.approx(purity(counts))
    assert summary["cluster_categories"] == [{n: int(c) for n, c in zip(names, row) if c} for row in counts]
    assert set(summary["timings_s"]) >= {"extract", "cluster", "total"}
    assert manifest["kind"] == kind and manifest["dim"] == dim and manifest["seed"] == 5
    assert manifest["model_fingerprint"] and manifest["dataset_fingerprint"]
    return summary


@pytest.mark.integration
def test_analyze_cli_under_deepspeed_launcher_zero3(inputs, tmp_path):
    out = tmp_path / "analysis"
    args = [*ANALYZE, "--deepspeed", str(inputs["config"](3)), "--model", inputs["model"],
            "--data", str(inputs["data"]), "--out", str(out), "--kind", "proxy", "--batch-size", "8",
            "--shard-size", "16"]
    check(run_deepspeed(args, timeout=240))
    summary = _check_analysis(out, inputs["families"], "proxy", 128)  # the tiny model's hidden size
    assert summary["world_size"] == 2 and summary["zero_stage"] == 3 and summary["computed_shards"] == [0, 1, 2, 3]
    assert (out / ".feature_store" / "manifest.json").exists()


@pytest.mark.integration
def test_analyze_cli_under_mpirun_zero2_lm_head(inputs, tmp_path):
    out = tmp_path / "analysis"
    args = [*ANALYZE, "--deepspeed", str(inputs["config"](2)), "--model", inputs["model"],
            "--data", str(inputs["data"]), "--out", str(out), "--kind", "lm_head", "--dim", "512",
            "--no-progress"]
    check(run_mpirun(args, timeout=240))
    summary = _check_analysis(out, inputs["families"], "lm_head", 512)
    assert summary["zero_stage"] == 2



@pytest.mark.integration
def test_sharded_clustering_on_two_ranks_equals_one_process(inputs, tmp_path):
    """With sharded_clustering each rank clusters its own feature rows (the Lloyd sums are all-reduced): two
    ranks give the one-process centroids (to 1e-5), the same labels and the same plan."""
    from ds_cluster import ClusterSamplingConfig
    from tests.planning import plan_of_inputs
    from tests.launching import run_single

    config = json.loads(inputs["config"](2).read_text())
    block = config["data_efficiency"]["data_sampling"]["cluster_sampling"]
    block.update(sharded_clustering=True, num_clusters=3, capacity_factor=1.05)  # a cap that binds
    path = tmp_path / "sharded.json"
    path.write_text(json.dumps(config))

    def args(out: Path) -> list[str]:
        return [*ANALYZE, "--deepspeed", str(path), "--model", inputs["model"], "--data", str(inputs["data"]),
                "--out", str(out), "--shard-size", "16", "--no-progress"]

    check(run_mpirun(args(tmp_path / "two"), timeout=240))
    check(run_single(args(tmp_path / "one"), timeout=240))
    two, one = tmp_path / "two", tmp_path / "one"
    assert not (two / "features.npy").exists()  # the N x d matrix never came together
    np.testing.assert_allclose(np.load(two / "centroids.npy"), np.load(one / "centroids.npy"), rtol=0, atol=1e-5)
    np.testing.assert_array_equal(np.load(two / "labels.npy"), np.load(one / "labels.npy"))
    assert max(np.bincount(np.load(two / "labels.npy"))) <= int(np.ceil(1.05 * NUM_RECORDS / 3))
    settings = ClusterSamplingConfig.from_dict({**block, "budget_ratio": 0.5, "allocation": "stratified"})
    plans = [plan_of_inputs(AnalysisDir(folder).load_inputs(NUM_RECORDS), settings, world_size=2, micro_batch_size=2,
                            gradient_accumulation_steps=1) for folder in (two, one)]
    assert plans[0].fingerprint() == plans[1].fingerprint()
