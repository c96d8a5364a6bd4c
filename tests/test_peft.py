"""LoRA through ds_cluster's three trainers, 2 ranks on CPU: a peft PeftModel (LoRA of rank 4 on the attention and
MLP projections, the base frozen) trains on the plan like a full model.

The hook (`python -m ds_cluster.train --lora 4`): ZeRO-3 under the deepspeed launcher running the adaptive schedule,
its analysis computed in the job from the adapters' gradients, killed with SIGKILL and resumed; ZeRO-0 (mpirun) and
ZeRO-2 (deepspeed launcher) on the static plan. ClusterTrainer given a PeftModel (ZeRO-3, resumed) and
ClusterSFTTrainer given peft_config (ZeRO-2). PEFT models that cannot train as asked fail on every rank.
LoRA barely moves the tiny model's loss in a few steps: the tests read what trained instead (the saved adapters
against the start, the base weights against the base model).
"""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import numpy as np
import pytest
import torch

from ds_cluster import ClusterSamplingConfig, Plan
from tests.planning import plan_of_inputs
from ds_cluster.analysis.folder import AnalysisDir
from ds_cluster.data.models import load_model, with_lora
from ds_cluster.planning.shares import window_draws
from ds_cluster.planning.weights import WEIGHTINGS
from ds_cluster.train import parameter_digest
from tests.launching import REPO, check, run_deepspeed, run_mpirun
from tests.test_adaptive_jobs import ADAPT_EVERY, STEPS, _ranks_train_other_samples, adaptive_config, log_of
from tests.test_bad_inputs import FAIL_WITHIN_S
from tests.training import assert_run_follows_plan, assert_trainer_follows_plan, read_trace, train_args
from tests.workers.fault_worker import KILL_AFTER_STEP_VAR

pytest.importorskip("peft")
pytestmark = pytest.mark.integration

FAULT_WORKER = str(REPO / "tests" / "workers" / "fault_worker.py")
HF_WORKER = str(REPO / "tests" / "workers" / "hf_trainer_worker.py")
SFT_WORKER = str(REPO / "tests" / "workers" / "trl_trainer_worker.py")
CHECK_WORKER = str(REPO / "tests" / "workers" / "peft_check_worker.py")
LORA_RANK = 4
LORA = ("--lora", str(LORA_RANK))
# "all-linear" on the Llama blocks: every attention and MLP projection, not the output layer.
PROJECTIONS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
FEATURE_DIM = 256
# The Trainer runs: 20% kept, 2 ranks x micro 4 x 2 accumulation steps, 3 or 4 optimizer steps an epoch: the
# checkpoint at step 5 is inside the second epoch, the run ends in the second or third.
TRAINER_STEPS, TRAINER_SAVE = 7, 5
QUIET = {"HF_HUB_DISABLE_TELEMETRY": "1"}


def seeded_start(small_job: Path) -> torch.nn.Module:
    """The PEFT model a `--lora 4` job starts from: the base model, its adapters drawn from --lora-seed's default."""
    base = load_model(small_job / "model")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return with_lora(base, LORA_RANK)


def digest(model: torch.nn.Module) -> str:
    """ds_cluster.train's digest of every parameter (what summary_rank<R>.json records), of a model here."""
    return parameter_digest(SimpleNamespace(module=model, zero_optimization_stage=lambda: 0))


def run_digest(out: Path) -> str:
    digests = {json.loads((out / f"summary_rank{rank}.json").read_text())["parameter_digest"] for rank in range(2)}
    assert len(digests) == 1, "ranks ended with different parameters"
    return digests.pop()


