"""ClusterSFTTrainer (TRL's SFTTrainer + DeepSpeed ZeRO-3, 2 ranks on CPU): the job's own analysis, plan batches
per rank over an epoch boundary, exact resume; in one process, the labels the weighted loss reads and the refused
SFTConfig options."""
from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path

import pytest

from ds_cluster import ClusterSamplingConfig, Plan
from tests.planning import plan_of_inputs
from ds_cluster.analysis.folder import AnalysisDir
from ds_cluster.integrations.hf import SAMPLER_STATE_FILE
from tests.launching import REPO, check, run_deepspeed, run_mpirun, shm_buffers
from tests.training import assert_trainer_follows_plan, read_trace

WORKER = REPO / "tests" / "workers" / "trl_trainer_worker.py"
WORLD = 2
# 367 records, 20% kept, 2 ranks x micro 4 x 2 accumulation steps: 4 optimizer steps per epoch, so the
# checkpoint at step 7 is inside the second epoch and the run ends inside the third.
MAX_STEPS = 9
SAVE_STEPS = 7
JOB_TIMEOUT_S = 300
# The launches need no network: TRL's start-up ping stays off (HF_HUB_OFFLINE is set by tests/launching.py too).
QUIET = {"HF_HUB_DISABLE_TELEMETRY": "1"}


@pytest.fixture(scope="module")
def sft_job(small_job: Path, tmp_path_factory) -> Path:  # noqa: F811
    """zero3.json with the recommended preset, 20% kept, and an analysis_path that holds nothing yet."""
    root = tmp_path_factory.mktemp("trl_job")
    config = json.loads((REPO / "ds_configs" / "zero3.json").read_text())
    block = config["data_efficiency"]["data_sampling"]["cluster_sampling"]
    block.update(preset="recommended", budget_ratio=0.2, analysis_path=str(root / "analysis"))
    (root / "zero3.json").write_text(json.dumps(config))
    return root


def worker_args(job: Path, sft: Path, out: Path, *extra: str) -> list[str]:
    return [str(WORKER), "--deepspeed", str(sft / "zero3.json"), "--model", str(job / "model"),
            "--data", str(job / "train.jsonl"), "--out", str(out),
            "--max-steps", str(MAX_STEPS), "--save-steps", str(SAVE_STEPS), *extra]


def analysis_digest(folder: Path) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.glob("*")) if path.is_file()}


@pytest.fixture(scope="module")
def uninterrupted_run(small_job: Path, sft_job: Path, tmp_path_factory) -> Path:  # noqa: F811
    out = tmp_path_factory.mktemp("trl_whole")
    assert not (sft_job / "analysis").exists()
    before = shm_buffers()
    result = check(run_deepspeed(worker_args(small_job, sft_job, out), nproc=WORLD, timeout=JOB_TIMEOUT_S,
                                 env_extra=QUIET))
    # Only this job's buffers (named by its port): other jobs on the machine may hold theirs right now.
    port = re.search(r"--master_port[= ](\d+)", result.stdout + result.stderr).group(1)
    left = [str(path) for path in shm_buffers() - before if f"_{port}_" in path.name]
    (out / "shm_left.json").write_text(json.dumps({"port": port, "left": sorted(left)}))
    return out


@pytest.fixture(scope="module")
def expected_plan(sft_job: Path, uninterrupted_run: Path) -> Plan:
    """The plan built here from the analysis the job wrote, independently of the trainer, for the run's batch shape."""
    config = ClusterSamplingConfig.from_ds_config(sft_job / "zero3.json")
    num_rows = json.loads((uninterrupted_run / "run.json").read_text())["num_rows"]
    inputs = AnalysisDir(config.analysis_path).load_inputs(num_rows)
    ds_config = json.loads((sft_job / "zero3.json").read_text())
    return plan_of_inputs(inputs, config, world_size=WORLD,
                          micro_batch_size=ds_config["train_micro_batch_size_per_gpu"],
                          gradient_accumulation_steps=ds_config["gradient_accumulation_steps"])


