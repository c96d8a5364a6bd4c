"""LLaMA-Factory 0.9.5 trained through `python -m ds_cluster.integrations.llamafactory` in .venv-llamafactory
(launch/frontend_env.sh): 2 ranks under torchrun with ZeRO-2, chat records and the block in the DeepSpeed JSON, and a
resume from LLaMA-Factory's own checkpoint; one process with LoRA on Alpaca records and the block as the YAML's
top-level key (which LLaMA-Factory's parser, refusing unknown keys, never sees). Each run computes its analysis in the
job and every rank's trace (tests/frontends/trace) is checked against the plan built here from that analysis. Then
the refusals and the guards against training without the plan. Marked `frontends`: `bash launch/test_frontends.sh`."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

import pytest

from ds_cluster import ClusterSamplingConfig, Plan
from ds_cluster.integrations.hf import SAMPLER_STATE_FILE
from ds_cluster.data.dataset import read_jsonl
from bench.toy.models import base_model_path
from bench.toy.tasks import DEFAULT_DATA
from tests.frontends.jobs import (ACCUMULATION, MICRO_BATCH, NUM_RECORDS, assert_cluster_figures_are_logged,
                                  assert_epoch_trains_the_kept_records, assert_weights_are_the_plans, block,
                                  expected_plan, frontend_env, launcher_args, read_run, run, venv, write_data,
                                  write_yaml, zero_json)
from tests.launching import REPO, check
from tests.training import assert_trainer_follows_plan, read_trace

pytestmark = [pytest.mark.frontends, pytest.mark.integration]

FRONTEND = "llamafactory"
MODULE = "ds_cluster.integrations.llamafactory"
WORLD = 2
# 4 optimizer steps per epoch on 2 ranks: the checkpoint at step 6 is mid-epoch and the run crosses an epoch boundary.
MAX_STEPS = 9
SAVE_STEPS = 6
ONE_PROCESS_STEPS = 5
DATASETS = {
    "toy_alpaca": {"file_name": "alpaca.jsonl", "columns": {"prompt": "instruction", "query": "input",
                                                             "response": "output"}},
    "toy_chat": {"file_name": "chat.jsonl", "formatting": "sharegpt", "columns": {"messages": "messages"},
                 "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                          "assistant_tag": "assistant"}},
}


def llamafactory_yaml(data: Path, out: Path, dataset: str, **values) -> dict:
    """A LLaMA-Factory SFT YAML for the toy model, fp32 (the CPU's), its `empty` template."""
    return {"model_name_or_path": str(base_model_path()), "stage": "sft", "do_train": True,
            "finetuning_type": "full", "dataset": dataset, "dataset_dir": str(data), "template": "empty",
            "cutoff_len": 128, "overwrite_cache": True, "output_dir": str(out),
            "per_device_train_batch_size": MICRO_BATCH, "gradient_accumulation_steps": ACCUMULATION,
            "learning_rate": 0.001, "lr_scheduler_type": "constant", "max_steps": MAX_STEPS,
            "save_steps": SAVE_STEPS, "logging_steps": 1, "report_to": "none", "bf16": False, "seed": 0, **values}


def train(cfg: Path, out: Path, nproc: int = 1) -> None:
    """The YAML through ds_cluster's launcher module (the torchrun target for several ranks); traces in out/trace."""
    bin_dir = venv(FRONTEND) / "bin"
    cmd = ([bin_dir / "torchrun", *launcher_args(nproc), "-m", MODULE, cfg] if nproc > 1
           else [bin_dir / "python", "-m", MODULE, cfg])
    check(run(cmd, frontend_env(FRONTEND, out / "trace"), cwd=cfg.parent))


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    folder = write_data(tmp_path_factory.mktemp("llamafactory_data"))
    (folder / "dataset_info.json").write_text(json.dumps(DATASETS))
    return folder


@pytest.fixture(scope="module")
def zero2_job(data: Path, tmp_path_factory) -> Path:
    """2 ranks under torchrun, ZeRO-2, chat records, the block in the DeepSpeed JSON, no analysis yet."""
    root = tmp_path_factory.mktemp("llamafactory_zero2")
    zero_json(root / "zero2.json", 2, block(root / "analysis"))
    cfg = write_yaml(root / "train.yaml", llamafactory_yaml(data, root / "out", "toy_chat",
                                                            deepspeed=str(root / "zero2.json")))
    train(cfg, root / "out", nproc=WORLD)
    return root


@pytest.fixture(scope="module")
def zero2_plan(zero2_job: Path) -> Plan:
    config = ClusterSamplingConfig.from_ds_config(zero2_job / "zero2.json")
    return expected_plan(config, read_run(zero2_job / "out")["num_rows"], WORLD)


def test_the_zero2_job_computes_the_analysis_of_llamafactorys_rows(zero2_job: Path):
    run_record = read_run(zero2_job / "out")
    assert run_record["analysis_timings"]["extract"] > 0, "the analysis was read, not computed in the job"
    assert run_record["trainer_class"] == "ClusterSeq2SeqTrainer"
    manifest = json.loads((zero2_job / "analysis" / "manifest.json").read_text())
    assert manifest["computed_by"] == "the training job (ClusterSeq2SeqTrainer)"
    assert run_record["num_rows"] == NUM_RECORDS
    assert_rows_are_the_records_as_rendered(zero2_job)


def assert_rows_are_the_records_as_rendered(job: Path) -> None:
    """The rows the analysis is of (written beside it) are the records, one for one and in order, as LLaMA-Factory's
    `empty` template renders them: the user turn (instruction, input) as the prompt, the loss on the answer only."""
    rows = [json.loads(line) for line in (job / "analysis.records.jsonl").read_text().splitlines()]
    expected = [{"prompt": "\n".join(filter(None, (r["instruction"], r["input"]))), "completion": r["output"]}
                for r in read_jsonl(DEFAULT_DATA / "train.jsonl")[:NUM_RECORDS]]
    assert rows == expected


def test_each_rank_trains_exactly_its_plan_batches_under_zero2(zero2_job: Path, zero2_plan: Plan):
    out = zero2_job / "out"
    assert read_run(out)["plan_fingerprint"] == zero2_plan.fingerprint()
    assert zero2_plan.steps_per_epoch < SAVE_STEPS < MAX_STEPS and SAVE_STEPS % zero2_plan.steps_per_epoch
    assert_trainer_follows_plan(out, zero2_plan, MAX_STEPS, WORLD)
    assert_epoch_trains_the_kept_records(out, zero2_plan, WORLD)
    assert_weights_are_the_plans(out, zero2_plan, WORLD)


def test_llamafactorys_logs_carry_the_per_cluster_figures(zero2_job: Path, zero2_plan: Plan):
    assert_cluster_figures_are_logged(zero2_job / "out", zero2_plan, WORLD)
    # LLaMA-Factory's own trainer_state.json (what its loss plot reads) holds them too.
    state = json.loads((zero2_job / "out" / "trainer_state.json").read_text())
    assert any("cluster_0/samples" in entry for entry in state["log_history"])


def test_resume_from_llamafactorys_checkpoint_continues_the_same_sequence(zero2_job: Path, zero2_plan: Plan,
                                                                           data: Path):
    checkpoint = zero2_job / "out" / f"checkpoint-{SAVE_STEPS}"
    assert json.loads((checkpoint / SAMPLER_STATE_FILE).read_text())["plan_fingerprint"] == zero2_plan.fingerprint()
    resumed = zero2_job / "resumed"
    cfg = write_yaml(zero2_job / "resume.yaml", llamafactory_yaml(
        data, resumed, "toy_chat", deepspeed=str(zero2_job / "zero2.json"), resume_from_checkpoint=str(checkpoint)))
    train(cfg, resumed, nproc=WORLD)
    assert read_run(resumed)["analysis_timings"] == {}, "the resumed run computed the analysis again"
    skipped = SAVE_STEPS * ACCUMULATION
    for rank in range(WORLD):
        expected, got = read_trace(zero2_job / "out", rank)[skipped:], read_trace(resumed, rank)
        assert [r["indices"] for r in got] == [r["indices"] for r in expected], f"rank {rank}"
        assert [r["step"] for r in got] == [r["step"] for r in expected]
        assert [r["normalizers"] for r in got] == [r["normalizers"] for r in expected]
        assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in expected], abs=1e-5)


