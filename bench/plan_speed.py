"""Planner speed: a rank's schedule from given labels at N = 10M (everything kept, and half kept), and a full
plan with k-means at N = 1M.

Run: .venv/bin/python bench/plan_speed.py [--out bench/results/plan_speed.json] [--cases NAME ...] [--repeats 3]
Each run of a case is a fresh subprocess, so its memory is its own. Memory is the peak resident set above
what the process held once its input existed: the kernel's high-water mark (VmHWM) is reset after the input
is built (/proc/self/clear_refs), so the input's own temporaries do not hide the planner's peak. The
schedule cases build the plan and then one rank's part of epoch 0 (what every rank materialises), as the
loader does. Goals (docs/planner.md, issue 22): the 10M cases under 1.5 s and 512 MB above the input, the
k-means case under 15 s.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SCHEDULE_GOAL_S, SCHEDULE_GOAL_MB, KMEANS_GOAL_S = 1.5, 512, 15.0
_LABELS_10M = dict(n=10_000_000, k=64, world=1024, micro=4, gas=2, features=False, budget_mode="proportional")
CASES: dict[str, dict[str, Any]] = {
    # Nothing to choose: every sample is kept (the figure docs/planner.md quoted before issue 22).
    "labels_10M_keep_all_random": dict(_LABELS_10M, budget_ratio=1.0, selection="random", distances=False),
    # A real budget: half of every cluster chosen. Random needs only labels; spread needs distances
    # (an analysis without features.npy), not the features.
    "labels_10M_keep_half_random": dict(_LABELS_10M, budget_ratio=0.5, selection="random", distances=False),
    "labels_distances_10M_keep_half_spread": dict(_LABELS_10M, budget_ratio=0.5, selection="spread", distances=True),
    "full_plan_kmeans_1M_d256_faiss": dict(n=1_000_000, k=64, world=64, micro=4, gas=1, features=True, dim=256,
                                           backend="faiss", budget_mode="proportional", budget_ratio=0.5,
                                           selection="random"),
}


def _status_mb(key: str) -> float:
    """A field of /proc/self/status (VmRSS, VmHWM) in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


def _reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark to the current RSS (Linux >= 4.0); False where that is not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def make_input(case: dict[str, Any]) -> dict[str, Any]:
    """Features (or labels, and distances when the case wants them) with skewed (Zipf-like) cluster sizes."""
    import numpy as np

    rng = np.random.default_rng(0)
    weights = 1.0 / np.arange(1, case["k"] + 1)
    if case["features"]:
        centres = rng.normal(0, 1, (case["k"], case["dim"])).astype(np.float32)
        assignment = rng.choice(case["k"], size=case["n"], p=weights / weights.sum())
        features = centres[assignment] + 0.5 * rng.standard_normal((case["n"], case["dim"]), dtype=np.float32)
        return {"features": features}
    labels = rng.choice(case["k"], size=case["n"], p=weights / weights.sum()).astype(np.int64)
    distances = rng.gamma(2.0, 0.5, case["n"]) if case["distances"] else None
    return {"features": None, "labels": labels, "distances": distances}


def run_case(name: str) -> dict[str, Any]:
    from ds_cluster import ClusterSamplingConfig, build_plan

    case = CASES[name]
    inputs = make_input(case)
    extra = {"backend": case["backend"], "num_clusters": case["k"], "kmeans_n_init": 10} if case["features"] else {}
    cfg = ClusterSamplingConfig(enabled=True, budget_mode=case["budget_mode"], budget_ratio=case["budget_ratio"],
                                selection=case["selection"], **extra)
    input_rss_mb = _status_mb("VmRSS")
    peak_reset = _reset_peak()
    input_maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    load_before = os.getloadavg()
    start, start_cpu = time.perf_counter(), time.process_time()
    plan = build_plan(inputs["features"], cfg, world_size=case["world"], micro_batch_size=case["micro"],
                      gradient_accumulation_steps=case["gas"], labels=inputs.get("labels"),
                      distances=inputs.get("distances"))
    planned = time.perf_counter()
    schedule = plan.rank_layout(0, rank=case["world"] // 2)
    done, done_cpu = time.perf_counter(), time.process_time()
    # Without the reset, the high-water mark may still be the input's, and the figure is a lower bound.
    peak_mb = _status_mb("VmHWM") if peak_reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "case": name, **case,
        "plan_s": round(planned - start, 3),
        "first_schedule_s": round(done - planned, 3),
        "total_s": round(done - start, 3),
        "cpu_s": round(done_cpu - start_cpu, 3),
        "schedule_shape": list(schedule.shape),
        "num_kept": plan.num_kept,
        "fingerprint": plan.fingerprint(),
        "input_rss_mb": round(input_rss_mb, 1),
        "peak_rss_mb": round(max(peak_mb, input_maxrss), 1),
        "peak_above_input_mb": round(peak_mb - input_rss_mb, 1),
        "peak_measured_by": "VmHWM reset after the input" if peak_reset else "ru_maxrss (lower bound)",
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
    }


def summarize(name: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and best over a case's runs, and whether the median meets the case's goal."""
    total = [run["total_s"] for run in runs]
    memory = [run["peak_above_input_mb"] for run in runs]
    summary: dict[str, Any] = {"case": name, "runs": len(runs), "total_s_median": statistics.median(total),
                               "total_s_best": min(total), "cpu_s_median": statistics.median(r["cpu_s"] for r in runs),
                               "peak_above_input_mb_max": max(memory)}
    if CASES[name]["features"]:
        summary["goal"] = f"< {KMEANS_GOAL_S} s"
        summary["meets_goal"] = summary["total_s_median"] < KMEANS_GOAL_S
    else:
        summary["goal"] = f"< {SCHEDULE_GOAL_S} s and < {SCHEDULE_GOAL_MB} MB above the input"
        summary["meets_goal"] = (summary["total_s_median"] < SCHEDULE_GOAL_S
                                 and summary["peak_above_input_mb_max"] < SCHEDULE_GOAL_MB)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results/plan_speed.json")
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per 10M case (k-means: once)")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case in this process
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case)))
        return
    results, summaries = [], []
    for name in args.cases:
        runs = []
        for _ in range(1 if CASES[name]["features"] else args.repeats):
            out = subprocess.run([sys.executable, __file__, "--case", name], capture_output=True, text=True,
                                 check=True)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps(runs[-1]), flush=True)
        results += runs
        summaries.append(summarize(name, runs))
        print(json.dumps(summaries[-1]), flush=True)
    report = {
        "command": "python " + " ".join([sys.argv[0]] + sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), "
                   f"{platform.system()} {platform.release()}, Python {platform.python_version()}",
        "note": "Each run is a fresh process. peak_above_input_mb: the peak resident set while planning minus the "
                "resident set once the input existed (the peak mark is reset after building the input). "
                "first_schedule_s is one rank's part of epoch 0 (shape: steps, accumulation, micro). cpu_s is the "
                "process's CPU time, less sensitive than wall time to other jobs on a shared machine; the load "
                "averages say how shared it was.",
        "summary": summaries,
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
