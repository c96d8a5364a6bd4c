"""ClusterTrainer (Hugging Face Trainer + DeepSpeed ZeRO-3, 2 ranks on CPU): plan batches per rank, exact resume.

The module's run starts without an analysis: the Trainer's job computes it (a forward-only engine of the model
under ZeRO-3) before its first step, as the hook does, and every later job of the module (the hook's run, the
resumed run) reads it instead of computing it again."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ds_cluster import ClusterSamplingConfig, Plan
from tests.planning import plan_of_inputs
from ds_cluster.analysis.folder import AnalysisDir
from ds_cluster.integrations.hf import SAMPLER_STATE_FILE, ClusterTrainer
from tests.launching import REPO, check, run_deepspeed, run_mpirun, shm_buffers
from tests.training import (TRAIN, assert_step_is_the_reference_gradient, assert_trainer_follows_plan,
                            read_trace, write_gradient_job)

WORKER = REPO / "tests" / "workers" / "hf_trainer_worker.py"
WORLD = 2
MAX_STEPS = 7
SAVE_STEPS = 5  # with 4 steps per epoch: a checkpoint inside the second epoch


@pytest.fixture(scope="module")
def trainer_config(small_job: Path, tmp_path_factory) -> Path:  # noqa: F811
    """zero3.json with a small budget (about 4 optimizer steps per epoch) and an analysis folder the first job
    fills."""
    config = json.loads((REPO / "ds_configs" / "zero3.json").read_text())
    block = config["data_efficiency"]["data_sampling"]["cluster_sampling"]
    block.update(analysis_path=str(tmp_path_factory.mktemp("hf_analysis") / "analysis"), budget_ratio=0.2)
    path = small_job / "hf_zero3.json"
    path.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def expected_plan(small_job: Path, trainer_config: Path, uninterrupted_run: Path) -> Plan:  # noqa: F811
    """The plan built here, independently of the Trainer, for the run's batch shape, from the analysis its job
    computed."""
    config = ClusterSamplingConfig.from_ds_config(trainer_config)
    num_samples = sum(1 for _ in (small_job / "train.jsonl").open())
    inputs = AnalysisDir(config.analysis_path).load_inputs(num_samples)
    ds_config = json.loads(trainer_config.read_text())
    return plan_of_inputs(inputs, config, world_size=WORLD,
                          micro_batch_size=ds_config["train_micro_batch_size_per_gpu"],
                          gradient_accumulation_steps=ds_config["gradient_accumulation_steps"])


def worker_args(job: Path, config: Path, out: Path, *extra: str) -> list[str]:
    return [str(WORKER), "--deepspeed", str(config), "--model", str(job / "model"), "--data", str(job / "train.jsonl"),
            "--out", str(out),
            "--max-steps", str(MAX_STEPS), "--save-steps", str(SAVE_STEPS), *extra]


@pytest.fixture(scope="module")
def uninterrupted_run(small_job: Path, trainer_config: Path, tmp_path_factory) -> Path:  # noqa: F811
    out = tmp_path_factory.mktemp("hf_whole")
    before = shm_buffers()
    check(run_deepspeed(worker_args(small_job, trainer_config, out), nproc=WORLD, timeout=300))
    (out / "shm_left.json").write_text(json.dumps(sorted(str(path) for path in shm_buffers() - before)))
    return out


@pytest.mark.integration
def test_a_trainer_job_leaves_no_shared_memory_behind(uninterrupted_run: Path):
    """Trainer starts DeepSpeed's CPU shm all-reduce (~66 MB per rank in /dev/shm) itself; ClusterTrainer unlinks it
    (the in-job analysis's forward-only engine included)."""
    assert json.loads((uninterrupted_run / "shm_left.json").read_text()) == []


def _analysis_manifest(trainer_config: Path) -> dict:
    return json.loads((Path(ClusterSamplingConfig.from_ds_config(trainer_config).analysis_path)
                       / "manifest.json").read_text())


@pytest.mark.integration
def test_cluster_trainer_computes_a_missing_analysis_in_its_job(uninterrupted_run: Path, trainer_config: Path):
    """analysis_path held nothing: the Trainer's job computed the analysis with a forward-only engine of its model
    under the job's ZeRO stage, on both ranks, before its first step (the later jobs read it: see below)."""
    manifest = _analysis_manifest(trainer_config)
    assert manifest["computed_by"] == "the training job (TracingClusterTrainer)"
    assert manifest["zero_stage"] == 3 and manifest["world_size"] == 2
    assert len(read_trace(uninterrupted_run, 0)) == MAX_STEPS * 2  # then trained: accumulation 2 in zero3.json


@pytest.mark.integration
def test_each_rank_trains_on_exactly_its_plan_batches(uninterrupted_run: Path, expected_plan: Plan):
    assert (uninterrupted_run / "plan_fingerprint.txt").read_text() == expected_plan.fingerprint()
    assert expected_plan.steps_per_epoch < MAX_STEPS, "the run should cross an epoch boundary"
    assert_trainer_follows_plan(uninterrupted_run, expected_plan, MAX_STEPS, WORLD)


@pytest.mark.integration
def test_the_hook_and_cluster_trainer_train_on_the_same_sequence(uninterrupted_run: Path, small_job: Path,  # noqa: F811
                                                                 trainer_config: Path, tmp_path: Path):
    """The same 2-rank job through the DeepSpeed hook (python -m ds_cluster.train) and through ClusterTrainer:
    one set-up (integrations/setup.py), so the same samples on every rank, micro-batch by micro-batch. The hook
    reads the analysis the Trainer's job computed, without computing it again."""
    manifest = _analysis_manifest(trainer_config)
    check(run_mpirun([*TRAIN, "--deepspeed", str(trainer_config), "--model", str(small_job / "model"),
                      "--data", str(small_job / "train.jsonl"), "--output-dir", str(tmp_path), "--max-length",
                      "64", "--trace", "--max-steps", str(MAX_STEPS), "--epochs", "10"], nproc=WORLD, timeout=300))
    for rank in range(WORLD):
        hook = [record["indices"] for record in read_trace(tmp_path, rank)]
        trainer = [record["indices"] for record in read_trace(uninterrupted_run, rank)]
        assert len(hook) == len(trainer) == MAX_STEPS * 2, rank  # accumulation 2 in zero3.json
        assert hook == trainer, f"rank {rank}: the hook and ClusterTrainer trained on other samples"
    assert _analysis_manifest(trainer_config) == manifest  # read, not recomputed


@pytest.mark.integration
def test_resume_from_a_checkpoint_continues_the_same_sequence(uninterrupted_run: Path, small_job: Path,  # noqa: F811
                                                              trainer_config: Path, tmp_path: Path,
                                                              expected_plan: Plan):
    checkpoint = uninterrupted_run / f"checkpoint-{SAVE_STEPS}"
    state = json.loads((checkpoint / SAMPLER_STATE_FILE).read_text())
    epoch, steps_in_epoch = divmod(SAVE_STEPS, expected_plan.steps_per_epoch)
    assert (state["epoch"], state["position"]) == (epoch, steps_in_epoch * expected_plan.gradient_accumulation_steps)
    assert state["plan_fingerprint"] == expected_plan.fingerprint()

    # New processes, resumed from the mid-epoch checkpoint, to the same last step (under mpirun: the checkpoint,
    # not the launcher, carries the sequence), reading the job's analysis.
    manifest = _analysis_manifest(trainer_config)
    resumed = tmp_path / "resumed"
    check(run_mpirun(worker_args(small_job, trainer_config, resumed, "--resume", str(checkpoint)),
                     nproc=WORLD, timeout=300))
    assert _analysis_manifest(trainer_config) == manifest
    skipped = SAVE_STEPS * expected_plan.gradient_accumulation_steps
    for rank in range(WORLD):
        expected, got = read_trace(uninterrupted_run, rank)[skipped:], read_trace(resumed, rank)
        assert [r["indices"] for r in got] == [r["indices"] for r in expected], f"rank {rank}"
        assert [r["step"] for r in got] == [r["step"] for r in expected]
        # Same parameters, optimizer state and data: the same fp32 losses.
        assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in expected], abs=1e-5)