@pytest.fixture(scope="module")
def lora_alpaca_job(data: Path, tmp_path_factory) -> Path:
    """One process, LoRA as LLaMA-Factory configures it (finetuning_type: lora), Alpaca records, the block as the
    YAML's top-level key."""
    root = tmp_path_factory.mktemp("llamafactory_lora")
    values = llamafactory_yaml(data, root / "out", "toy_alpaca", finetuning_type="lora", lora_rank=4,
                               lora_alpha=8, lora_dropout=0.0, lora_target="all", max_steps=ONE_PROCESS_STEPS,
                               save_steps=100, cluster_sampling=block(root / "analysis"))
    train(write_yaml(root / "train.yaml", values), root / "out")
    return root


def test_one_process_lora_on_alpaca_records_follows_the_plan(lora_alpaca_job: Path):
    out = lora_alpaca_job / "out"
    run_record = read_run(out)
    assert run_record["analysis_timings"]["extract"] > 0
    assert run_record["model_class"].startswith("PeftModel")
    assert run_record["trainable"] and all("lora_" in name for name in run_record["trainable"])
    config = ClusterSamplingConfig.from_dict(block(lora_alpaca_job / "analysis"))
    plan = expected_plan(config, run_record["num_rows"], 1)
    assert run_record["plan_fingerprint"] == plan.fingerprint()
    assert_trainer_follows_plan(out, plan, ONE_PROCESS_STEPS, 1)
    assert_weights_are_the_plans(out, plan, 1)
    assert_cluster_figures_are_logged(out, plan, 1)
    assert_rows_are_the_records_as_rendered(lora_alpaca_job)


