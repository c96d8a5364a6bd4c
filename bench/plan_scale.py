"""Planning on paper at scale: N up to 100 M samples over W up to 4096 ranks, from memory-mapped inputs.

    python bench/plan_scale.py        # writes bench/results/plan_scale.{json,md}

The inputs are what an analysis holds (labels.npy and distances.npy, skewed cluster sizes, K = 64),
written once to runs/plan_scale/ and memory-mapped. Each case runs in a fresh process: build_plan with
peripheral selection and a proportional budget of half the data, then one rank's part of epoch 0 (what
every rank materialises). Reported: seconds of each part and the peak resident memory, against N and W.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
K = 64
SIZES = (10_000_000, 30_000_000, 100_000_000)
WORLDS = (1024, 4096)


def make_inputs(folder: Path, num_samples: int) -> None:
    import numpy as np

    labels_path, distances_path = folder / f"labels_{num_samples}.npy", folder / f"distances_{num_samples}.npy"
    if labels_path.exists() and distances_path.exists():
        return
    rng = np.random.default_rng(0)
    weights = 1.0 / np.arange(1, K + 1)
    labels = np.lib.format.open_memmap(labels_path, mode="w+", dtype=np.int64, shape=(num_samples,))
    distances = np.lib.format.open_memmap(distances_path, mode="w+", dtype=np.float64, shape=(num_samples,))
    cumulative = np.cumsum(weights / weights.sum())
    for start in range(0, num_samples, 10_000_000):
        stop = min(num_samples, start + 10_000_000)
        labels[start:stop] = np.minimum(np.searchsorted(cumulative, rng.random(stop - start)), K - 1)
        distances[start:stop] = rng.gamma(2.0, 0.5, stop - start)
    labels.flush()
    distances.flush()


def one_case(folder: Path, num_samples: int, world: int) -> dict:
    import numpy as np

    from ds_cluster import ClusterSamplingConfig, build_plan

    labels = np.load(folder / f"labels_{num_samples}.npy", mmap_mode="r")
    distances = np.load(folder / f"distances_{num_samples}.npy", mmap_mode="r")
    config = ClusterSamplingConfig(enabled=True, budget_mode="proportional", budget_ratio=0.5, selection="peripheral")
    started = time.perf_counter()
    plan = build_plan(None, config, world_size=world, micro_batch_size=4, gradient_accumulation_steps=2,
                      labels=labels, distances=distances)
    planned = time.perf_counter()
    schedule = plan.rank_layout(0, rank=world // 2)
    done = time.perf_counter()
    return {"num_samples": num_samples, "world_size": world, "plan_s": round(planned - started, 2),
            "rank_schedule_s": round(done - planned, 2), "total_s": round(done - started, 2),
            "rank_schedule_shape": list(schedule.shape), "num_kept": plan.num_kept,
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "load_average": os.getloadavg()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--case", nargs=2, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--work", default=str(REPO / "runs" / "plan_scale"))
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "plan_scale"))
    args = parser.parse_args()
    folder = Path(args.work)
    folder.mkdir(parents=True, exist_ok=True)
    if args.case:
        print(json.dumps(one_case(folder, *args.case)))
        return 0
    rows = []
    for num_samples in SIZES:
        make_inputs(folder, num_samples)
        for world in WORLDS:
            result = subprocess.run([sys.executable, __file__, "--case", str(num_samples), str(world), "--work",
                                     str(folder)], capture_output=True, text=True, check=True, cwd=REPO)
            rows.append(json.loads(result.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({"command": "python bench/plan_scale.py", "cases": rows},
                                                   indent=2) + "\n")
    lines = ["# Planning at scale (memory-mapped labels and distances, K = 64, peripheral, half kept)", "",
             "`python bench/plan_scale.py`; one fresh process per case.", "",
             "| N | W | plan s | one rank's schedule s | total s | peak RSS MB | rank schedule shape | load |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['num_samples']:,} | {r['world_size']} | {r['plan_s']} | {r['rank_schedule_s']} | {r['total_s']} | "
              f"{r['peak_rss_mb']:,} | {tuple(r['rank_schedule_shape'])} | {r['load_average'][0]:.1f} |" for r in rows]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
