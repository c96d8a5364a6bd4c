"""Planner speed: a rank's schedule from given labels at N = 10M, and a full plan with k-means at N = 1M.

Run: .venv/bin/python bench/plan_speed.py [--out bench/results/plan_speed.json]
Each case runs in a fresh subprocess so its peak memory (ru_maxrss) is its own; the memory reported is
the peak above what the process held once its input existed. The schedule case builds the plan and
then one rank's part of epoch 0 (what every rank materialises), as the loader does.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

CASES = {
    "schedule_from_labels_10M": dict(n=10_000_000, k=64, world=1024, micro=4, gas=2, features=False),
    "full_plan_kmeans_1M_d256_faiss": dict(n=1_000_000, k=64, world=64, micro=4, gas=1, features=True, dim=256,
                                           backend="faiss"),
}


def run_case(name: str) -> dict:
    import numpy as np

    from ds_cluster import ClusterSamplingConfig, build_plan

    case = CASES[name]
    rng = np.random.default_rng(0)
    # Skewed cluster sizes (Zipf-like), as in real instruction mixtures.
    weights = 1.0 / np.arange(1, case["k"] + 1)
    if case["features"]:
        centres = rng.normal(0, 1, (case["k"], case["dim"])).astype(np.float32)
        assignment = rng.choice(case["k"], size=case["n"], p=weights / weights.sum())
        features = centres[assignment] + 0.5 * rng.standard_normal((case["n"], case["dim"]), dtype=np.float32)
        labels = None
        cfg = ClusterSamplingConfig(enabled=True, num_clusters=case["k"], backend=case["backend"],
                                    budget_mode="proportional", budget_ratio=0.5, kmeans_n_init=10)
    else:
        features = None
        labels = rng.choice(case["k"], size=case["n"], p=weights / weights.sum()).astype(np.int64)
        cfg = ClusterSamplingConfig(enabled=True, budget_mode="proportional", budget_ratio=1.0, selection="random")
    input_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    plan = build_plan(features, cfg, world_size=case["world"], micro_batch_size=case["micro"],
                      gradient_accumulation_steps=case["gas"], labels=labels)
    planned = time.perf_counter()
    schedule = plan.rank_schedule(0, rank=case["world"] // 2)
    done = time.perf_counter()
    return {
        "case": name, **{k: v for k, v in case.items()},
        "plan_s": round(planned - start, 3),
        "first_schedule_s": round(done - planned, 3),
        "total_s": round(done - start, 3),
        "schedule_shape": list(schedule.shape),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "peak_above_input_mb": round((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - input_rss) / 1024, 1),
        "load_average": os.getloadavg(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="bench/results/plan_speed.json")
    parser.add_argument("--case", help="internal: run one case in this process")
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case)))
        return
    results = []
    for name in CASES:
        out = subprocess.run([sys.executable, __file__, "--case", name], capture_output=True, text=True, check=True)
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(results[-1]))
    report = {
        "command": "python bench/plan_speed.py",
        "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}, Python {platform.python_version()}",
        "note": "peak_rss_mb includes generating the synthetic input; peak_above_input_mb does not. "
                "first_schedule_s is one rank's part of epoch 0 (shape: steps, accumulation, micro)",
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
