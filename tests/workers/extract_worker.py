"""Extract features from a tiny Llama through a real DeepSpeed engine; started by tests/test_features_distributed.py.

Writes OUT/<kind>.rank<R>.npz (features, empty mask, shards computed/reused, samples each rank computed)
and OUT/fingerprint.rank<R>.txt. With --kill-after K, rank 1 SIGKILLs itself
after finishing K shards (a deterministic crash halfway through).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--zero", type=int, default=0)
    parser.add_argument("--kinds", default="proxy,lm_head")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--num-samples", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--shard-size", type=int, default=8)
    parser.add_argument("--store", default=None, help="store root; one sub-folder per kind")
    parser.add_argument("--kill-after", type=int, default=None)
    parser.add_argument("--lora", type=int, default=0, help="LoRA adapters of this rank on the tiny Llama (peft)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import deepspeed

    from ds_cluster.distributed import collectives, get_rank, init_distributed, shutdown
    from ds_cluster.features.extract import model_fingerprint, run_extraction
    from ds_cluster.features.kinds import feature_kind
    from tests.workers.feature_fixtures import tiny_llama, tiny_lora_llama, token_dataset

    init_distributed()
    rank = get_rank()
    ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                 "zero_optimization": {"stage": args.zero}, "steps_per_print": 10**9}
    # Built outside zero.Init so every stage starts from the same seeded weights.
    model = tiny_lora_llama(seed=0, rank=args.lora) if args.lora else tiny_llama(seed=0)
    engine, *_ = deepspeed.initialize(model=model, config=ds_config)
    dataset = token_dataset(args.num_samples, seed=4, empty=[5])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"fingerprint.rank{rank}.txt").write_text(model_fingerprint(engine, collectives()))

    finished = []

    def crash_after_k_shards(shard: int) -> None:
        finished.append(shard)
        if rank == 1 and args.kill_after is not None and len(finished) >= args.kill_after:
            os.kill(os.getpid(), signal.SIGKILL)

    for kind in args.kinds.split(","):
        result = run_extraction(engine, dataset, kind=kind, dim=args.dim if feature_kind(kind).projected else None,
                                batch_size=args.batch_size, shard_size=args.shard_size, seed=3,
                                store=Path(args.store) / kind if args.store else None, show_progress=rank == 0,
                                on_shard_done=crash_after_k_shards, collectives=collectives())
        np.savez(out / f"{kind}.rank{rank}.npz", features=result.features, empty_mask=result.empty_mask,
                 computed=np.array(result.computed_shards, dtype=np.int64),
                 reused=np.array(result.reused_shards, dtype=np.int64),
                 samples_per_rank=np.array(result.samples_per_rank, dtype=np.int64))
    del engine
    shutdown()


if __name__ == "__main__":
    main()
