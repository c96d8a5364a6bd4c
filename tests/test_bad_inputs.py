"""Bad inputs: each one a clear error (naming the problem and the fix), on every rank, fast, leaving nothing behind.

The pure cases (config, planner, analysis loader, the hook's checks before the
engine exists) run in this process. The cases that involve ranks start real
2-rank DeepSpeed jobs on loopback; each asserts that the error line appears once
per rank, how long the failure took, and that no output was half-written.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import pytest

from ds_cluster.batching import check_batch_arithmetic
from ds_cluster.config import ClusterSamplingConfig
from ds_cluster.ds_config import read_ds_config
from ds_cluster.integrations.deepspeed import _initialize
from ds_cluster.collectives import LOCAL
from ds_cluster.integrations.setup import ClusterSetup, check_no_curriculum
from tests.planning import plan_of
from tests.launching import BIN, REPO, job_env, run_mpirun
from tests.training import train_args

# An analysis for 40 samples: 4 well-separated groups of 10 in 3 dimensions.
NUM_SAMPLES = 40
# How long a 2-rank launch may take to fail: imports and start-up are most of it (about 15 s).
FAIL_WITHIN_S = 90.0


def group_features(num_samples: int = NUM_SAMPLES, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = np.eye(4, 3) * 10
    return (centres[np.arange(num_samples) % 4] + rng.normal(0, 0.1, (num_samples, 3))).astype(np.float32)


def enabled(**settings: Any) -> ClusterSamplingConfig:
    return ClusterSamplingConfig(enabled=True, **{"kmeans_n_init": 1, **settings})


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (hidden ones too) with its bytes: 'nothing changed, nothing added'."""
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


# ------------------------------------------------------------------------------------------ config
CONFIG_CASES = [
    # (block, words the message must contain)
    ({"enabled": True, "budget_ration": 0.5}, ["unknown key 'budget_ration'", "did you mean 'budget_ratio'"]),
    ({"enabled": True, "num_cluster": 4}, ["unknown key 'num_cluster'", "did you mean 'num_clusters'"]),
    ({"enabled": True, "selction": "core"}, ["unknown key 'selction'", "did you mean 'selection'"]),
    ({"enabled": True, "frobnicate": 1}, ["unknown key 'frobnicate'", "Allowed keys", "budget_ratio"]),
    ({"enabled": True, "budget_ratio": 0.0}, ["'budget_ratio'", "greater than 0"]),
    ({"enabled": True, "budget_ratio": 1.5}, ["'budget_ratio'", "less than or equal to 1"]),
    ({"enabled": True, "num_clusters": 0}, ["num_clusters must be >= 1 or 'auto'", "got 0"]),
    ({"enabled": True, "num_clusters": "many"}, ["'num_clusters", "'many'"]),
    ({"enabled": True, "capacity_factor": 0.5}, ["'capacity_factor'", "greater than or equal to 1"]),
    ({"enabled": True, "selection": "edge"}, ["'selection'", "'peripheral'", "'edge'"]),
    ({"enabled": True, "budget_mode": "max"}, ["'budget_mode'", "'neyman'", "'max'"]),
    ({"enabled": True, "seed": -1}, ["'seed'", "greater than or equal to 0"]),
    ({"enabled": True, "kmeans_n_init": 0}, ["'kmeans_n_init'", "greater than or equal to 1"]),
    ({"enabled": True, "budget_samples": 0}, ["'budget_samples'", "greater than or equal to 1"]),
    ({"enabled": "maybe"}, ["'enabled'", "'maybe'"]),
    ({"enabled": True, "feature_kind": "layers"},
     ["'feature_kind'", "'layers' is not available", "'proxy'", "'lm_head'"]),
    ({"enabled": True, "loss_reduction": "mean"}, ["'loss_reduction'", "'sample'", "'token'"]),
]


@pytest.mark.parametrize("block,expected", CONFIG_CASES, ids=[next(iter(set(b) - {"enabled"}), "enabled")
                                                              + f"={list(b.values())[-1]!r}" for b, _ in CONFIG_CASES])
