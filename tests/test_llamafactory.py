"""LLaMA-Factory 0.9.5 trained through `python -m ds_cluster.integrations.llamafactory` in .venv-llamafactory
(launch/frontend_env.sh): 2 ranks under torchrun with ZeRO-2, chat records and the block in the DeepSpeed JSON, and a
resume from LLaMA-Factory's own checkpoint; one process with LoRA on Alpaca records and the block as the YAML's
top-level key (which LLaMA-Factory's parser, refusing unknown keys, never sees). Each run computes its analysis in the
job and every rank's trace (tests/frontends/trace) is checked against the plan built here from that analysis. Then
the refusals and the guards against training without the plan. Marked `frontends`: `bash launch/test_frontends.sh`."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ds_cluster import Plan
from ds_cluster.integrations.hf import SAMPLER_STATE_FILE
from ds_cluster.data.dataset import read_jsonl
from bench.toy.models import base_model_path
from bench.toy.tasks import DEFAULT_DATA
from tests.frontends.jobs import (ACCUMULATION, MICRO_BATCH, NUM_RECORDS, assert_job_computed_the_analysis,
                                  assert_lora_job_follows_the_plan, assert_refused, assert_resume_continues_the_run,
                                  assert_run_follows_the_plan, block, block_cases, check_outcomes, frontend_env,
                                  job_plan, launcher_args, run, venv, write_data, write_yaml, zero_json)
from tests.launching import REPO, check

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
    return job_plan(zero2_job, zero2_job / "zero2.json", WORLD)


def test_the_zero2_job_computes_the_analysis_of_llamafactorys_rows(zero2_job: Path):
    assert_job_computed_the_analysis(zero2_job, "ClusterSeq2SeqTrainer")
    assert_rows_are_the_records_as_rendered(zero2_job)


def assert_rows_are_the_records_as_rendered(job: Path) -> None:
    """The rows the analysis is of (written beside it) are the records, one for one and in order, as LLaMA-Factory's
    `empty` template renders them: the user turn (instruction, input) as the prompt, the loss on the answer only."""
    rows = [json.loads(line) for line in (job / "analysis.records.jsonl").read_text().splitlines()]
    expected = [{"prompt": "\n".join(filter(None, (r["instruction"], r["input"]))), "completion": r["output"]}
                for r in read_jsonl(DEFAULT_DATA / "train.jsonl")[:NUM_RECORDS]]
    assert rows == expected


def test_each_rank_trains_exactly_its_plan_batches_under_zero2(zero2_job: Path, zero2_plan: Plan):
    assert zero2_plan.steps_per_epoch < SAVE_STEPS < MAX_STEPS and SAVE_STEPS % zero2_plan.steps_per_epoch
    assert_run_follows_the_plan(zero2_job / "out", zero2_plan, MAX_STEPS, WORLD)


def test_llamafactorys_own_trainer_state_carries_the_per_cluster_figures(zero2_job: Path):
    # What LLaMA-Factory's loss plot reads.
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
    assert_resume_continues_the_run(zero2_job / "out", resumed, SAVE_STEPS * ACCUMULATION, WORLD)


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
    assert_lora_job_follows_the_plan(lora_alpaca_job, ONE_PROCESS_STEPS)
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


def test_options_that_override_the_plan_and_bad_blocks_are_refused_by_name(data: Path, tmp_path: Path):
    """The launcher's checks (LLaMA-Factory's own parser, then the refusals) in one process, for every case."""
    cases = {name: {**options, "cluster_sampling": block(tmp_path / "analysis")} for name, options in REFUSED.items()}
    paths = {name: write_yaml(tmp_path / f"{name}.yaml", llamafactory_yaml(data, tmp_path / "out", "toy_alpaca",
                                                                            **values))
             for name, values in {**cases, **block_cases(tmp_path, 2)}.items()}
    got = check_outcomes(FRONTEND, "llamafactory_options.py", paths, tmp_path)
    assert_refused(got, list(REFUSED), "LLaMA-Factory")
    assert "the other stages (pt, rm, ppo, dpo, kto)" in got["stage"]


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
