"""Sharded clustering: peak memory per rank against N, and what one rank holding all N x d would need.

    deepspeed --num_gpus 2 --master_addr 127.0.0.1 bench/sharded_memory.py     # bench/results/sharded_memory.{json,md}

Every rank makes only its own rows of a seeded Gaussian mixture (d = 128, 64 true centres, global row
i on rank i % W), then `cluster_sharded` runs k-means over the ranks (k-means++ on a sample, Lloyd
steps as all-reduces of the centroid sums and counts) and the capacity cap, K = 64. N grows from
case to case in one process, so each rank's peak resident memory after a case is that case's peak.
The gathered alternative is computed, not run: N x d float32 on one rank.
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

DIM, TRUE_CENTRES, K = 128, 64, 64


def own_rows(num_samples: int, rank: int, world: int) -> tuple[np.ndarray, np.ndarray]:
    """This rank's global row indices and their points (a seeded mixture, the same for any world size)."""
    centres = np.random.default_rng(0).normal(size=(TRUE_CENTRES, DIM)).astype(np.float32)
    rows = np.arange(rank, num_samples, world, dtype=np.int64)
    points = np.empty((rows.size, DIM), dtype=np.float32)
    for start in range(0, rows.size, 200_000):  # chunks keep the generator's temporaries small
        part = rows[start:start + 200_000]
        rng = np.random.default_rng([num_samples, int(part[0])])
        points[start:start + part.size] = centres[part % TRUE_CENTRES] + 0.5 * rng.normal(size=(part.size, DIM))
    return rows, points


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 200_000, 400_000, 800_000])
    parser.add_argument("--max-iter", type=int, default=20)
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()

    from ds_cluster import distributed
    from ds_cluster.clustering.sharded import cluster_sharded
    from ds_cluster.settings import ClusteringSettings

    distributed.init_distributed()
    rank, world = distributed.get_rank(), distributed.get_world_size()
    collectives = distributed.collectives()
    rows_out = []
    for num_samples in sorted(args.sizes):
        rows, points = own_rows(num_samples, rank, world)
        started = time.perf_counter()
        settings = ClusteringSettings(num_clusters=K, seed=0, n_init=3, max_iter=args.max_iter, capacity_factor=1.5)
        result = cluster_sharded(rows, points, num_samples, settings, collectives)
        seconds = time.perf_counter() - started
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        peaks = distributed.all_gather_object(peak_mb)
        rows_out.append({"num_samples": num_samples, "world_size": world, "seconds": seconds,
                         "peak_rss_mb_per_rank": peaks, "own_features_mb": points.nbytes / 2 ** 20,
                         "all_features_mb": num_samples * DIM * 4 / 2 ** 20, "iterations": result.iterations,
                         "cluster_sizes_max": int(np.bincount(result.all_labels, minlength=K).max())})
        del rows, points, result
    if rank == 0:
        lines = ["# Sharded clustering: peak memory per rank against N", "",
                 f"`deepspeed --num_gpus {world} bench/sharded_memory.py`: d = {DIM}, K = {K}, k-means++ on a sample "
                 f"(3 restarts), at most {args.max_iter} Lloyd steps, capacity cap 1.5; {world} ranks on this machine.",
                 "", "| N | this rank's features MB | all N x d MB (one rank, gathered) | peak RSS per rank MB | "
                 "seconds | Lloyd steps |", "|---|---|---|---|---|---|"]
        for row in rows_out:
            lines.append(f"| {row['num_samples']:,} | {row['own_features_mb']:.0f} | {row['all_features_mb']:.0f} | "
                         + " / ".join(f"{p:.0f}" for p in row["peak_rss_mb_per_rank"])
                         + f" | {row['seconds']:.1f} | {row['iterations']} |")
        text = "\n".join(lines) + "\n"
        (REPO / "bench" / "results" / "sharded_memory.md").write_text(text)
        (REPO / "bench" / "results" / "sharded_memory.json").write_text(json.dumps(rows_out, indent=1))
        print(text, flush=True)
    distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