def test_bad_config_block_is_a_value_error_naming_key_and_fix(block, expected):
    with pytest.raises(ValueError) as caught:
        ClusterSamplingConfig.from_dict(block)
    for words in expected:
        assert words in str(caught.value), str(caught.value)


def test_block_that_is_not_an_object_is_refused():
    with pytest.raises(ValueError, match="expected a JSON object, got list"):
        ClusterSamplingConfig.from_dict([("enabled", True)])  # type: ignore[arg-type]


def test_config_file_with_broken_json_names_line_and_column(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 4,\n "zero_optimization": {"stage": [2, }}')
    with pytest.raises(ValueError, match=r"ds\.json: not valid JSON or HJSON .* line 2, column"):
        ClusterSamplingConfig.from_ds_config(path)


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="DeepSpeed config file not found: .*nowhere.json"):
        read_ds_config(tmp_path / "nowhere.json")


def test_curriculum_and_cluster_sampling_together_name_the_key_to_turn_off():
    config = {"data_efficiency": {"data_sampling": {"curriculum_learning": {"enabled": True},
                                                    "cluster_sampling": {"enabled": True}}}}
    with pytest.raises(ValueError, match=r"data_efficiency\.data_sampling\.curriculum_learning\.enabled to false"):
        check_no_curriculum(config, "ds.json")
    with pytest.raises(ValueError, match=r"set curriculum_learning\.enabled to false"):
        check_no_curriculum({"curriculum_learning": {"enabled": True}}, "ds.json")


# ------------------------------------------------------------------------------------------ planner
def _plan(features: Optional[np.ndarray], config: ClusterSamplingConfig, world: int = 2, micro: int = 2,
          gas: int = 1, **inputs: Any):
    return plan_of(features, config, world_size=world, micro_batch_size=micro,
                      gradient_accumulation_steps=gas, **inputs)


def _with_nan(features: np.ndarray) -> np.ndarray:
    features = features.copy()
    features[7, 1] = np.nan
    return features


def _with_inf(features: np.ndarray) -> np.ndarray:
    features = features.copy()
    features[3, 0] = np.inf
    return features


PLANNER_CASES: list[tuple[str, Callable[[], Any], str]] = [
    ("K larger than the data", lambda: _plan(group_features(), enabled(num_clusters=NUM_SAMPLES + 1)),
     r"num_clusters K=41 is larger than the number of samples N=40; lower num_clusters"),
    ("features with NaN", lambda: _plan(_with_nan(group_features()), enabled(num_clusters=4)),
     r"NaN or inf in 1 rows \(first: row 7\); recompute the features"),
    ("features with inf", lambda: _plan(_with_inf(group_features()), enabled(num_clusters=4)),
     r"NaN or inf in 1 rows \(first: row 3\)"),
    ("features not 2-D", lambda: _plan(group_features()[:, 0], enabled(num_clusters=4)),
     r"must be a 2-D array \(N samples x d dimensions\), got shape \(40,\)"),
    ("empty dataset", lambda: _plan(np.zeros((0, 3), np.float32), enabled(num_clusters=1)),
     r"is empty .*nothing to cluster"),
    ("data shorter than one global batch", lambda: _plan(group_features(), enabled(num_clusters=4), micro=16, gas=2),
     r"smaller than one global batch .*64 samples = world 2 x micro 16 x gas 2.*raise budget_ratio or lower the batch"),
    ("cluster_per_rank with K != world", lambda: _plan(group_features(), enabled(num_clusters=4,
                                                                                 allocation="cluster_per_rank")),
     r"num_clusters must equal the world size: K=4, W=2; set num_clusters 'auto' or allocation 'stratified'"),
    ("budget that keeps nothing",
     lambda: _plan(group_features(), enabled(num_clusters=4, budget_mode="min", budget_ratio=0.05)),
     r"= 0 samples per cluster.*raise budget_ratio or lower num_clusters"),
    ("labels below -1", lambda: _plan(None, enabled(selection="random"), labels=np.array([0, 1, -2] * 10)),
     r"labels must be >= 0 \(or -1 to leave a sample out\); found -2"),
    ("every sample excluded", lambda: _plan(group_features(), enabled(num_clusters=2),
                                            exclude=np.ones(NUM_SAMPLES, bool)),
     r"every sample is excluded .*nothing to train on"),
    ("micro batch 0", lambda: _plan(group_features(), enabled(num_clusters=4), micro=0),
     r"micro_batch_size must be an integer >= 1, got 0"),
    ("neither features nor labels", lambda: _plan(None, enabled()), r"a plan needs features, or labels"),
    ("labels only with the default neyman budget", lambda: _plan(None, enabled(selection="random", budget_ratio=0.5),
                                                               labels=np.array([0, 1] * 20)),
     r"budget_mode 'neyman' needs features .*labels only.*set budget_mode 'proportional', 'equal' or 'min'"),
]