def test_one_process_loader_follows_the_plan_and_refuses_a_checkpoint_of_another(small_job: Path,  # noqa: F811
                                                                                  trainer_config: Path,
                                                                                  tmp_path: Path):
    """In-process, no launcher: the loader is the plan for world 1, and a foreign checkpoint is an error."""
    from transformers import TrainingArguments

    from ds_cluster.data.dataset import load_instruction_dataset
    from ds_cluster.integrations.hf import ClusterTrainer
    from ds_cluster.data.models import load_model_and_tokenizer

    block = json.loads(trainer_config.read_text())["data_efficiency"]["data_sampling"]["cluster_sampling"]
    block = {**block, "preset": None, "allocation": "stratified", "num_clusters": 3, "kmeans_n_init": 1,
             "analysis_path": str(small_job / "analysis")}
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                             use_cpu=True, report_to=[])
    model, tokenizer = load_model_and_tokenizer(small_job / "model")
    dataset = load_instruction_dataset(small_job / "train.jsonl", tokenizer, max_length=64)
    trainer = ClusterTrainer(model=model, args=args, train_dataset=dataset, cluster_config=block)
    loader = trainer.get_train_dataloader()
    schedule = trainer.plan.epoch_layout(0)
    assert trainer.plan.world_size == 1 and len(loader) == trainer.plan.steps_per_epoch * 2
    assert [batch["sample_index"].tolist() for batch in loader] == schedule.reshape(-1, 4).tolist()
    assert next(iter(loader))["sample_weight"].tolist() == trainer.plan.weights[schedule[0, 0, 0]].astype(
        "float32").tolist()

    checkpoint = tmp_path / "checkpoint-1"
    checkpoint.mkdir()
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 1}))
    foreign = {**trainer.cluster_loader.state_dict(), "plan_fingerprint": "0123456789abcdef"}
    (checkpoint / SAMPLER_STATE_FILE).write_text(json.dumps(foreign))
    trainer._resume_checkpoint = str(checkpoint)
    with pytest.raises(ValueError, match="trained on plan 0123456789abcdef"):
        trainer.get_train_dataloader()


