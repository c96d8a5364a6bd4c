"""The frontend tests' jobs: the toy data as axolotl and LLaMA-Factory read it, their YAMLs, their own command
lines in their own environments (.venv-axolotl, .venv-llamafactory, built by launch/frontend_env.sh), and what the
runs recorded (tests/frontends/trace/sitecustomize.py)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import pytest
import yaml

from ds_cluster import ClusterSamplingConfig, Plan
from ds_cluster.analysis.folder import AnalysisDir
from ds_cluster.data.dataset import read_jsonl, write_jsonl
from bench.toy.tasks import DEFAULT_DATA
from tests.frontends.outcomes import read_outcomes
from tests.launching import REPO, free_port, job_env
from tests.planning import plan_of_inputs
from tests.training import assert_trainer_follows_plan, read_trace

TRACER = REPO / "tests" / "frontends" / "trace"
# Records of the toy data the runs train on (every family): small enough for seconds of training per run.
NUM_RECORDS = 192
MICRO_BATCH = 4
ACCUMULATION = 2
# Kept 64 of 192: 4 optimizer steps per epoch on 2 ranks, 8 in one process.
BUDGET_RATIO = 0.34
JOB_TIMEOUT_S = 480
# The character tokenizer's template for chat records (every turn: bos, role, ": ", content, eos).
CHAT_TEMPLATE = ("{% for message in messages %}"
                 "{{ bos_token + message['role'] + ': ' + message['content'] + eos_token }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ bos_token + 'assistant: ' }}{% endif %}")
ZERO = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
        "zero_allow_untested_optimizer": True, "bf16": {"enabled": False}, "fp16": {"enabled": False}}


def venv(frontend: str) -> Path:
    """The frontend's environment, or a test failure saying how to build it (never a skip: the tests must not rot)."""
    folder = REPO / f".venv-{frontend}"
    if not (folder / "bin" / "python").exists():
        pytest.fail(f"{folder} is missing: build it with `bash launch/frontend_env.sh {frontend}` (bash "
                    "launch/test_frontends.sh builds both and runs these tests)")
    return folder


def frontend_env(frontend: str, trace: Optional[Path], extra: Optional[dict] = None) -> dict:
    """The job environment of tests/launching.py with the frontend's bin first on PATH and the tracer importable."""
    env = job_env(extra)
    env["PATH"] = f"{venv(frontend) / 'bin'}{os.pathsep}{env['PATH']}"
    env["PYTHONPATH"] = f"{TRACER}{os.pathsep}{REPO}"
    # DeepSpeed's shm comm op is built once per environment (its torch and ninja).
    env["TORCH_EXTENSIONS_DIR"] = str(REPO / ".torch_extensions" / frontend)
    env.update(AXOLOTL_DO_NOT_TRACK="1", HF_HUB_DISABLE_TELEMETRY="1", TRANSFORMERS_OFFLINE="1")
    if trace is not None:
        env["DS_CLUSTER_TEST_TRACE"] = str(trace)
    return env


