"""The cluster loader's own overhead per step, against a plain torch DataLoader over the same data.

    python bench/sampler_overhead.py [--step-ms 50]      # bench/results/sampler_overhead.{json,md}

One process, no training: an epoch of rank 0's micro-batches from `ClusterDataLoader` (the plan's
schedule, per-sample weights, the token normaliser of each step) and from a shuffled
`torch.utils.data.DataLoader` with the same dataset, micro batch and collate, each timed over
several epochs. The difference is what the sampler adds; it is divided by a training step's time
(the default, 50 ms, is the quality benchmark's full-data step: 108 s / 2144 steps, 2 ranks, ZeRO-2).
The quality benchmark also measures the loader's whole share of the loop inside the hook
(bench/results/quality.md, "Time").
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--step-ms", type=float, default=50.0)
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()

    import numpy as np
    import torch

    from ds_cluster import ClusterSamplingConfig, build_plan
    from ds_cluster.data.dataset import load_instruction_dataset
    from ds_cluster.loader.sampler import ClusterDataLoader
    from bench.toy.tasks import DEFAULT_DATA
    from bench.toy.tokenizer import build_tokenizer

    torch.set_num_threads(1)
    dataset = load_instruction_dataset(DEFAULT_DATA / "train.jsonl", build_tokenizer(), max_length=96)
    labels = np.array([sorted(set(dataset.categories)).index(f) for f in dataset.categories], dtype=np.int64)
    config = ClusterSamplingConfig.from_dict({"enabled": True, "preset": "recommended", "budget_ratio": 1.0,
                                              "selection": "random"})
    plan = build_plan(None, config, world_size=2, micro_batch_size=8, gradient_accumulation_steps=1, labels=labels)
    cluster_loader = ClusterDataLoader(dataset, plan, rank=0, sum_over_ranks=lambda counts: counts * 2)
    plain_loader = torch.utils.data.DataLoader(dataset, batch_size=8, shuffle=True,
                                               generator=torch.Generator().manual_seed(0))

    def seconds_per_batch(loader) -> float:
        batches, started = 0, time.perf_counter()
        for _ in range(args.epochs):
            for _ in loader:
                batches += 1
        return (time.perf_counter() - started) / batches

    seconds_per_batch(plain_loader)  # warm-up: first-touch costs go to neither
    plain = min(seconds_per_batch(plain_loader) for _ in range(3))
    cluster = min(seconds_per_batch(cluster_loader) for _ in range(3))
    overhead = cluster - plain
    result = {"cluster_loader_ms_per_micro_batch": cluster * 1e3, "plain_loader_ms_per_micro_batch": plain * 1e3,
              "sampler_overhead_ms": overhead * 1e3, "step_ms": args.step_ms,
              "overhead_share_of_step": overhead * 1e3 / args.step_ms, "num_samples": len(dataset)}
    text = "\n".join([
        "# The cluster loader's overhead per step", "",
        f"`python bench/sampler_overhead.py --step-ms {args.step_ms:g}`: the shipped mixture ({len(dataset)} "
        f"samples), micro batch 8, rank 0 of 2, best of 3 x {args.epochs} epochs each.", "",
        "| loader | ms per micro-batch |", "|---|---|",
        f"| torch DataLoader, shuffled | {plain * 1e3:.3f} |",
        f"| ds_cluster ClusterDataLoader | {cluster * 1e3:.3f} |", "",
        f"The sampler adds {overhead * 1e3:.3f} ms per micro-batch: {overhead * 1e3 / args.step_ms:.2%} of a "
        f"{args.step_ms:g} ms training step (goal: under 1%)."]) + "\n"
    (REPO / "bench" / "results" / "sampler_overhead.md").write_text(text)
    (REPO / "bench" / "results" / "sampler_overhead.json").write_text(json.dumps(result, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