@pytest.fixture(scope="module")
def trainer_gradient_jobs(tmp_path_factory) -> dict:
    """ClusterTrainer's one step per loss reduction, both in one 2-rank launch (hf_grad_worker.py), under a bare
    mpirun: nothing sets RANK or WORLD_SIZE, so Trainer leaves the process group down, and ClusterTrainer must start
    it before planning (else each rank planned alone, trained the same batches, and the first step was 0.92 to 1.15
    of the reference). The deepspeed launcher trains the module's other Trainer run."""
    roots = {reduction: tmp_path_factory.mktemp(f"hf_grad_{reduction}") for reduction in ("sample", "token")}
    for reduction, root in roots.items():
        write_gradient_job(root, reduction)
    outs = [arg for root in roots.values() for arg in ("--out", str(root))]
    check(run_mpirun([str(REPO / "tests" / "workers" / "hf_grad_worker.py"), *outs], timeout=300))
    return roots


@pytest.mark.integration
@pytest.mark.parametrize("reduction", ["sample", "token"])
def test_trainer_step_is_the_hooks_gradient(trainer_gradient_jobs, reduction):
    """ClusterTrainer's one SGD step over the whole kept subset (2 ranks x micro 2 x 3 accumulation steps)
    equals the gradient by hand that the DeepSpeed hook's step is checked against in tests/test_hook.py
    (same model, data, block and DeepSpeed config), for both loss reductions: the Trainer's own scaling by
    the accumulation steps and DeepSpeed's agree."""
    assert_step_is_the_reference_gradient(trainer_gradient_jobs[reduction], reduction)


def test_a_data_parallel_group_smaller_than_the_world_is_refused_with_a_clear_error(small_job: Path,  # noqa: F811
                                                                                   tmp_path: Path):
    """The Trainer's adapter deals the plan over every rank; sequence parallelism (here the DeepSpeed config's
    sequence_parallel_size) would make the data-parallel group smaller than the world: refused by name, before
    any plan is built (the hook, with an mpu, plans over the mpu's data-parallel group instead)."""
    from transformers import TrainingArguments

    from ds_cluster.data.dataset import load_instruction_dataset
    from ds_cluster.data.models import load_model_and_tokenizer

    config = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    config["sequence_parallel_size"] = 2
    config["data_efficiency"]["data_sampling"]["cluster_sampling"]["analysis_path"] = str(small_job / "analysis")
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], deepspeed=config,
                             per_device_train_batch_size=2, gradient_accumulation_steps=1)
    model, tokenizer = load_model_and_tokenizer(small_job / "model")
    dataset = load_instruction_dataset(small_job / "train.jsonl", tokenizer, max_length=64)
    trainer = ClusterTrainer(model=model, args=args, train_dataset=dataset)
    with pytest.raises(ValueError, match=r"every rank must be a data-parallel rank; this run asks for 2 ranks of "
                                         r"model, context or sequence parallelism .*sequence_parallel_size"):
        trainer.get_train_dataloader()
    assert trainer.plan is None