@pytest.mark.parametrize("name,call,message", PLANNER_CASES, ids=[case[0] for case in PLANNER_CASES])
def test_planner_refuses_bad_input_with_a_value_error(name, call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_samples_without_response_tokens_get_weight_zero_and_are_never_scheduled():
    # Samples without response tokens have all-zero feature rows; the loader turns them into `exclude`.
    features = group_features()
    features[[2, 9, 31]] = 0.0
    inputs = _analysis_inputs(features)
    assert inputs.exclude is not None and np.flatnonzero(inputs.exclude).tolist() == [2, 9, 31]
    plan = _plan(inputs.features, enabled(num_clusters=4, budget_mode="proportional"), exclude=inputs.exclude)
    assert (plan.weights[[2, 9, 31]] == 0).all() and (plan.labels[[2, 9, 31]] == -1).all()
    assert not np.isin([2, 9, 31], plan.epoch_layout(0)).any() and not np.isin([2, 9, 31], plan.selected).any()


# ------------------------------------------------------------------------------------------ analysis loader
def _analysis_inputs(features: np.ndarray, tmp: Optional[Path] = None):
    import tempfile

    folder = Path(tmp or tempfile.mkdtemp())
    np.save(folder / "features.npy", features)
    return load_plan_inputs(enabled(analysis_path=str(folder)), features.shape[0])


def load_plan_inputs(config: ClusterSamplingConfig, num_samples: int, dataset: Any = None):
    """What the hook reads before the engine: the analysis, checked against the data (N items by default)."""
    data = dataset if dataset is not None else [{"i": i} for i in range(num_samples)]
    return ClusterSetup(config, data, everyone=LOCAL).read_inputs()


def _write_truncated(folder: Path) -> None:
    np.save(folder / "features.npy", group_features())
    data = (folder / "features.npy").read_bytes()
    (folder / "features.npy").write_bytes(data[: len(data) // 2])


def _write_garbage(folder: Path) -> None:
    (folder / "features.npy").write_bytes(np.random.default_rng(1).bytes(700))


def _write_other_length(folder: Path) -> None:
    np.save(folder / "features.npy", group_features(NUM_SAMPLES + 3))


def _write_3d(folder: Path) -> None:
    np.save(folder / "features.npy", group_features().reshape(NUM_SAMPLES, 3, 1))


def _write_float_labels(folder: Path) -> None:
    np.save(folder / "labels.npy", np.linspace(0, 1, NUM_SAMPLES))


def _write_nan_features(folder: Path) -> None:
    np.save(folder / "features.npy", _with_nan(group_features()))


def _write_other_files_only(folder: Path) -> None:
    np.save(folder / "centroids.npy", np.zeros((2, 3), np.float32))


def _write_corrupt_manifest(folder: Path) -> None:
    np.save(folder / "features.npy", group_features())
    (folder / "manifest.json").write_text('{"dataset_fingerprint": "abc", ')


LOADER_CASES: list[tuple[str, Callable[[Path], None], type, str]] = [
    ("features.npy cut in half", _write_truncated, ValueError,
     r"features\.npy: unreadable or truncated \.npy file .*rerun `ds-cluster analyze`"),
    ("features.npy garbage bytes", _write_garbage, ValueError,
     r"features\.npy: unreadable or truncated \.npy file .*rerun `ds-cluster analyze`"),
    ("analysis of other data (N differs)", _write_other_length, ValueError,
     r"has 43 rows but the training dataset has 40 samples.*rerun `ds-cluster analyze` on this dataset"),
    ("features.npy 3-D", _write_3d, ValueError, r"expected a 2-D array, got shape \(40, 3, 1\)"),
    ("labels.npy of floats", _write_float_labels, ValueError, r"labels\.npy must hold integers, got float64"),
    ("features.npy with NaN", _write_nan_features, ValueError,
     r"features\.npy has NaN or inf in 1 rows \(first: row 7\); rerun `ds-cluster analyze`"),
    ("neither features nor labels", _write_other_files_only, FileNotFoundError,
     r"holds neither features\.npy nor labels\.npy"),
    ("manifest.json not JSON", _write_corrupt_manifest, ValueError,
     r"manifest\.json: unreadable or not valid JSON .*rerun `ds-cluster analyze`"),
]


@pytest.mark.parametrize("name,write,error,message", LOADER_CASES, ids=[case[0] for case in LOADER_CASES])
def test_bad_analysis_directory_is_refused_with_the_file_named(tmp_path, name, write, error, message):
    write(tmp_path)
    with pytest.raises(error, match=message):
        load_plan_inputs(enabled(analysis_path=str(tmp_path)), NUM_SAMPLES)


def test_missing_analysis_path_says_to_run_analyze(tmp_path):
    with pytest.raises(ValueError, match="analysis_path is not set: point it at the analysis folder written by"):
        load_plan_inputs(enabled(), NUM_SAMPLES)
    with pytest.raises(FileNotFoundError, match=r"does not exist .*run `ds-cluster analyze` first"):
        load_plan_inputs(enabled(analysis_path=str(tmp_path / "none")), NUM_SAMPLES)


def _instruction_dataset(records: list[dict]):
    from ds_cluster.data.dataset import InstructionDataset
    from bench.toy.tokenizer import build_tokenizer

    return InstructionDataset(records, build_tokenizer(), max_length=48)


def _records(prefix: str, count: int = NUM_SAMPLES) -> list[dict]:
    return [{"instruction": f"{prefix} {index}", "input": "", "output": str(index)} for index in range(count)]


def test_analysis_of_another_dataset_with_the_same_length_is_refused(tmp_path):
    from ds_cluster.data.dataset import dataset_fingerprint

    analysed, trained = _instruction_dataset(_records("copy")), _instruction_dataset(_records("reverse"))
    np.save(tmp_path / "features.npy", group_features())
    (tmp_path / "manifest.json").write_text(json.dumps({"dataset_fingerprint": dataset_fingerprint(analysed),
                                                        "data": "copy.jsonl", "max_length": 48}))
    config = enabled(analysis_path=str(tmp_path))
    with pytest.raises(ValueError, match=r"is an analysis of another dataset: .*'copy\.jsonl'.*Rerun `ds-cluster "
                                         r"analyze` on the training data"):
        load_plan_inputs(config, NUM_SAMPLES, trained)
    # The dataset it was made for passes, and so does the same content in another dataset class.
    assert load_plan_inputs(config, NUM_SAMPLES, analysed).features.shape == (NUM_SAMPLES, 3)
    same_content = [{key: value.tolist() for key, value in analysed[i].items()} for i in range(NUM_SAMPLES)]
    assert load_plan_inputs(config, NUM_SAMPLES, same_content).features is not None


# ------------------------------------------------------------------------------------------ the hook, before the engine
def _never_called(*args: Any, **kwargs: Any):
    raise AssertionError("deepspeed.initialize was reached: the bad input was not caught before the engine")


def _hook_config(tmp_path: Path, **top: Any) -> dict:
    np.save(tmp_path / "features.npy", group_features())
    block = {"enabled": True, "num_clusters": 2, "analysis_path": str(tmp_path)}
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, **top,
            "data_efficiency": {"enabled": True, "data_sampling": {"enabled": True, "cluster_sampling": block}}}


@pytest.mark.parametrize("data,message", [
    ([], r"training_data is empty \(0 samples\)"),
    (None, r"training_data is None"),
    (iter(range(NUM_SAMPLES)),
     r"training_data must be a map-style dataset \(with len\(\) and \[i\]\); got range_iterator"),
], ids=["empty dataset", "no dataset", "iterable dataset"])
def test_hook_refuses_missing_or_empty_training_data(tmp_path, data, message):
    with pytest.raises(ValueError, match=message):
        _initialize(_never_called, model=None, training_data=data, config=_hook_config(tmp_path),
                    dist_init_required=False)


def test_hook_prechecks_train_batch_size_with_the_numbers_and_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    config = _hook_config(tmp_path, train_batch_size=12)
    with pytest.raises(ValueError, match=r"train_batch_size 12 != train_micro_batch_size_per_gpu 4 x "
                                         r"gradient_accumulation_steps 2 x data-parallel world size 2 \(= 16\); "
                                         r"set train_batch_size to 16"):
        _initialize(_never_called, model=None, training_data=list(range(NUM_SAMPLES)), config=config,
                    dist_init_required=False)


@pytest.mark.parametrize("batch,world,message", [
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}, 2, r"train_batch_size 10 != .* \(= 8\)"),
    ({"train_batch_size": 9}, 2, r"train_batch_size 9 is not a multiple of the world size 2"),
    ({"train_micro_batch_size_per_gpu": 0}, 1, r"train_micro_batch_size_per_gpu must be >= 1, got 0"),
], ids=["derived accumulation", "only train_batch_size", "zero micro batch"])
def test_batch_arithmetic_precheck(batch, world, message):
    with pytest.raises(ValueError, match=message):
        check_batch_arithmetic(batch, "ds.json", world)


