"""What one training step of stories260K on the T0 slice costs without DeepSpeed: one process, one thread,
forward + backward + AdamW on 32 records at the benchmark's max length, to compare with the benchmark job's
CPU s per rank-step (its loop CPU s / steps / 2 ranks).

    python bench/step_cost.py [--max-length 160] [--records 1024]

Reads the training split the default run wrote (runs/bench_real_quality/data/train.jsonl) or, without it,
the shipped T0 slice's train file.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ds_cluster.data.dataset import InstructionDataset, read_jsonl, trim_padding_collate  # noqa: E402
from ds_cluster.data.models import load_model_and_tokenizer  # noqa: E402
from bench.real import STORIES260K_DIR, T0_DIR  # noqa: E402

BATCH = 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-length", type=int, default=160)
    parser.add_argument("--records", type=int, default=1024)
    args = parser.parse_args()
    torch.set_num_threads(1)
    split = REPO / "runs" / "bench_real_quality" / "data" / "train.jsonl"
    records = read_jsonl(split if split.exists() else T0_DIR / "train.jsonl.gz")[:args.records]
    model, tokenizer = load_model_and_tokenizer(str(STORIES260K_DIR))
    dataset = InstructionDataset(records, tokenizer, max_length=args.max_length)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = [trim_padding_collate([dataset[i] for i in range(start, start + BATCH)])
               for start in range(0, len(dataset) - BATCH + 1, BATCH)]

    def step(batch: dict) -> None:
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    step(batches[0])  # warm-up
    cpu, wall = time.process_time(), time.time()
    for batch in batches[1:]:
        step(batch)
    steps = len(batches) - 1
    print(f"{steps} steps of {BATCH} records at max length {args.max_length}: "
          f"{(time.process_time() - cpu) / steps:.3f} CPU s, {(time.time() - wall) / steps:.3f} wall s per step")


if __name__ == "__main__":
    main()
