"""SmolLM2-135M-Instruct's training throughput under DeepSpeed on 2 CPU ranks: which precision, ZeRO stage, micro
batch and accumulation the benchmark should train with, measured side by side in one job.

    OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu MASTER_ADDR=127.0.0.1 GLOO_SOCKET_IFNAME=lo \\
        deepspeed --num_gpus 2 --master_addr 127.0.0.1 --master_port 29741 bench/train_throughput.py

`--lora` measures instead the benchmark's recipe (ZeRO-0, bf16 block, micro batch 4, no accumulation) with every
weight training against LoRA adapters of rank 8 (the base frozen), alternating, each twice, written to
bench/results/train_throughput_lora.{json,md}.

Every setting trains a fresh copy of the model for WARMUP + STEPS optimizer steps on seeded T0 records (each
rank its own), every micro-batch cut to its longest row, torch AdamW; the figure is real (attended) tokens
trained per second of wall time over both ranks, the warm-up left out. Also a one-process plain-torch bf16
autocast step on rank 0's batches (no DeepSpeed, no communication) for scale. Rank 0 writes
bench/results/train_throughput.{json,md}.
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.real import T0_DIR  # noqa: E402
from ds_cluster import distributed  # noqa: E402
from ds_cluster.data.dataset import InstructionDataset, read_records, trim_padding_collate  # noqa: E402
from ds_cluster.data.models import load_model_and_tokenizer  # noqa: E402

WARMUP, STEPS = 1, 3
# (name, ZeRO stage, precision, micro batch, accumulation steps)
SETTINGS = [
    ("ZeRO-2, bf16 block, micro 8, accumulation 1", 2, "bf16", 8, 1),
    ("ZeRO-2, bf16 block, micro 8, accumulation 4", 2, "bf16", 8, 4),
    ("ZeRO-2, bf16 autocast, micro 8, accumulation 4", 2, "autocast", 8, 4),
    ("ZeRO-0, bf16 autocast, micro 8, accumulation 4", 0, "autocast", 8, 4),
    ("ZeRO-0, bf16 block, micro 8, accumulation 4", 0, "bf16", 8, 4),
    ("ZeRO-2, bf16 autocast, micro 16, accumulation 2", 2, "autocast", 16, 2),
    ("ZeRO-2, fp32, micro 8, accumulation 4", 2, "fp32", 8, 4),
]
# --lora: the SmolLM2 benchmark's recipe, full fine-tuning against LoRA rank 8 (the last field), alternated so a
# drift of the host's speed falls on both.
LORA_RANK = 8
LORA_SETTINGS = [(f"ZeRO-0, bf16 block, micro 4, {name}", 0, "bf16", 4, 1, rank)
                 for _ in range(2) for name, rank in (("every weight", 0), (f"LoRA rank {LORA_RANK}", LORA_RANK))]


def config_of(stage: int, precision: str, micro: int, accumulation: int) -> dict:
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accumulation,
              "gradient_clipping": 1.0, "zero_optimization": {"stage": stage}, "steps_per_print": 10 ** 9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "torch_adam": True}}}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif precision == "autocast":
        config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    return config


def batches_for(dataset: InstructionDataset, rank: int, micro: int, count: int) -> list[dict]:
    order = np.random.default_rng(rank).permutation(len(dataset))
    return [trim_padding_collate([dataset[int(i)] for i in order[start:start + micro]])
            for start in range(0, count * micro, micro)]


def measure(model_dir: Path, dataset: InstructionDataset, setting: tuple) -> dict:
    import deepspeed

    name, stage, precision, micro, accumulation, *lora = setting
    model, _ = load_model_and_tokenizer(model_dir, rank=1)
    if lora and lora[0]:
        from ds_cluster.data.models import with_lora

        model = with_lora(model, rank=lora[0], seed=0)
    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=trainable,
                                      config=config_of(stage, precision, micro, accumulation))
    batches = batches_for(dataset, distributed.get_rank(), micro, (WARMUP + STEPS) * accumulation)
    engine.train()
    tokens, started = 0, None
    for number, batch in enumerate(batches):
        if number == WARMUP * accumulation:
            distributed.all_gather_object(None)
            started = time.perf_counter()
        loss = engine(**batch, use_cache=False).loss
        engine.backward(loss)
        engine.step()
        if number >= WARMUP * accumulation:
            tokens += int(batch["attention_mask"].sum())
    seconds = time.perf_counter() - started
    every = distributed.all_gather_object((tokens, seconds))
    engine.destroy()
    del engine, model
    gc.collect()
    total_tokens, wall = sum(t for t, _ in every), max(s for _, s in every)
    return {"setting": name, "stage": stage, "precision": precision, "micro": micro, "accumulation": accumulation,
            "lora_rank": lora[0] if lora else 0, "trainable_parameters": sum(p.numel() for p in trainable),
            "tokens": total_tokens, "seconds": wall, "tokens_per_s": total_tokens / wall,
            "seconds_per_step": wall / STEPS}


def plain_torch(model_dir: Path, dataset: InstructionDataset) -> dict:
    """One process, no DeepSpeed: forward, backward and AdamW under bf16 autocast, micro 8."""
    model, _ = load_model_and_tokenizer(model_dir, rank=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    batches = batches_for(dataset, 0, 8, WARMUP + STEPS)
    tokens, started = 0, None
    for number, batch in enumerate(batches):
        if number == WARMUP:
            started = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**batch, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if number >= WARMUP:
            tokens += int(batch["attention_mask"].sum())
    seconds = time.perf_counter() - started
    return {"setting": "plain torch, one process, bf16 autocast, micro 8", "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds}


def lora_ratio_line(rows: list[dict]) -> str:
    """LoRA's time per optimizer step over full fine-tuning's, each the mean over its repeats."""
    def mean_step(lora: bool) -> float:
        steps = [row["seconds_per_step"] for row in rows if bool(row["lora_rank"]) == lora]
        return sum(steps) / len(steps)

    full, lora = mean_step(False), mean_step(True)
    trainable = {bool(row["lora_rank"]): row["trainable_parameters"] for row in rows}
    return (f"LoRA rank {LORA_RANK} ({trainable[True]:,} trainable parameters of the PeftModel) takes {lora:.2f} s per "
            f"optimizer step against {full:.2f} s training every weight ({trainable[False]:,}): "
            f"{lora / full:.2f} of its time.")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=str(REPO / ".cache" / "smollm2-135m-instruct"))
    parser.add_argument("--max-length", type=int, default=136)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "train_throughput"))
    parser.add_argument("--lora", action="store_true",
                        help="full fine-tuning against LoRA rank 8 on the SmolLM2 benchmark's recipe")
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    if args.lora and args.out == parser.get_default("out"):
        args.out = str(REPO / "bench" / "results" / "train_throughput_lora")
    distributed.init_distributed()
    _, tokenizer = load_model_and_tokenizer(args.model, rank=1)
    dataset = InstructionDataset(read_records(T0_DIR / "train.jsonl.gz")[:2000], tokenizer,
                                 max_length=args.max_length, rank=1)
    rows = [measure(Path(args.model), dataset, setting) for setting in (LORA_SETTINGS if args.lora else SETTINGS)]
    if distributed.get_rank() == 0:
        if not args.lora:
            rows.append(plain_torch(Path(args.model), dataset))
        lines = ["# SmolLM2-135M-Instruct: training throughput under DeepSpeed, 2 CPU ranks", "",
                 f"`bench/train_throughput.py` (2 ranks, one thread each); {platform.node()}, "
                 f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. T0 records, max length {args.max_length}, "
                 f"every micro-batch cut to its longest row; {STEPS} optimizer steps after {WARMUP} of warm-up.", "",
                 "| setting | real tokens | seconds | tokens / s | s / optimizer step |", "|---|---|---|---|---|"]
        lines += [f"| {row['setting']} | {row['tokens']} | {row['seconds']:.1f} | {row['tokens_per_s']:.0f} | "
                  f"{row['seconds'] / STEPS:.2f} |" for row in rows]
        if args.lora:
            lines += ["", lora_ratio_line(rows)]
        Path(args.out).with_suffix(".json").write_text(json.dumps(rows, indent=1))
        Path(args.out).with_suffix(".md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines), flush=True)
    distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
