"""The quality benchmark job's `lora` feature analysis on 2 ranks (started by tests/test_bench_lora.py): rank 0
writes the seeded adapter folder over stories260K, both ranks extract the adapters' projected per-sample gradients
under the instrument's DeepSpeed config, and rank 0 records what it saw in OUT/result.json."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--records", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import numpy as np

    from bench.harness.arms import Analysis
    from bench.harness.instrument import Settings
    from bench.harness.job import ensure_features
    from bench.harness.launch import ds_config
    from bench.real import STORIES260K_DIR
    from ds_cluster import distributed
    from ds_cluster.data.dataset import InstructionDataset, read_jsonl
    from ds_cluster.data.models import load_tokenizer

    distributed.init_distributed()
    rank = distributed.get_rank()
    out = Path(args.out)
    tokenizer = load_tokenizer(STORIES260K_DIR)
    train = InstructionDataset(read_jsonl(args.records), tokenizer, max_length=96, rank=rank)
    spec = {"base_model": str(STORIES260K_DIR), "lora_rank": 4,
            "ds_config": ds_config(Settings(precision="bf16", zero_stage=0, micro_batch_size=4))}
    analysis = Analysis(str(out / "features_lora"), source="lora", model=str(out / "lora_adapters_r4"),
                        cluster_sampling={"feature_kind": "lora", "feature_dim": 64})
    cost = ensure_features(analysis, spec, train)
    if rank == 0:
        features = np.load(out / "features_lora" / "features.npy")
        empty = np.load(out / "features_lora" / "empty_mask.npy")
        (out / "result.json").write_text(json.dumps({
            "cost": cost, "shape": list(features.shape), "finite": bool(np.isfinite(features).all()),
            "zero_rows": int((np.abs(features[~empty]).sum(axis=1) == 0).sum()), "empty": int(empty.sum()),
            "adapter_config": json.loads((out / "lora_adapters_r4" / "adapter_config.json").read_text())}))
    distributed.shutdown()


if __name__ == "__main__":
    main()
