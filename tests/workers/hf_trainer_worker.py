"""A ClusterTrainer run under the deepspeed launcher that records every micro-batch it trains on.

Run by tests/test_hf_trainer.py (2 ranks, CPU). Each rank appends
{"step", "indices", "loss"} per micro-batch to OUT/trace/rank<R>.jsonl, from
inside compute_loss, i.e. what the model really saw after Trainer's and
Accelerate's own data handling.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from transformers import TrainingArguments

from ds_cluster import distributed
from ds_cluster.data.dataset import load_instruction_dataset
from ds_cluster.ds_config import read_ds_config
from ds_cluster.integrations.hf import ClusterTrainer
from ds_cluster.data.models import load_model_and_tokenizer, with_lora


class TraceMixin:
    """Writes each micro-batch's sample indices and loss to a per-rank JSONL in `trace_dir`, from compute_loss."""

    trace_dir: Path

    def compute_loss(self, model, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs=return_outputs,  # type: ignore[misc]
                                    num_items_in_batch=num_items_in_batch)
        value = loss[0] if return_outputs else loss
        record = {"step": self.state.global_step, "indices": inputs["sample_index"].tolist(),  # type: ignore[attr-defined]
                  "loss": float(value.detach().float())}
        # The rank asked here, not before training: under a bare mpirun Trainer leaves the process group down (at
        # ZeRO 0-2) until ClusterTrainer starts it, and RANK is not set.
        with open(self.trace_dir / f"rank{distributed.get_rank()}.jsonl", "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
        return loss


class TracingClusterTrainer(TraceMixin, ClusterTrainer):
    """ClusterTrainer that writes each micro-batch's sample indices and loss to a per-rank JSONL."""


def argument_values(config_path: str, out: Path, max_steps: int, save_steps: int) -> dict[str, Any]:
    """TrainingArguments values that agree with the DeepSpeed config (Trainer rejects any mismatch)."""
    config, _ = read_ds_config(config_path)
    optimizer = config["optimizer"]["params"]
    return dict(
        output_dir=str(out), deepspeed=config_path, max_steps=max_steps, save_strategy="steps",
        save_steps=save_steps, per_device_train_batch_size=config["train_micro_batch_size_per_gpu"],
        gradient_accumulation_steps=config["gradient_accumulation_steps"], learning_rate=optimizer["lr"],
        adam_beta1=optimizer["betas"][0], adam_beta2=optimizer["betas"][1], adam_epsilon=optimizer["eps"],
        weight_decay=optimizer["weight_decay"], max_grad_norm=config["gradient_clipping"],
        lr_scheduler_type="constant", logging_steps=1000, report_to=[], disable_tqdm=True, seed=0,
        save_only_model=False)


def training_arguments(config_path: str, out: Path, max_steps: int, save_steps: int) -> TrainingArguments:
    return TrainingArguments(**argument_values(config_path, out, max_steps, save_steps))


def worker_arguments() -> argparse.Namespace:
    """The command line of a traced trainer run (this worker's and the TRL worker's)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--save-steps", type=int, required=True)
    parser.add_argument("--resume", default=None, help="checkpoint folder to resume from")
    parser.add_argument("--lora", type=int, default=0, help="train LoRA adapters of this rank (a peft PeftModel)")
    parser.add_argument("--local_rank", type=int, default=-1)
    return parser.parse_args()


def main() -> None:
    args = worker_arguments()
    out = Path(args.out)
    # TrainingArguments first: it starts the process group and, under ZeRO-3, makes the model build partitioned.
    training_args = training_arguments(args.deepspeed, out, args.max_steps, args.save_steps)
    model, tokenizer = load_model_and_tokenizer(args.model)
    if args.lora:
        model = with_lora(model, args.lora)
    dataset = load_instruction_dataset(args.data, tokenizer, max_length=64)
    trainer = TracingClusterTrainer(model=model, args=training_args, train_dataset=dataset)
    train_traced(trainer, out, args.resume)
    del trainer
    distributed.shutdown()


def train_traced(trainer: Any, out: Path, resume: Any) -> int:
    """Train with a per-rank trace in OUT/trace; rank 0 writes the plan's fingerprint. Returns the rank."""
    (out / "trace").mkdir(parents=True, exist_ok=True)
    trainer.trace_dir = out / "trace"
    trainer.train(resume_from_checkpoint=resume)
    # The process group's rank (Accelerate counts one process for DeepSpeed on CPU), once training has started it.
    rank = distributed.get_rank()
    if rank == 0:
        (out / "plan_fingerprint.txt").write_text(trainer.plan.fingerprint())
    return rank


if __name__ == "__main__":
    main()