# ------------------------------------------------------------------------------------------------- refusals
REFUSED = {
    "stage": {"stage": "pt"},
    "packing": {"packing": True},
    "neat_packing": {"neat_packing": True},
    "disable_shuffling": {"disable_shuffling": True},
    "streaming": {"streaming": True, "max_steps": 3},
    "use_dft_loss": {"use_dft_loss": True},
    "use_eaft_loss": {"use_eaft_loss": True},
    "label_smoothing_factor": {"label_smoothing_factor": 0.1},
}


def check_options(data: Path, folder: Path, cases: dict, env_extra: Optional[dict] = None) -> dict[str, str]:
    """{case: "ok" or the error} of the launcher's checks of each case's YAML, in one process."""
    paths = {name: write_yaml(folder / f"{name}.yaml", llamafactory_yaml(data, folder / "out", "toy_alpaca", **values))
             for name, values in cases.items()}
    result = check(run([venv(FRONTEND) / "bin" / "python", REPO / "tests" / "frontends" / "llamafactory_options.py",
                        *paths.values()], frontend_env(FRONTEND, None, env_extra), cwd=folder))
    outcomes = json.loads(re.search(r"^OUTCOMES (.*)$", result.stdout, re.M).group(1))
    return {name: outcomes[str(path)] for name, path in paths.items()}


def test_options_that_override_the_plan_and_bad_blocks_are_refused_by_name(data: Path, tmp_path: Path):
    analysis = tmp_path / "analysis"
    cases = {name: {**options, "cluster_sampling": block(analysis)} for name, options in REFUSED.items()}
    json_with_block = zero_json(tmp_path / "with_block.json", 2, block(analysis))
    cases.update({
        "both": {"deepspeed": str(json_with_block), "cluster_sampling": block(analysis)},
        "none": {"deepspeed": str(zero_json(tmp_path / "without_block.json", 2, None))},
        "typo": {"cluster_sampling": {**block(analysis), "budget_ration": 0.3}},
        "accepted": {"cluster_sampling": block(analysis)},
    })
    got = check_options(data, tmp_path, cases)
    assert got["accepted"] == "ok"
    for name in REFUSED:
        assert got[name].startswith("ValueError: LLaMA-Factory: cluster_sampling cannot follow"), (name, got[name])
        assert f"`{name}: " in got[name], got[name]
    assert "the other stages (pt, rm, ppo, dpo, kto)" in got["stage"]
    assert "given twice" in got["both"] and "no cluster_sampling block" in got["none"]
    assert "unknown key 'budget_ration' (did you mean 'budget_ratio'?)" in got["typo"]


def test_a_refused_option_stops_the_launcher_before_the_model_loads(data: Path, tmp_path: Path):
    cfg = write_yaml(tmp_path / "packed.yaml", llamafactory_yaml(data, tmp_path / "out", "toy_alpaca", packing=True,
                                                                 cluster_sampling=block(tmp_path / "analysis")))
    result = run([venv(FRONTEND) / "bin" / "python", "-m", MODULE, cfg], frontend_env(FRONTEND, tmp_path / "trace"),
                 cwd=tmp_path)
    assert result.returncode != 0
    assert "`packing: True`: packing joins several records into one row" in result.stderr
    assert "loading weights file" not in result.stdout + result.stderr
    assert not (tmp_path / "trace").exists() and not (tmp_path / "analysis").exists()


@pytest.mark.parametrize("variant,message", [
    ("bound", "the SFT workflow (llamafactory.train.sft.workflow.run_sft) no longer builds its trainer from "
              "llamafactory.train.sft.workflow.CustomSeq2SeqTrainer"),
    ("local", "the trainer is llamafactory.train.sft.trainer.CustomSeq2SeqTrainer, not ds_cluster's (LLaMA-Factory "
              "built its trainer without reading llamafactory.train.sft.workflow.CustomSeq2SeqTrainer"),
])
def test_a_workflow_that_no_longer_takes_ds_clusters_trainer_never_trains_plainly(data: Path, tmp_path: Path,
                                                                                   variant: str, message: str):
    """A later LLaMA-Factory whose SFT workflow reads its trainer class elsewhere: `bound` is seen in the workflow's
    code before anything loads; `local` builds LLaMA-Factory's own trainer, which stops before its first step."""
    cfg = write_yaml(tmp_path / "train.yaml", llamafactory_yaml(data, tmp_path / "out", "toy_alpaca",
                                                                cluster_sampling=block(tmp_path / "analysis")))
    result = run([venv(FRONTEND) / "bin" / "python", REPO / "tests" / "frontends" / "llamafactory_changed_workflow.py",
                  variant, cfg], frontend_env(FRONTEND, tmp_path / "trace"), cwd=tmp_path)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr[-3000:]
    loaded = "loading weights file" in result.stdout + result.stderr
    assert loaded == (variant == "local")
    assert not (tmp_path / "trace").exists() and not list((tmp_path / "out").glob("checkpoint-*"))
