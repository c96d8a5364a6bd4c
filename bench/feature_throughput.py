"""Feature extraction throughput against training throughput, side by side in one run.

Run on 2 ranks (CPU):

    OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu MASTER_ADDR=127.0.0.1 GLOO_SOCKET_IFNAME=lo \\
    TORCH_EXTENSIONS_DIR=.torch_extensions \\
    deepspeed --num_gpus 2 --master_addr 127.0.0.1 --master_port 29731 bench/feature_throughput.py

One engine (same model, data, ranks, micro batch) times one full extraction
pass per feature kind (through the feature store, as `ds-cluster analyze`
does) and one training epoch (forward + backward + optimizer step on each
rank's half of the data). Goal: an extraction pass costs at most 0.4 of a
training epoch. Rank 0 writes bench/results/feature_throughput.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

GOAL_RATIO = 0.4


def _train_epoch(engine, dataset, batch_size: int, rank: int, world_size: int,
                 limit: int | None = None) -> tuple[float, int]:
    """Seconds and samples of one epoch over this rank's interleaved share (every rank runs the same step count)."""
    import torch

    from ds_cluster.distributed import all_gather_object

    indices = list(range(rank, len(dataset) - len(dataset) % (world_size * batch_size), world_size))
    batches = [indices[i:i + batch_size] for i in range(0, len(indices), batch_size)][:limit]
    engine.train()
    all_gather_object(None)  # start together
    started = time.perf_counter()
    for batch_indices in batches:
        items = [dataset[i] for i in batch_indices]
        batch = {key: torch.stack([item[key] for item in items]) for key in ("input_ids", "attention_mask", "labels")}
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
    all_gather_object(None)
    return time.perf_counter() - started, len(batches) * batch_size * world_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--model", default=None, help="a checkpoint folder (default: the toy base model)")
    parser.add_argument("--total", type=int, default=3200, help="records of the synthetic instruction mixture")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=96)
    parser.add_argument("--zero", type=int, default=2, help="ZeRO stage of the engine")
    parser.add_argument("--lm-head-dim", type=int, default=1024)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "feature_throughput"))
    args = parser.parse_args()

    import deepspeed
    import torch

    from ds_cluster.data.dataset import load_instruction_dataset
    from ds_cluster.distributed import all_gather_object, get_rank, get_world_size, init_distributed, shutdown
    from ds_cluster.distributed import collectives as distributed_collectives
    from ds_cluster.features.extract import run_extraction
    from ds_cluster.data.models import load_model_and_tokenizer
    from bench.toy.models import base_model_path
    from bench.toy.tasks import generate_mixture

    init_distributed()
    rank, world_size = get_rank(), get_world_size()
    ds_config = {
        "train_micro_batch_size_per_gpu": args.batch_size, "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": args.zero},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "steps_per_print": 10**9,
    }
    model, tokenizer = load_model_and_tokenizer(args.model or base_model_path(), ds_config=ds_config)
    records, _ = generate_mixture(seed=0, total=args.total)
    dataset = load_instruction_dataset(records, tokenizer, max_length=args.max_length)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    num_params = sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())

    store_root = Path(all_gather_object(tempfile.mkdtemp(prefix="ds_cluster_bench_") if rank == 0 else None)[0])
    # Warm-up (allocator, first-call costs) for both sides, not timed.
    _train_epoch(engine, dataset, args.batch_size, rank, world_size, limit=3)
    run_extraction(engine, [dataset[i] for i in range(4 * args.batch_size)], kind="proxy",
                   batch_size=args.batch_size, show_progress=False, collectives=distributed_collectives())

    results: dict = {}
    for kind, dim in (("proxy", None), ("lm_head", args.lm_head_dim)):
        all_gather_object(None)
        started = time.perf_counter()
        extraction = run_extraction(engine, dataset, kind=kind, dim=dim, batch_size=args.batch_size,
                                    store=store_root / kind, overwrite=True, show_progress=False,
                                    collectives=distributed_collectives())
        seconds = time.perf_counter() - started
        results[kind] = {"dim": extraction.dim, "seconds": round(seconds, 3),
                         "samples_per_s": round(len(dataset) / seconds, 1)}
    train_seconds, train_samples = _train_epoch(engine, dataset, args.batch_size, rank, world_size)
    train_rate = train_samples / train_seconds
    epoch_seconds = len(dataset) / train_rate  # an epoch over all N samples
    for entry in results.values():
        entry["ratio_to_training_epoch"] = round(entry["seconds"] / epoch_seconds, 3)
        entry["meets_goal"] = entry["ratio_to_training_epoch"] <= GOAL_RATIO

    if rank == 0:
        shutil.rmtree(store_root, ignore_errors=True)
        report = {
            "command": "OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu MASTER_ADDR=127.0.0.1 GLOO_SOCKET_IFNAME=lo "
                       "TORCH_EXTENSIONS_DIR=.torch_extensions deepspeed --num_gpus 2 --master_addr 127.0.0.1 "
                       "--master_port 29731 bench/feature_throughput.py " + " ".join(sys.argv[1:]).replace(
                           f"--local_rank={args.local_rank}", "").strip(),
            "machine": {"cpu_cores": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                        "accelerator": "none (CPU, gloo)", "torch_threads_per_rank": torch.get_num_threads(),
                        "python": platform.python_version(), "torch": torch.__version__,
                        "deepspeed": deepspeed.__version__},
            "setup": {"model": args.model, "parameters": num_params, "samples": len(dataset),
                      "max_length": args.max_length, "micro_batch_per_rank": args.batch_size, "ranks": world_size,
                      "zero_stage": args.zero, "feature_store": True},
            "training": {"timed_samples": train_samples, "seconds": round(train_seconds, 3),
                         "samples_per_s": round(train_rate, 1), "epoch_seconds": round(epoch_seconds, 3)},
            "extraction": results,
            "goal": f"extraction pass <= {GOAL_RATIO} x training epoch",
        }
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
        out.with_suffix(".md").write_text(_markdown(report))
    del engine
    shutdown()


def _markdown(report: dict) -> str:
    setup, training = report["setup"], report["training"]
    lines = [
        "# Feature extraction vs training throughput",
        "",
        f"Machine: {report['machine']['cpu_cores']} CPU cores, no accelerator; {setup['ranks']} ranks, "
        f"{report['machine']['torch_threads_per_rank']} torch thread(s) per rank; torch {report['machine']['torch']}, "
        f"deepspeed {report['machine']['deepspeed']}.",
        f"Model `{setup['model']}` ({setup['parameters']:,} parameters), {setup['samples']} samples of "
        f"{setup['max_length']} tokens, micro batch {setup['micro_batch_per_rank']} per rank, ZeRO "
        f"{setup['zero_stage']}.",
        "",
        f"Command: `{report['command']}`",
        "",
        "| pass | samples/s | seconds for all samples | ratio to one training epoch | goal <= 0.4 |",
        "|---|---|---|---|---|",
        f"| training (fwd+bwd+step) | {training['samples_per_s']} | {training['epoch_seconds']} | 1.0 | |",
    ]
    for kind, entry in report["extraction"].items():
        lines.append(f"| extraction `{kind}` (d={entry['dim']}) | {entry['samples_per_s']} | {entry['seconds']} | "
                     f"{entry['ratio_to_training_epoch']} | {'yes' if entry['meets_goal'] else 'no'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
