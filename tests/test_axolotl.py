"""axolotl 0.19 with ds_cluster's plugin, run by `axolotl train` itself in .venv-axolotl (launch/frontend_env.sh):
2 ranks under ZeRO-3 with the block in the DeepSpeed JSON and a resume from axolotl's own checkpoint; one process
with LoRA on chat records and the block as the YAML's top-level key. Each run computes its analysis in the job, and
every rank's trace (tests/frontends/trace) is checked against the plan built here from that analysis. Then the
refusals and the check that the trainer is ds_cluster's. Marked `frontends`: `bash launch/test_frontends.sh`."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import pytest

from ds_cluster import Plan
from ds_cluster.integrations.hf import SAMPLER_STATE_FILE
from bench.toy.models import base_model_path
from tests.frontends.jobs import (ACCUMULATION, CHAT_TEMPLATE, MICRO_BATCH, assert_job_computed_the_analysis,
                                  assert_lora_job_follows_the_plan, assert_refused, assert_resume_continues_the_run,
                                  assert_run_follows_the_plan, block, block_cases, check_outcomes, frontend_env,
                                  job_plan, launcher_args, run, venv, write_data, write_yaml, zero_json)
from tests.launching import REPO, check

pytestmark = [pytest.mark.frontends, pytest.mark.integration]

FRONTEND = "axolotl"
PLUGIN = "ds_cluster.integrations.axolotl.ClusterSamplingPlugin"
WORLD = 2
# 4 optimizer steps per epoch on 2 ranks: the checkpoint at step 6 is mid-epoch and the run crosses an epoch boundary.
MAX_STEPS = 9
SAVE_STEPS = 6
ONE_PROCESS_STEPS = 5


def axolotl_yaml(root: Path, data: Path, out: Path, *, chat: bool = False, **values) -> dict:
    """An axolotl YAML for the toy model: fp32 (the CPU's), the records as Alpaca fields (a `type:` of their own:
    axolotl's `alpaca` preamble leaves no room at 128 tokens for this tokenizer) or chat messages."""
    if chat:
        dataset = {"path": str(data / "chat.jsonl"), "ds_type": "json", "type": "chat_template",
                   "field_messages": "messages", "roles_to_train": ["assistant"]}
    else:
        dataset = {"path": str(data / "alpaca.jsonl"), "ds_type": "json", "type": {
            "field_instruction": "instruction", "field_input": "input", "field_output": "output",
            "format": "### Instruction:\n{instruction}\n### Input:\n{input}\n### Response:\n",
            "no_input_format": "### Instruction:\n{instruction}\n### Response:\n"}}
    return {"base_model": str(base_model_path()), "datasets": [dataset], "sequence_len": 128,
            "dataset_prepared_path": str(root / "prepared"), "output_dir": str(out),
            "micro_batch_size": MICRO_BATCH, "gradient_accumulation_steps": ACCUMULATION, "num_epochs": 10,
            "max_steps": MAX_STEPS, "save_steps": SAVE_STEPS, "logging_steps": 1, "learning_rate": 0.001,
            "optimizer": "adamw_torch", "lr_scheduler": "constant", "bf16": False, "fp16": False, "seed": 0,
            "plugins": [PLUGIN], **({"chat_template": "jinja", "chat_template_jinja": CHAT_TEMPLATE} if chat else {}),
            **values}


def train(cfg: Path, out: Path, nproc: int = 1) -> None:
    """`axolotl train cfg` (under torchrun for several ranks), each rank's trace into out/trace."""
    launcher = ["--launcher", "torchrun", "--", *launcher_args(nproc)] if nproc > 1 else []
    check(run([venv(FRONTEND) / "bin" / "axolotl", "train", cfg, *launcher], frontend_env(FRONTEND, out / "trace"),
              cwd=cfg.parent))


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_data(tmp_path_factory.mktemp("axolotl_data"))


@pytest.fixture(scope="module")
def zero3_job(data: Path, tmp_path_factory) -> Path:
    """2 ranks, ZeRO-3, Alpaca records, the block in the DeepSpeed JSON, an analysis_path that holds nothing yet."""
    root = tmp_path_factory.mktemp("axolotl_zero3")
    zero_json(root / "zero3.json", 3, block(root / "analysis"))
    cfg = write_yaml(root / "train.yml", axolotl_yaml(root, data, root / "out", deepspeed=str(root / "zero3.json")))
    train(cfg, root / "out", nproc=WORLD)
    return root


@pytest.fixture(scope="module")
def zero3_plan(zero3_job: Path) -> Plan:
    return job_plan(zero3_job, zero3_job / "zero3.json", WORLD)


def test_the_zero3_job_computes_the_analysis_of_axolotls_rows(zero3_job: Path):
    assert assert_job_computed_the_analysis(zero3_job, "ClusterAxolotlTrainer")["zero_stage"] == 3


def test_each_rank_trains_exactly_its_plan_batches_under_zero3(zero3_job: Path, zero3_plan: Plan):
    assert zero3_plan.steps_per_epoch < SAVE_STEPS < MAX_STEPS and SAVE_STEPS % zero3_plan.steps_per_epoch
    assert_run_follows_the_plan(zero3_job / "out", zero3_plan, MAX_STEPS, WORLD)


def test_the_report_and_export_read_the_rows_as_axolotl_rendered_them(zero3_job: Path, zero3_plan: Plan):
    """The job wrote its rows beside the analysis (prompt and trained tokens, decoded) and recorded them as the data
    the analysis was made of: `ds-cluster report` finds them itself, `ds-cluster export` writes the kept rows."""
    rendered = zero3_job / "analysis.records.jsonl"
    manifest = json.loads((zero3_job / "analysis" / "manifest.json").read_text())
    assert manifest["data_source"]["path"] == str(rendered)
    first = json.loads(rendered.read_text().splitlines()[0])
    assert first["prompt"].startswith("### Instruction:\n") and first["completion"].endswith("</s>")
    plan_flags = ["--analysis", str(zero3_job / "analysis"), "--deepspeed", str(zero3_job / "zero3.json"),
                  "--world-size", str(WORLD), "--micro-batch-size", str(MICRO_BATCH),
                  "--gradient-accumulation-steps", str(ACCUMULATION)]
    cli = [sys.executable, "-m", "ds_cluster.cli"]
    check(run([*cli, "report", *plan_flags, "--out", zero3_job / "report"], frontend_env(FRONTEND, None), REPO))
    page = (zero3_job / "report" / "index.html").read_text()
    assert str(rendered) in page and "Double each letter." in page
    check(run([*cli, "export", *plan_flags, "--data", rendered, "--out", zero3_job / "kept.jsonl"],
              frontend_env(FRONTEND, None), REPO))
    kept = [json.loads(line) for line in (zero3_job / "kept.jsonl").read_text().splitlines()]
    assert len(kept) == zero3_plan.num_kept and {"prompt", "completion", "cluster", "weight"} <= set(kept[0])


def test_resume_from_axolotls_checkpoint_continues_the_same_sequence(zero3_job: Path, zero3_plan: Plan, data: Path):
    checkpoint = zero3_job / "out" / f"checkpoint-{SAVE_STEPS}"
    state = json.loads((checkpoint / SAMPLER_STATE_FILE).read_text())
    assert state["plan_fingerprint"] == zero3_plan.fingerprint()
    resumed = zero3_job / "resumed"
    cfg = write_yaml(zero3_job / "resume.yml", axolotl_yaml(zero3_job, data, resumed,
                                                             deepspeed=str(zero3_job / "zero3.json"),
                                                             resume_from_checkpoint=str(checkpoint)))
    train(cfg, resumed, nproc=WORLD)
    assert_resume_continues_the_run(zero3_job / "out", resumed, SAVE_STEPS * ACCUMULATION, WORLD)


@pytest.fixture(scope="module")
def lora_chat_job(data: Path, tmp_path_factory) -> Path:
    """One process, no DeepSpeed (axolotl's single-process DeepSpeed needs nccl), LoRA as axolotl configures it,
    chat records through axolotl's chat template, the block as the YAML's top-level key."""
    root = tmp_path_factory.mktemp("axolotl_lora_chat")
    values = axolotl_yaml(root, data, root / "out", chat=True, max_steps=ONE_PROCESS_STEPS, save_steps=100,
                          adapter="lora", lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_target_linear=True,
                          # axolotl's fused LoRA kernels are CUDA only.
                          lora_mlp_kernel=False, lora_qkv_kernel=False, lora_o_kernel=False,
                          cluster_sampling=block(root / "analysis"))
    train(write_yaml(root / "train.yml", values), root / "out")
    return root


def test_one_process_lora_on_chat_records_follows_the_plan(lora_chat_job: Path):
    assert_lora_job_follows_the_plan(lora_chat_job, ONE_PROCESS_STEPS)
    # The rows as axolotl rendered the chat records with the template: the loss on the assistant turn only.
    first = json.loads((lora_chat_job / "analysis.records.jsonl").read_text().splitlines()[0])
    assert first["prompt"].startswith("<s>user: ") and first["prompt"].endswith("<s>assistant: ")
    assert "user" not in first["completion"]


# ------------------------------------------------------------------------------------------------- refusals
REFUSED = {
    "sample_packing": {"sample_packing": True},
    "batch_flattening": {"batch_flattening": True},
    "curriculum_sampling": {"curriculum_sampling": True},
    "group_by_length": {"group_by_length": True},
    "balance_labels": {"balance_labels": True},
    "rl": {"rl": "dpo"},
    "use_eaft": {"use_eaft": True},
    "chunked_cross_entropy": {"chunked_cross_entropy": True},
    "streaming": {"streaming": True},
    "trainer_cls": {"trainer_cls": "axolotl.core.trainers.base.AxolotlTrainer"},
    "sequence_parallel_degree": {"sequence_parallel_degree": 2},
}


def load_configs(data: Path, folder: Path, cases: dict, env_extra: Optional[dict] = None) -> dict[str, str]:
    """{case: "ok" or the error} of axolotl's own config loading of each case's YAML, in one process."""
    paths = {name: write_yaml(folder / f"{name}.yml", axolotl_yaml(folder, data, folder / "out", **values))
             for name, values in cases.items()}
    return check_outcomes(FRONTEND, "axolotl_configs.py", paths, folder, env_extra)


def test_options_that_override_the_plan_and_bad_blocks_are_refused_by_name(data: Path, tmp_path: Path):
    """axolotl's own config loading (plugins registered, then validation) in one process, for every case."""
    cases = {name: {**options, "cluster_sampling": block(tmp_path / "analysis")} for name, options in REFUSED.items()}
    got = load_configs(data, tmp_path, {**cases, **block_cases(tmp_path, 3)})
    # As each rank of a 2-rank launch reads it (alone here: this one is refused before anything starts).
    auto = zero_json(tmp_path / "auto.json", 3, block(tmp_path / "analysis"), train_batch_size="auto")
    got.update(load_configs(data, tmp_path, {"auto_batch": {"deepspeed": str(auto)}}, {"WORLD_SIZE": "2"}))
    assert_refused(got, list(REFUSED), "axolotl")
    assert "packing joins several records into one row" in got["sample_packing"]
    assert '"train_batch_size": "auto"' in got["auto_batch"] and "remove train_batch_size" in got["auto_batch"]


def test_a_refused_option_stops_axolotl_train_before_the_model_loads(data: Path, tmp_path: Path):
    cfg = write_yaml(tmp_path / "packed.yml", axolotl_yaml(tmp_path, data, tmp_path / "out", sample_packing=True,
                                                           cluster_sampling=block(tmp_path / "analysis")))
    result = run([venv(FRONTEND) / "bin" / "axolotl", "train", cfg], frontend_env(FRONTEND, tmp_path / "trace"),
                 cwd=tmp_path)
    assert result.returncode != 0
    assert "`sample_packing: True`: packing joins several records into one row" in result.stdout + result.stderr
    assert not (tmp_path / "trace").exists() and not (tmp_path / "analysis").exists()


def test_a_trainer_that_is_not_ds_clusters_stops_before_training(data: Path, tmp_path: Path):
    """Another plugin listed first gives axolotl its own trainer class: the run stops once the trainer exists,
    before any step, instead of training without the plan."""
    cfg = write_yaml(tmp_path / "rival.yml", axolotl_yaml(
        tmp_path, data, tmp_path / "out", cluster_sampling=block(tmp_path / "analysis"),
        plugins=["tests.frontends.rival_plugin.RivalTrainerPlugin", PLUGIN]))
    result = run([venv(FRONTEND) / "bin" / "axolotl", "train", cfg], frontend_env(FRONTEND, tmp_path / "trace"),
                 cwd=tmp_path)
    assert result.returncode != 0
    assert ("the trainer is axolotl.core.trainers.base.AxolotlTrainer, not ds_cluster's (a plugin listed before "
            "ds_cluster's gave axolotl its trainer class") in result.stdout + result.stderr
    assert not (tmp_path / "trace").exists() and not list((tmp_path / "out").glob("checkpoint-*"))