@pytest.mark.integration
def test_the_job_computes_the_analysis_of_sfttrainers_rows(uninterrupted_run: Path, sft_job: Path,
                                                           small_job: Path):  # noqa: F811
    run = json.loads((uninterrupted_run / "run.json").read_text())
    assert run["analysis_timings"]["extract"] > 0, "the analysis was read, not computed in the job"
    manifest = json.loads((sft_job / "analysis" / "manifest.json").read_text())
    assert manifest["computed_by"] == "the training job (TracingClusterSFTTrainer)"
    summary = json.loads((sft_job / "analysis" / "summary.json").read_text())
    # One row per record: every record has a completion, so SFTTrainer dropped none.
    records = sum(1 for _ in (small_job / "train.jsonl").open())
    assert summary["num_samples"] == run["num_rows"] == records
    # The view of SFTTrainer's rows carries the records' family: the summary's purity is computed from it.
    assert summary.get("purity") is not None


@pytest.mark.integration
def test_each_rank_trains_on_exactly_its_plan_batches(uninterrupted_run: Path, expected_plan: Plan):
    assert (uninterrupted_run / "plan_fingerprint.txt").read_text() == expected_plan.fingerprint()
    assert expected_plan.steps_per_epoch < SAVE_STEPS < MAX_STEPS, "the run should cross an epoch boundary"
    assert_trainer_follows_plan(uninterrupted_run, expected_plan, MAX_STEPS, WORLD)


@pytest.mark.integration
def test_sfttrainers_metrics_are_logged_from_the_weighted_path(uninterrupted_run: Path):
    history = json.loads((uninterrupted_run / "run.json").read_text())["log_history"]
    logs = [entry for entry in history if "loss" in entry]
    assert [entry["step"] for entry in logs] == list(range(2, MAX_STEPS, 2))
    for entry in logs:
        assert math.isfinite(entry["loss"]) and 0 <= entry["mean_token_accuracy"] <= 1 and entry["entropy"] > 0
    tokens = [entry["num_tokens"] for entry in logs]
    assert tokens == sorted(tokens) and tokens[0] > 0


@pytest.mark.integration
def test_an_sft_job_leaves_no_shared_memory_behind(uninterrupted_run: Path):
    """Trainer starts DeepSpeed's CPU shm all-reduce (~66 MB per rank in /dev/shm) itself; the mixin unlinks it."""
    assert json.loads((uninterrupted_run / "shm_left.json").read_text())["left"] == []


@pytest.mark.integration
def test_resume_continues_the_same_sequence_on_the_jobs_analysis(uninterrupted_run: Path, small_job: Path,  # noqa: F811
                                                                 sft_job: Path, tmp_path: Path,
                                                                 expected_plan: Plan):
    checkpoint = uninterrupted_run / f"checkpoint-{SAVE_STEPS}"
    state = json.loads((checkpoint / SAMPLER_STATE_FILE).read_text())
    epoch, steps_in_epoch = divmod(SAVE_STEPS, expected_plan.steps_per_epoch)
    assert steps_in_epoch, "the checkpoint should be mid-epoch"
    assert (state["epoch"], state["position"]) == (epoch, steps_in_epoch * expected_plan.gradient_accumulation_steps)
    assert state["plan_fingerprint"] == expected_plan.fingerprint()

    analysis_before = analysis_digest(sft_job / "analysis")
    resumed = tmp_path / "resumed"
    check(run_mpirun(worker_args(small_job, sft_job, resumed, "--resume", str(checkpoint)), nproc=WORLD,
                     timeout=JOB_TIMEOUT_S, env_extra=QUIET))
    # The analysis the first job computed was read, not computed again (same files, no extraction).
    assert json.loads((resumed / "run.json").read_text())["analysis_timings"] == {}
    assert analysis_digest(sft_job / "analysis") == analysis_before
    assert (resumed / "plan_fingerprint.txt").read_text() == expected_plan.fingerprint()
    skipped = SAVE_STEPS * expected_plan.gradient_accumulation_steps
    for rank in range(WORLD):
        expected, got = read_trace(uninterrupted_run, rank)[skipped:], read_trace(resumed, rank)
        assert [r["indices"] for r in got] == [r["indices"] for r in expected], f"rank {rank}"
        assert [r["step"] for r in got] == [r["step"] for r in expected]
        # Same parameters, optimizer state and data: the same fp32 losses.
        assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in expected], abs=1e-5)


# ---------------------------------------------------------------------------------------------- one process
def _prompt_completion(small_job: Path):  # noqa: F811
    from tests.workers.trl_trainer_worker import prompt_completion_dataset

    return prompt_completion_dataset(str(small_job / "train.jsonl"))


def _one_process_config(tmp_path: Path, **options):
    from trl import SFTConfig

    return SFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, per_device_train_batch_size=4,
                     gradient_accumulation_steps=2, max_length=64, report_to=[], disable_tqdm=True, **options)