def test_batch_arithmetic_that_adds_up_passes():
    for batch in ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
                  {"train_batch_size": 16, "gradient_accumulation_steps": 2}, {"train_batch_size": "auto"},
                  {"train_micro_batch_size_per_gpu": 3}):
        check_batch_arithmetic(batch, "ds.json", 2)


# ------------------------------------------------------------------------------------------ 2 ranks
ERROR_LINE = re.compile(r"^\s*(?:\[rank\d+\]:\s*)?\w*(?:Error|Exception): (.*)$")


def assert_failed_on_every_rank(result: subprocess.CompletedProcess, phrase: str, elapsed: float,
                                world: int = 2) -> str:
    """The job failed, fast, and the final error line of at least `world` tracebacks names the problem."""
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    error_lines = [match.group(1) for match in map(ERROR_LINE.match, output.splitlines()) if match]
    naming = [line for line in error_lines if phrase in line]
    assert len(naming) >= world, f"expected the error on {world} ranks, got {len(naming)}:\n{output[-4000:]}"
    assert elapsed < FAIL_WITHIN_S, f"took {elapsed:.0f} s to fail"
    return output


def _launch(args: list[str], **options: Any) -> tuple[subprocess.CompletedProcess, float]:
    """2 ranks under mpirun (a real launcher with no Python process of its own: the cheapest start here)."""
    started = time.monotonic()
    result = run_mpirun(args, timeout=FAIL_WITHIN_S + 60, **options)
    return result, time.monotonic() - started