def run(cmd: Sequence[str], env: dict, cwd: Path, timeout: float = JOB_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run([str(part) for part in cmd], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def launcher_args(nproc: int) -> list[str]:
    return ["--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1", "--master_port", str(free_port())]


# ----------------------------------------------------------------------------------------------- data
def write_data(root: Path) -> Path:
    """`root/alpaca.jsonl` and `root/chat.jsonl`: the same NUM_RECORDS toy records as Alpaca fields and as chat
    messages (the user turn is the instruction and input, the assistant turn the output)."""
    root.mkdir(parents=True, exist_ok=True)
    records = read_jsonl(DEFAULT_DATA / "train.jsonl")[:NUM_RECORDS]
    write_jsonl(records, root / "alpaca.jsonl")
    write_jsonl([{"messages": [{"role": "user", "content": "\n".join(filter(None, (r["instruction"], r["input"])))},
                               {"role": "assistant", "content": r["output"]}], "family": r["family"]}
                 for r in records], root / "chat.jsonl")
    return root


def block(analysis: Path, **extra: Any) -> dict:
    return {"enabled": True, "preset": "recommended", "budget_ratio": BUDGET_RATIO, "analysis_path": str(analysis),
            **extra}


def zero_json(path: Path, stage: int, cluster_block: Optional[dict], **extra: Any) -> Path:
    """A DeepSpeed JSON as the frontends' examples write them ("auto" where the Trainer fills a value in), but no
    train_batch_size (docs/axolotl.md: "auto" is filled for one process under DeepSpeed on CPU)."""
    config: dict[str, Any] = {**ZERO, "zero_optimization": {"stage": stage}, **extra}
    if stage == 3:
        config["zero_optimization"].update(stage3_param_persistence_threshold=0,
                                           stage3_gather_16bit_weights_on_model_save=True)
    if cluster_block is not None:
        config["data_efficiency"] = {"enabled": True, "data_sampling": {"enabled": True, "num_workers": 0,
                                                                        "cluster_sampling": cluster_block}}
    path.write_text(json.dumps(config, indent=1))
    return path


def block_cases(folder: Path, stage: int) -> dict[str, dict]:
    """YAML values of the bad blocks every frontend refuses (and one it accepts): `both` (the YAML key and the JSON),
    `none` (a JSON without a block), `typo` (an unknown key), `accepted`."""
    analysis = folder / "analysis"
    return {"both": {"deepspeed": str(zero_json(folder / "with_block.json", stage, block(analysis))),
                     "cluster_sampling": block(analysis)},
            "none": {"deepspeed": str(zero_json(folder / "without_block.json", stage, None))},
            "typo": {"cluster_sampling": {**block(analysis), "budget_ration": 0.3}},
            "accepted": {"cluster_sampling": block(analysis)}}


def check_outcomes(frontend: str, worker: str, paths: dict[str, Path], folder: Path,
                   env_extra: Optional[dict] = None) -> dict[str, str]:
    """{case: "ok" or the error} of a worker in the frontend's environment checking each case's YAML."""
    result = run([venv(frontend) / "bin" / "python", REPO / "tests" / "frontends" / worker, *paths.values()],
                 frontend_env(frontend, None, env_extra), cwd=folder)
    assert result.returncode == 0, result.stderr[-3000:]
    outcomes = read_outcomes(result.stdout)
    return {name: outcomes[str(path)] for name, path in paths.items()}


def assert_refused(got: dict[str, str], refused: Sequence[str], frontend: str) -> None:
    """Every refused option's case is one ValueError naming it; the bad blocks are refused, the good one is not."""
    assert got["accepted"] == "ok"
    for name in refused:
        assert got[name].startswith(f"ValueError: {frontend}: cluster_sampling cannot follow"), (name, got[name])
        assert f"`{name}: " in got[name], got[name]
    assert "given twice" in got["both"] and "no cluster_sampling block" in got["none"]
    assert "unknown key 'budget_ration' (did you mean 'budget_ratio'?)" in got["typo"]


def write_yaml(path: Path, values: dict) -> Path:
    path.write_text(yaml.safe_dump(values, sort_keys=False))
    return path


# ------------------------------------------------------------------------------------------ the plan
def expected_plan(config: ClusterSamplingConfig, num_rows: int, world: int) -> Plan:
    """The plan built here from the analysis the job wrote, independently of the run, for the run's batch shape."""
    inputs = AnalysisDir(config.analysis_path).load_inputs(num_rows)
    return plan_of_inputs(inputs, config, world_size=world, micro_batch_size=MICRO_BATCH,
                          gradient_accumulation_steps=ACCUMULATION)


def job_plan(job: Path, ds_json: Path, world: int) -> Plan:
    """The plan of a job whose block is in `ds_json`, built here from the analysis it wrote for its rows."""
    return expected_plan(ClusterSamplingConfig.from_ds_config(ds_json), read_run(job / "out")["num_rows"], world)


def read_run(out: Path) -> dict:
    return json.loads((out / "trace" / "run.json").read_text())


def assert_weights_are_the_plans(out: Path, plan: Plan, world: int) -> None:
    """Every trained sample carried the plan's weight for it."""
    for rank in range(world):
        for record in read_trace(out, rank):
            np.testing.assert_allclose(record["weights"], plan.weights[record["indices"]], rtol=1e-6)


def assert_epoch_trains_the_kept_records(out: Path, plan: Plan, world: int) -> None:
    """The first epoch's micro-batches over every rank are whole global batches of the plan's kept records, each
    record once (a kept count that is not a multiple of the global batch leaves the rest to later epochs)."""
    per_epoch = plan.steps_per_epoch * plan.gradient_accumulation_steps
    trained = [index for rank in range(world) for record in read_trace(out, rank)[:per_epoch]
               for index in record["indices"]]
    assert len(trained) == plan.steps_per_epoch * plan.global_batch_size == len(set(trained))
    assert set(trained) <= set(plan.selected.tolist())
    assert plan.num_kept - len(trained) < plan.global_batch_size


def assert_cluster_figures_are_logged(out: Path, plan: Plan, world: int) -> None:
    """The frontend's log history carries `cluster_<c>/samples` at every training log, equal to the samples of
    cluster c trained so far (counted from every rank's trace), and `cluster_<c>/train_loss` for some clusters."""
    history = [entry for entry in read_run(out)["log_history"] if "loss" in entry]
    assert history, "no training log"
    traces = [read_trace(out, rank) for rank in range(world)]
    for entry in history:
        trained = np.zeros(plan.num_clusters, dtype=int)
        for trace in traces:
            for record in trace:
                if record["step"] < entry["step"]:
                    np.add.at(trained, plan.labels[record["indices"]], 1)
        logged = [float(entry[f"cluster_{c}/samples"]) for c in range(plan.num_clusters)]
        assert logged == trained.tolist(), (entry["step"], logged, trained.tolist())
    assert any(key.endswith("/train_loss") for key in history[-1])


def assert_run_follows_the_plan(out: Path, plan: Plan, max_steps: int, world: int) -> None:
    """The run built this plan, every rank trained exactly its batches step by step, the first epoch (when the run
    trained one) is whole global batches of the kept records, every sample carried its plan weight, and the logs
    carry the per-cluster figures."""
    assert read_run(out)["plan_fingerprint"] == plan.fingerprint()
    assert_trainer_follows_plan(out, plan, max_steps, world)
    if max_steps >= plan.steps_per_epoch:
        assert_epoch_trains_the_kept_records(out, plan, world)
    assert_weights_are_the_plans(out, plan, world)
    assert_cluster_figures_are_logged(out, plan, world)


def assert_lora_job_follows_the_plan(job: Path, max_steps: int) -> None:
    """A one-process LoRA job (`job/out`) with the block as the YAML key: it computed the analysis, trained only the
    adapters of a PeftModel, and followed the plan built here from that analysis."""
    run_record = read_run(job / "out")
    assert run_record["analysis_timings"]["extract"] > 0
    assert run_record["model_class"].startswith("PeftModel")
    assert run_record["trainable"] and all("lora_" in name for name in run_record["trainable"])
    plan = expected_plan(ClusterSamplingConfig.from_dict(block(job / "analysis")), run_record["num_rows"], 1)
    assert_run_follows_the_plan(job / "out", plan, max_steps, 1)


def assert_resume_continues_the_run(whole: Path, resumed: Path, skipped_micro_batches: int, world: int) -> None:
    """A run resumed from `whole`'s checkpoint read the analysis (computed nothing) and trained the same micro-batches
    with the same loss normalisers and, from the same parameters and optimizer state, the same fp32 losses."""
    assert read_run(resumed)["analysis_timings"] == {}, "the resumed run computed the analysis again"
    for rank in range(world):
        expected, got = read_trace(whole, rank)[skipped_micro_batches:], read_trace(resumed, rank)
        for key in ("indices", "step", "normalizers"):
            assert [r[key] for r in got] == [r[key] for r in expected], (rank, key)
        assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in expected], abs=1e-5)


def assert_job_computed_the_analysis(job: Path, trainer_class: str) -> dict:
    """The job (`job/out`) trained with `trainer_class` and computed its analysis (`job/analysis`) itself, before its
    first step; returns the analysis's manifest."""
    run_record = read_run(job / "out")
    assert run_record["analysis_timings"]["extract"] > 0, "the analysis was read, not computed in the job"
    assert run_record["trainer_class"] == trainer_class
    manifest = json.loads((job / "analysis" / "manifest.json").read_text())
    assert manifest["computed_by"] == f"the training job ({trainer_class})"
    # One row per record (none is longer than the rows' length cap), as the frontend tokenized them.
    assert run_record["num_rows"] == NUM_RECORDS
    return manifest