def assert_only_the_adapters_trained(out: Path, small_job: Path) -> None:
    """--save-model wrote an adapter folder (rank 4 on every projection); loaded as --model loads it (the base model
    from its folder, these adapters), it is the job's final model parameter for parameter: the base weights did not
    move. Every adapter matrix moved from its start."""
    folder = out / "adapters"
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["r"] == LORA_RANK and set(config["target_modules"]) == PROJECTIONS
    assert not (folder / "model.safetensors").exists(), "the base weights were saved with the adapters"
    trained = load_model(folder)
    assert digest(trained) == run_digest(out)
    start = dict(seeded_start(small_job).named_parameters())
    adapters = {name: param for name, param in trained.named_parameters() if "lora_" in name}
    assert len(adapters) == 2 * len(PROJECTIONS) * trained.config.num_hidden_layers
    unchanged = [name for name, param in adapters.items() if torch.equal(param, start[name])]
    assert not unchanged, unchanged


# ------------------------------------------------------------------------------------------ the hook, ZeRO-3, adaptive
def lora_hook_args(small_job: Path, out: Path, analysis: Path, *extra: str) -> list[str]:
    """The adaptive LoRA job (3 windows of 3 steps, ZeRO-3), its lora features computed into `analysis` by the first
    job that finds none there; the "sample" reduction, so each micro-step's loss is mean_i w_i loss_i."""
    args = train_args(small_job, "zero3.json", out, "--max-steps", str(STEPS), *LORA, *extra)
    config = adaptive_config(small_job, out, 3, feature_kind="lora", feature_dim=FEATURE_DIM, loss_reduction="sample",
                             analysis_path=str(analysis))
    args[args.index("--deepspeed") + 1] = str(config)
    del args[args.index("--analysis"):args.index("--analysis") + 2]  # the config's analysis_path
    return args


