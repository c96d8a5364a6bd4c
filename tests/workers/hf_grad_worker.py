"""One optimizer step of ClusterTrainer (Hugging Face Trainer + DeepSpeed) with SGD at lr 1; saves the step.

Run by tests/test_hf_trainer.py under a bare mpirun (2 ranks), on the same model, data and
cluster block as tests/workers/grad_worker.py runs through the DeepSpeed hook: the global batch is the
whole kept subset, so parameters before minus after is the gradient, which the test compares with the
same by-hand estimate the hook is checked against. Each --out folder (one per loss reduction) gets its
own Trainer, one after the other, in one launch.
"""
from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import numpy as np
from transformers import TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ds_cluster import distributed  # noqa: E402
from ds_cluster.integrations.hf import ClusterTrainer  # noqa: E402
from tests.workers.feature_fixtures import tiny_llama, token_dataset  # noqa: E402


def one_step(out: Path) -> None:
    """One optimizer step of the job in `out`; rank 0 saves out/delta.npz."""
    # Values the Trainer checks against the DeepSpeed config: micro 2, accumulation 3, lr 1, no clipping.
    training_args = TrainingArguments(
        output_dir=str(out / "trainer"), deepspeed=str(out / "ds_config.json"), max_steps=1, save_strategy="no",
        per_device_train_batch_size=2, gradient_accumulation_steps=3, learning_rate=1.0, max_grad_norm=0.0,
        weight_decay=0.0, lr_scheduler_type="constant", logging_steps=1000, report_to=[], disable_tqdm=True, seed=0)
    model = tiny_llama(seed=0)
    dataset = token_dataset(int(np.load(out / "analysis" / "labels.npy").shape[0]), seed=1)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer = ClusterTrainer(model=model, args=training_args, train_dataset=dataset)
    trainer.train()
    if distributed.get_rank() == 0:
        after = dict(trainer.model.named_parameters())
        np.savez(out / "delta.npz", **{name: (before[name] - after[name].detach()).numpy() for name in before})
    del trainer
    gc.collect()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, action="append", help="a job folder; repeat for several")
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    for out in args.out:
        one_step(Path(out))
    distributed.shutdown()


if __name__ == "__main__":
    main()