def _record_other_data(analysis: Path) -> None:
    (analysis / "manifest.json").write_text(json.dumps({"dataset_fingerprint": "0123456789abcdef",
                                                        "data": "someone_else.jsonl", "max_length": 64}))


def _put_nan_in_row_11(analysis: Path) -> None:
    features = np.load(analysis / "features.npy")
    features[11] = np.nan
    np.save(analysis / "features.npy", features)


@pytest.mark.integration
@pytest.mark.parametrize("spoil,phrase", [
    (_record_other_data, "is an analysis of another dataset"),
    (_put_nan_in_row_11, "has NaN or inf in 1 rows (first: row 11)"),
], ids=["manifest records other data", "features with NaN"])
def test_two_ranks_refuse_a_bad_analysis(small_job, tmp_path, spoil, phrase):  # noqa: F811
    analysis = tmp_path / "analysis"
    shutil.copytree(small_job / "analysis", analysis)
    spoil(analysis)
    before = snapshot(analysis)
    args = train_args(small_job, "zero2.json", tmp_path / "out", "--max-steps", "2")
    args[args.index("--analysis") + 1] = str(analysis)
    result, elapsed = _launch(args)
    assert_failed_on_every_rank(result, phrase, elapsed)
    assert not (tmp_path / "out").exists() and snapshot(analysis) == before