@pytest.fixture(scope="module")
def lora_analysis(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("peft_analysis") / "analysis"


@pytest.fixture(scope="module")
def lora_run(small_job: Path, lora_analysis: Path, tmp_path_factory) -> Path:  # noqa: F811
    """The uninterrupted adaptive LoRA job under the deepspeed launcher, its adapters saved at the end."""
    out = tmp_path_factory.mktemp("peft_whole")
    check(run_deepspeed(lora_hook_args(small_job, out, lora_analysis, "--save-model", str(out / "adapters")),
                        timeout=300))
    return out


def test_the_jobs_analysis_is_the_adapter_gradients_of_the_peft_model_it_trains(lora_run: Path, lora_analysis: Path,
                                                                                small_job: Path):  # noqa: F811
    from ds_cluster.data.dataset import load_instruction_dataset
    from ds_cluster.data.models import load_tokenizer
    from ds_cluster.features.extract import run_extraction

    manifest = json.loads((lora_analysis / "manifest.json").read_text())
    assert manifest["computed_by"] == "the training job (deepspeed.initialize)"
    assert (manifest["kind"], manifest["dim"], manifest["zero_stage"], manifest["world_size"]) == (
        "lora", FEATURE_DIM, 3, 2)
    assert json.loads((lora_run / "summary_rank0.json").read_text())["analysis_timings"]["extract"] > 0
    # The features are those of the model the job trains (computed here in one process, without DeepSpeed): the base
    # model with its adapters at their seeded start, only the adapters trainable.
    model = seeded_start(small_job)
    trainable = [name for name, param in model.named_parameters() if param.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    dataset = load_instruction_dataset(small_job / "train.jsonl", load_tokenizer(small_job / "model"), max_length=64)
    seed = ClusterSamplingConfig.from_ds_config(lora_run / "ds_config.json").seed
    # Every 8th record (each row depends on its own record only; all 367 in one process took 25-50 s): the rows
    # of both ranks' shares and of every task family.
    rows = np.arange(0, len(dataset), 8)
    expected = run_extraction(model, [dataset[int(row)] for row in rows], kind="lora", dim=FEATURE_DIM, batch_size=4,
                              seed=seed, show_progress=False).features
    np.testing.assert_allclose(np.load(lora_analysis / "features.npy")[rows], expected, rtol=0, atol=1e-4)


def test_the_lora_job_draws_its_windows_at_the_logged_shares_and_weighs_each_samples_loss(lora_run: Path):
    plan, log = Plan.load(lora_run / "plan"), log_of(lora_run)
    assert [line["window"] for line in log] == [0, 1]  # window 2 closes after the last step
    assert _ranks_train_other_samples(lora_run)
    traces = [read_trace(lora_run, rank) for rank in range(2)]
    per_window = ADAPT_EVERY * plan.gradient_accumulation_steps  # micro-steps of one rank in a window
    natural = plan.cluster_sizes / plan.cluster_sizes.sum()
    for window, shares in enumerate([natural, np.array(log[0]["shares"])]):
        records = [record for trace in traces for record in trace[window * per_window:(window + 1) * per_window]]
        counts = np.bincount(plan.labels[[index for record in records for index in record["indices"]]],
                             minlength=plan.num_clusters)
        draws = window_draws(shares, ADAPT_EVERY * plan.global_batch_size)
        assert counts.tolist() == draws.tolist(), window
        # Each micro-step's loss is mean_i w_i loss_i, w the cluster's natural share over its share of the window's
        # draws: over the window, the sum of the log's per-cluster mean losses weighted so (not unweighted).
        weights = WEIGHTINGS.get_rule("cluster").cluster_weights(plan.cluster_sizes, draws.astype(np.float64), 1.0)
        trained = sum(record["loss"] for record in records) * plan.micro_batch_size
        losses = np.array(log[window]["train_loss"])
        assert trained == pytest.approx(float(np.dot(weights * counts, losses)), rel=1e-6), window
        assert trained != pytest.approx(float(np.dot(counts, losses)), rel=1e-4), window
    run_digest(lora_run)


def test_only_the_adapters_of_the_lora_job_train(lora_run: Path, small_job: Path):  # noqa: F811
    assert_only_the_adapters_trained(lora_run, small_job)


def test_a_lora_job_killed_mid_window_resumes_to_the_same_indices_losses_and_adapters(
        lora_run: Path, lora_analysis: Path, small_job: Path, tmp_path: Path):  # noqa: F811
    parts = tmp_path / "parts"
    # Rank 1 dies (SIGKILL) right after step 5; the last checkpoint is step 4's, inside window 1 (steps 4 to 6).
    killed = run_deepspeed([FAULT_WORKER, *lora_hook_args(small_job, parts, lora_analysis, "--save-every", "2")[2:]],
                           timeout=300, env_extra={KILL_AFTER_STEP_VAR: "5"})
    assert killed.returncode != 0
    assert (parts / "checkpoints" / "latest").read_text().strip() == "global_step4"
    lines_before = {rank: len(read_trace(parts, rank)) for rank in range(2)}
    gas = Plan.load(parts / "plan").gradient_accumulation_steps
    # Relaunched through mpirun: the checkpoint, not the launcher, carries the adapters and the schedule.
    check(run_mpirun(lora_hook_args(small_job, parts, lora_analysis, "--save-every", "2", "--resume",
                                    "--save-model", str(parts / "adapters")), timeout=300))
    for rank in range(2):
        expected, trace = read_trace(lora_run, rank), read_trace(parts, rank)
        replayed = trace[:4 * gas] + trace[lines_before[rank]:]
        assert [r["indices"] for r in replayed] == [r["indices"] for r in expected], f"rank {rank}"
        assert np.allclose([r["loss"] for r in replayed], [r["loss"] for r in expected], rtol=0, atol=1e-6)
    assert log_of(parts) == log_of(lora_run)
    assert run_digest(parts) == run_digest(lora_run)
    assert_only_the_adapters_trained(parts, small_job)


# ------------------------------------------------------------------------------------------ the hook, ZeRO 0 and 2
@pytest.mark.parametrize("stage,launcher", [(0, run_mpirun), (2, run_deepspeed)],
                         ids=["zero0 mpirun", "zero2 deepspeed launcher"])
def test_a_lora_job_trains_the_adapters_on_the_plan(small_job: Path, tmp_path: Path, stage: int,  # noqa: F811
                                                    launcher: Callable[..., subprocess.CompletedProcess]):
    check(launcher(train_args(small_job, f"zero{stage}.json", tmp_path, "--max-steps", "4", *LORA, "--save-model",
                              str(tmp_path / "adapters")), timeout=300))
    assert_run_follows_plan(tmp_path, loss_falls=False)
    assert_only_the_adapters_trained(tmp_path, small_job)


# ------------------------------------------------------------------------------------------ the trainers
def trainer_config(small_job: Path, folder: Path, stage: int) -> Path:
    """zeroN.json reading the small job's analysis, 20% kept."""
    config = json.loads((REPO / "ds_configs" / f"zero{stage}.json").read_text())
    config["data_efficiency"]["data_sampling"]["cluster_sampling"].update(
        analysis_path=str(small_job / "analysis"), budget_ratio=0.2)
    path = folder / f"zero{stage}.json"
    path.write_text(json.dumps(config))
    return path


def expected_plan(config_path: Path, num_rows: int) -> Plan:
    """The plan built here, independently of the trainer, for the run's batch shape."""
    config = ClusterSamplingConfig.from_ds_config(config_path)
    inputs = AnalysisDir(config.analysis_path).load_inputs(num_rows)
    ds_config = json.loads(config_path.read_text())
    return plan_of_inputs(inputs, config, world_size=2, micro_batch_size=ds_config["train_micro_batch_size_per_gpu"],
                          gradient_accumulation_steps=ds_config["gradient_accumulation_steps"])


def trainer_args(worker: str, small_job: Path, config: Path, out: Path, *extra: str) -> list[str]:
    return [worker, "--deepspeed", str(config), "--model", str(small_job / "model"), "--data",
            str(small_job / "train.jsonl"), "--out", str(out), "--max-steps", str(TRAINER_STEPS), "--save-steps",
            str(TRAINER_SAVE), *LORA, *extra]


@pytest.fixture(scope="module")
def hf_run(small_job: Path, tmp_path_factory) -> Path:  # noqa: F811
    """ClusterTrainer given a PeftModel, ZeRO-3, under the deepspeed launcher."""
    out = tmp_path_factory.mktemp("peft_hf")
    config = trainer_config(small_job, out, 3)
    check(run_deepspeed(trainer_args(HF_WORKER, small_job, config, out / "run"), timeout=300))
    return out


def test_cluster_trainer_trains_a_peft_model_on_its_plan_batches(hf_run: Path, small_job: Path):  # noqa: F811
    plan = expected_plan(hf_run / "zero3.json", sum(1 for _ in (small_job / "train.jsonl").open()))
    assert (hf_run / "run" / "plan_fingerprint.txt").read_text() == plan.fingerprint()
    assert plan.steps_per_epoch < TRAINER_SAVE, "the checkpoint should be in the second epoch"
    assert_trainer_follows_plan(hf_run / "run", plan, TRAINER_STEPS)
    # Trainer checkpoints a PeftModel as its adapters (beside DeepSpeed's state), not the whole model.
    checkpoint = hf_run / "run" / f"checkpoint-{TRAINER_SAVE}"
    assert (checkpoint / "adapter_model.safetensors").is_file() and not (checkpoint / "model.safetensors").exists()


def test_cluster_trainer_resumes_a_peft_model_to_the_same_sequence(hf_run: Path, small_job: Path,  # noqa: F811
                                                                   tmp_path: Path):
    # New processes under mpirun, from the checkpoint inside the second epoch, to the same last step.
    check(run_mpirun(trainer_args(HF_WORKER, small_job, hf_run / "zero3.json", tmp_path, "--resume",
                                  str(hf_run / "run" / f"checkpoint-{TRAINER_SAVE}")), timeout=300))
    skipped = TRAINER_SAVE * json.loads((hf_run / "zero3.json").read_text())["gradient_accumulation_steps"]
    for rank in range(2):
        expected, got = read_trace(hf_run / "run", rank)[skipped:], read_trace(tmp_path, rank)
        assert [r["indices"] for r in got] == [r["indices"] for r in expected], f"rank {rank}"
        assert [r["step"] for r in got] == [r["step"] for r in expected]
        # Same adapters, optimizer state and data: the same fp32 losses.
        assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in expected], abs=1e-5)