@pytest.fixture
def no_telemetry(monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_TELEMETRY", True)


@pytest.mark.parametrize("completion_only_loss", [None, False])
def test_the_weighted_loss_reads_sfttrainers_labels(small_job: Path, tmp_path: Path, no_telemetry,  # noqa: F811
                                                    completion_only_loss):
    """In-process, no launcher (world 1, the hand-made analysis): the loader is the plan; labels are -100 on the
    prompt exactly when completion_only_loss applies (its default for prompt-completion data), and the plan's
    padded view holds the same labels as the collated batch."""
    import torch

    from ds_cluster.data.dataset import IGNORE_INDEX, format_prompt, read_jsonl
    from ds_cluster.integrations.trl import ClusterSFTTrainer
    from ds_cluster.data.models import load_model_and_tokenizer

    block = {"enabled": True, "preset": None, "allocation": "stratified", "num_clusters": 3, "kmeans_n_init": 1,
             "budget_ratio": 0.2, "analysis_path": str(small_job / "analysis")}
    model, tokenizer = load_model_and_tokenizer(small_job / "model")
    args = _one_process_config(tmp_path, completion_only_loss=completion_only_loss)
    trainer = ClusterSFTTrainer(model=model, args=args, train_dataset=_prompt_completion(small_job),
                                processing_class=tokenizer, cluster_config=block)
    loader = trainer.get_train_dataloader()
    schedule = trainer.plan.epoch_layout(0)
    batches = list(loader)
    assert [batch["sample_index"].tolist() for batch in batches] == schedule.reshape(-1, 4).tolist()

    batch = batches[0]
    records = read_jsonl(small_job / "train.jsonl")
    view = trainer.cluster_plan_dataset()
    for row, index in enumerate(batch["sample_index"].tolist()):
        length = int(batch["attention_mask"][row].sum())
        prompt = len(tokenizer(format_prompt(records[index]))["input_ids"])
        labels, ids = batch["labels"][row], batch["input_ids"][row]
        assert (labels[length:] == IGNORE_INDEX).all()
        assert torch.equal(labels[prompt:length], ids[prompt:length])
        masked_prompt = (labels[:prompt] == IGNORE_INDEX).all()
        assert bool(masked_prompt) == (completion_only_loss is None), (completion_only_loss, labels[:prompt])
        assert torch.equal(view[index]["labels"][:length], labels[:length])
        assert (view[index]["labels"][length:] == IGNORE_INDEX).all()

    loss = trainer.compute_loss(trainer.model, batch)
    assert loss.requires_grad and math.isfinite(float(loss.detach()))
    assert 0 <= trainer._metrics["train"]["mean_token_accuracy"][-1] <= 1


@pytest.mark.parametrize("options,named", [
    ({"packing": True}, "packing"),
    ({"padding_free": True}, "padding_free"),
    ({"loss_type": "dft"}, "loss_type"),
    ({"label_smoothing_factor": 0.1}, "label_smoothing_factor"),
])
def test_options_that_change_a_sample_or_the_loss_are_refused(small_job: Path, tmp_path: Path,  # noqa: F811
                                                               no_telemetry, options, named):
    """Refused before SFTTrainer loads or tokenizes anything (the model is a path that is never read)."""
    from ds_cluster.integrations.trl import ClusterSFTTrainer

    block = {"enabled": True, "analysis_path": str(tmp_path / "analysis")}
    with pytest.raises(ValueError, match=named) as refused:
        ClusterSFTTrainer(model=str(tmp_path / "no_model"), args=_one_process_config(tmp_path, **options),
                          train_dataset=_prompt_completion(small_job), cluster_config=block)
    assert "cluster_sampling" in str(refused.value)


def test_a_streaming_dataset_is_refused(small_job: Path, tmp_path: Path, no_telemetry):  # noqa: F811
    from ds_cluster.integrations.trl import ClusterSFTTrainer

    streaming = _prompt_completion(small_job).to_iterable_dataset()
    block = {"enabled": True, "analysis_path": str(tmp_path / "analysis")}
    with pytest.raises(ValueError, match="cluster_sampling picks records by index.*map-style"):
        ClusterSFTTrainer(model=str(tmp_path / "no_model"), args=_one_process_config(tmp_path, max_steps=1),
                          train_dataset=streaming, cluster_config=block)