@pytest.mark.integration
def test_two_ranks_refuse_train_batch_size_that_does_not_add_up(small_job, tmp_path):  # noqa: F811
    config = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    config["train_batch_size"] = 12  # micro 4 x gas 2 x world 2 = 16
    (tmp_path / "bad.json").write_text(json.dumps(config))
    args = train_args(small_job, "zero2.json", tmp_path / "out", "--max-steps", "2")
    args[args.index("--deepspeed") + 1] = str(tmp_path / "bad.json")
    result, elapsed = _launch(args)
    output = assert_failed_on_every_rank(result, "train_batch_size 12 != train_micro_batch_size_per_gpu 4 x "
                                                 "gradient_accumulation_steps 2 x data-parallel world size 2", elapsed)
    assert "set train_batch_size to 16" in output
    assert not (tmp_path / "out").exists()


@pytest.fixture
def read_only_dir(tmp_path) -> Path:
    """A read-only filesystem (a tmpfs remounted ro): refuses writes even from root, who ignores chmod."""
    folder = tmp_path / "readonly"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,ro", "tmpfs", str(folder)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {mounted.stderr.strip()}")
    yield folder
    subprocess.run(["umount", "-l", str(folder)], check=False)


@pytest.mark.integration
def test_two_ranks_refuse_an_unwritable_output_dir_before_training(small_job, read_only_dir):  # noqa: F811
    out = read_only_dir / "run" / "out"
    result, elapsed = _launch(train_args(small_job, "zero2.json", out, "--max-steps", "2"))
    output = assert_failed_on_every_rank(result, f"--output-dir {out} is not writable", elapsed)
    assert "choose a writable --output-dir" in output
    assert not any(read_only_dir.iterdir())


SSH_STAND_IN = """#!/bin/sh
# Stands in for ssh: knows no hosts, so fails at once the way OpenSSH does for a name that does not resolve.
echo "$@" >> "{calls}"
while [ $# -gt 0 ]; do
  case "$1" in
    -o|-p|-i|-l) shift 2 ;;
    -*) shift ;;
    *) echo "ssh: Could not resolve hostname $1: Name or service not known" >&2; exit 255 ;;
  esac
done
exit 255
"""


@pytest.mark.integration
def test_hostfile_with_a_host_that_does_not_resolve_fails_within_seconds(tmp_path):
    missing_host = "no-such-node.invalid"
    (tmp_path / "hostfile").write_text(f"{missing_host} slots=1\n")
    stand_in = tmp_path / "bin" / "ssh"
    stand_in.parent.mkdir()
    stand_in.write_text(SSH_STAND_IN.format(calls=tmp_path / "ssh_calls"))
    stand_in.chmod(0o755)
    env = job_env({"PATH": f"{stand_in.parent}{os.pathsep}{job_env()['PATH']}"})
    out = tmp_path / "out"
    command = [str(BIN / "deepspeed"), "--hostfile", str(tmp_path / "hostfile"), "--master_addr", "127.0.0.1",
               "--module", "ds_cluster.train", "--deepspeed", str(REPO / "ds_configs" / "zero2.json"),
               "--model", "unused", "--data", "unused", "--output-dir", str(out)]
    started = time.monotonic()
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - started
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert elapsed < 30, f"took {elapsed:.0f} s"
    # DeepSpeed's runner names the host and the hostfile and says what to fix (passwordless ssh, or no hostfile).
    assert f"host={missing_host} was not reachable via ssh" in output, output[-3000:]
    assert str(tmp_path / "hostfile") in output and "setup passwordless ssh" in output
    assert missing_host in (tmp_path / "ssh_calls").read_text(), "the ssh stand-in was not the ssh called"
    assert not out.exists()