def test_cluster_sft_trainer_given_a_peft_config_trains_the_adapters_on_its_plan_batches(
        small_job: Path, tmp_path: Path):  # noqa: F811
    config = trainer_config(small_job, tmp_path, 2)
    out = tmp_path / "run"
    check(run_mpirun(trainer_args(SFT_WORKER, small_job, config, out), timeout=300, env_extra=QUIET))
    run = json.loads((out / "run.json").read_text())
    # SFTTrainer wrapped the model (peft_config) before the plan was built: the model that trained is the PeftModel.
    assert run["model_class"] == "PeftModelForCausalLM"
    assert run["trainable"] and all("lora_" in name for name in run["trainable"])
    plan = expected_plan(config, run["num_rows"])
    assert (out / "plan_fingerprint.txt").read_text() == plan.fingerprint()
    assert_trainer_follows_plan(out, plan, TRAINER_STEPS)


# ------------------------------------------------------------------------------------------ bad inputs
def test_peft_models_that_cannot_train_as_asked_fail_on_every_rank_without_hanging(small_job: Path,  # noqa: F811
                                                                                  tmp_path: Path):
    """One 2-rank job, three cases in turn (tests/workers/peft_check_worker.py): every adapter frozen; rank 1's alone
    frozen; rank 1 with LoRA of rank 8, rank 0 of rank 4. deepspeed.initialize raises on both ranks, naming it."""
    config = trainer_config(small_job, tmp_path, 2)
    started = time.monotonic()
    check(run_mpirun([CHECK_WORKER, "--deepspeed", str(config), "--model", str(small_job / "model"), "--data",
                      str(small_job / "train.jsonl"), "--out", str(tmp_path / "out")], timeout=FAIL_WITHIN_S + 60))
    assert time.monotonic() - started < FAIL_WITHIN_S
    for rank in range(2):
        outcome = json.loads((tmp_path / "out" / f"rank{rank}.json").read_text())
        assert outcome["frozen"].startswith("ValueError: "), (rank, outcome["frozen"])
        # Rank 0, whose model was sound, raises too, quoting rank 1's error.
        for case in ("frozen", "frozen on rank 1"):
            assert "PeftModelForCausalLM has no trainable parameters" in outcome[case], (rank, case, outcome[case])
            assert "Give the adapters requires_grad" in outcome[case], (rank, case)
        assert outcome["rank 8 on rank 1"].startswith(
            "RuntimeError: ranks disagree on the trainable parameters (names and shapes) and adapter configuration: "
            "ranks [1] differ from rank 0"), (rank, outcome["rank 8 on rank 1"])
        assert "Every rank must build and wrap the model the same way" in outcome["rank 8 on rank 1"]


def test_cluster_trainer_refuses_a_peft_model_with_nothing_to_train(small_job: Path, tmp_path: Path):  # noqa: F811
    """In one process, no launcher: the Trainer's plan building checks the model as the hook does."""
    from transformers import TrainingArguments

    from ds_cluster.data.dataset import load_instruction_dataset
    from ds_cluster.data.models import load_tokenizer
    from ds_cluster.integrations.hf import ClusterTrainer

    model = seeded_start(small_job)
    for param in model.parameters():
        param.requires_grad_(False)
    dataset = load_instruction_dataset(small_job / "train.jsonl", load_tokenizer(small_job / "model"), max_length=64)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, use_cpu=True, report_to=[])
    block = {"enabled": True, "num_clusters": 3, "kmeans_n_init": 1, "analysis_path": str(small_job / "analysis")}
    trainer = ClusterTrainer(model=model, args=args, train_dataset=dataset, cluster_config=block)
    with pytest.raises(ValueError, match="PeftModelForCausalLM has no trainable parameters"):
        trainer.get_train_dataloader()
    assert trainer.plan is None
