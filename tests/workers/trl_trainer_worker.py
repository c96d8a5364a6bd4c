"""A ClusterSFTTrainer run under the deepspeed launcher that records every micro-batch it trains on.

Run by tests/test_trl_trainer.py (2 ranks, CPU). The data is what a TRL user
passes: a datasets.Dataset of prompt/completion records (the Alpaca prompt of
ds_cluster.data.dataset.format_prompt, the record's output), tokenized by
SFTTrainer itself. Each rank appends {"step", "indices", "loss"} per
micro-batch to OUT/trace/rank<R>.jsonl from inside compute_loss, i.e. what the
model really saw after SFTTrainer's, Trainer's and Accelerate's data handling.
Rank 0 writes OUT/plan_fingerprint.txt and OUT/run.json (rows, the plan's
summary, labels, cluster sizes and settings, what computing the analysis cost, Trainer's log history, the
class of the model that trained and its trainable parameters' names).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import datasets
from trl import SFTConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ds_cluster import distributed  # noqa: E402
from ds_cluster.data.dataset import format_prompt, read_jsonl  # noqa: E402
from ds_cluster.integrations.trl import ClusterSFTTrainer  # noqa: E402
from ds_cluster.data.models import load_model_and_tokenizer  # noqa: E402
from tests.workers.hf_trainer_worker import (TraceMixin, argument_values, train_traced,  # noqa: E402
                                            worker_arguments)


class TracingClusterSFTTrainer(TraceMixin, ClusterSFTTrainer):
    """ClusterSFTTrainer that writes each micro-batch's sample indices and loss to a per-rank JSONL."""


def sft_config(config_path: str, out: Path, max_steps: int, save_steps: int) -> SFTConfig:
    """SFTConfig with tests/workers/hf_trainer_worker.py's values (they agree with the DeepSpeed config).

    bf16 off, as in the DeepSpeed config (SFTConfig turns it on by default);
    TRL's default gradient checkpointing stays on.
    """
    values = argument_values(config_path, out, max_steps, save_steps)
    return SFTConfig(**{**values, "logging_steps": 2}, bf16=False, max_length=64)


def prompt_completion_dataset(path: str) -> datasets.Dataset:
    """The records as TRL's prompt-completion dataset (family kept: the analysis summary's purity reads it)."""
    return datasets.Dataset.from_list([{"prompt": format_prompt(record), "completion": record["output"],
                                        "family": record["family"]} for record in read_jsonl(path)])


def main() -> None:
    args = worker_arguments()
    out = Path(args.out)
    # SFTConfig first: it starts the process group and, under ZeRO-3, makes the model build partitioned.
    training_args = sft_config(args.deepspeed, out, args.max_steps, args.save_steps)
    model, tokenizer = load_model_and_tokenizer(args.model)
    # With --lora, SFTTrainer wraps the model itself (peft_config), as a TRL user's LoRA job does.
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=args.lora, lora_alpha=2 * args.lora, target_modules="all-linear",
                                 lora_dropout=0.0, task_type="CAUSAL_LM")
    trainer = TracingClusterSFTTrainer(model=model, args=training_args, processing_class=tokenizer,
                                       train_dataset=prompt_completion_dataset(args.data), peft_config=peft_config)
    if train_traced(trainer, out, args.resume) == 0:
        (out / "run.json").write_text(json.dumps({
            "num_rows": len(trainer.train_dataset), "plan": trainer.plan.summary(),
            "labels": trainer.plan.labels.tolist(), "cluster_sizes": trainer.plan.cluster_sizes.tolist(),
            "settings": trainer.plan.settings,
            "analysis_timings": (trainer.cluster_loader.analysis.to_json() if trainer.cluster_loader.analysis
                                 else {}), "log_history": trainer.state.log_history,
            "model_class": type(trainer.model).__name__,
            "trainable": [name for name, param in trainer.model.named_parameters() if param.requires_grad]}))
    del trainer
    distributed.shutdown()


if __name__ == "__main__":
    main()
