"""bf16 against fp32: do features from a bf16 engine give the same clusters on the shipped mixture?

    deepspeed --num_gpus 2 --master_addr 127.0.0.1 bench/bf16_purity.py [--clusters 8] [--seeds 0 1 2]

In one 2-rank job, ZeRO-2's forward-only engine computes the proxy features of the shipped training
mixture with the shipped base model twice, once in fp32 and once with bf16 enabled (weights and
activations in bf16); each is clustered with the same K and seed. Reported per seed: the clusters'
purity against the task families for both, their difference (the documented tolerance is 0.02), and
the adjusted Rand index between the two labelings. Results: bench/results/bf16_purity.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

TOLERANCE = 0.02


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clusters", type=int, default=8)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--work-dir", type=Path, default=REPO / "runs" / "bench_bf16")
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()

    from sklearn.metrics import adjusted_rand_score

    from ds_cluster import distributed
    from ds_cluster.analysis.compute import AnalysisOptions, analyze
    from ds_cluster.ds_config import forward_only_config
    from ds_cluster.features.source import forward_only_engine
    from ds_cluster.config import ClusterSamplingConfig
    from ds_cluster.data.dataset import load_instruction_dataset
    from ds_cluster.data.models import load_model_and_tokenizer
    from bench.toy.models import base_model_path
    from bench.toy.tasks import DEFAULT_DATA

    distributed.init_distributed()
    base = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    rows = []
    for precision in ("fp32", "bf16"):
        config = forward_only_config(dict(base, bf16={"enabled": precision == "bf16"}))
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        model, tokenizer = load_model_and_tokenizer(base_model_path(), ds_config=config, dtype=dtype)
        dataset = load_instruction_dataset(DEFAULT_DATA / "train.jsonl", tokenizer, max_length=96)
        engine = forward_only_engine(model, config)
        for seed in args.seeds:
            settings = ClusterSamplingConfig.from_dict({"enabled": True, "num_clusters": args.clusters,
                                                        "capacity_factor": None, "seed": seed})
            started = time.perf_counter()
            out = args.work_dir / f"{precision}_s{seed}"
            summary = analyze(engine, dataset, out, settings, AnalysisOptions(batch_size=16, show_progress=False),
                              distributed.collectives()).summary
            rows.append({"precision": precision, "seed": seed, "purity": summary["purity"], "path": str(out),
                         "seconds": time.perf_counter() - started})
        del engine, model
    if distributed.get_rank() == 0:
        table = ["| seed | purity fp32 | purity bf16 | difference | within 0.02 | adjusted Rand index (bf16 vs fp32) |",
                 "|---|---|---|---|---|---|"]
        results = []
        for seed in args.seeds:
            fp32, bf16 = (next(r for r in rows if r["precision"] == p and r["seed"] == seed) for p in ("fp32", "bf16"))
            labels = [np.load(Path(r["path"]) / "labels.npy") for r in (fp32, bf16)]
            agreement = adjusted_rand_score(labels[0], labels[1])
            difference = bf16["purity"] - fp32["purity"]
            results.append({"seed": seed, "purity_fp32": fp32["purity"], "purity_bf16": bf16["purity"],
                            "difference": difference, "within_tolerance": abs(difference) <= TOLERANCE,
                            "adjusted_rand_index": agreement})
            table.append(f"| {seed} | {fp32['purity']:.4f} | {bf16['purity']:.4f} | {difference:+.4f} | "
                         f"{'yes' if abs(difference) <= TOLERANCE else 'NO'} | {agreement:.4f} |")
        text = "\n".join([
            "# bf16 against fp32 features: cluster purity on the shipped mixture", "",
            f"`deepspeed --num_gpus 2 bench/bf16_purity.py --clusters {args.clusters}`: proxy features of the "
            f"{len(dataset)} training records by the shipped base model, ZeRO-2 forward-only engine on 2 CPU ranks, "
            f"K = {args.clusters}, no capacity cap, k-means seeds {args.seeds}. Tolerance: |purity difference| <= "
            f"{TOLERANCE}.", ""] + table) + "\n"
        results_dir = REPO / "bench" / "results"
        (results_dir / "bf16_purity.md").write_text(text)
        (results_dir / "bf16_purity.json").write_text(json.dumps({"rows": results, "runs": rows}, indent=1))
        print(text, flush=True)
    distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
