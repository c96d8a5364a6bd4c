"""The finished arms' figures per setting: quality and time over the seeds, time to target, and paired differences
with the settings each is compared with (`Partners`, found from the typed arms); the statistics they are written in.

Reads WORK/base.json, WORK/startup.json, WORK/arms/*.json and WORK/analyses/*/cost.json (bench/quality_job.py).

Time to target, per seed: the target is full data's final macro validation loss plus TARGET_SHARE of
the drop from the base model's to it (within 5% of the base-to-full drop); an arm's time to target is
its start-up + selection (feature extraction and clustering, or the near-duplicate groups) + training
loop time until the first epoch-end validation at or below the target; "not reached" otherwise.
"""
from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from bench.harness.arms import FULL_DATA_METHODS, RECOMMENDED_METHODS, Arm, Method

TARGET_SHARE = 0.05
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
METRICS = ("loss_macro", "loss_worst", "em_macro", "em_worst")
NO_COST = {"wall": 0.0, "cpu": 0.0}


# --------------------------------------------------------------------------- statistics
def mean_ci(values: Sequence[float]) -> dict[str, float]:
    """Mean and the half-width of its 95% confidence interval (Student t over the seeds; nan for one seed)."""
    array = np.asarray(values, dtype=np.float64)
    if array.size < 2:
        return {"mean": float(array.mean()) if array.size else float("nan"), "ci": float("nan"), "n": int(array.size)}
    half = T_975.get(array.size - 1, 1.96) * array.std(ddof=1) / math.sqrt(array.size)
    return {"mean": float(array.mean()), "ci": float(half), "n": int(array.size)}


def quality(result: Mapping[str, Any], split: str) -> dict[str, float]:
    """Macro and worst-family answer loss, and exact match over the label families, of one arm on one split."""
    loss, em = result[split]["loss"], result[split].get("exact_match") or {}
    return {"loss_macro": float(np.mean(list(loss.values()))), "loss_worst": float(max(loss.values())),
            "em_macro": float(np.mean(list(em.values()))) if em else float("nan"),
            "em_worst": float(min(em.values())) if em else float("nan")}


def format_stat(stat: Optional[Mapping[str, float]], digits: int = 3) -> str:
    """'mean ± ci' of a summary statistic, the mean alone with one seed, '—' where nothing was measured."""
    if stat is None or stat["mean"] != stat["mean"]:
        return "—"
    if stat["ci"] != stat["ci"]:  # NaN: one seed, no interval
        return f"{stat['mean']:.{digits}f}"
    return f"{stat['mean']:.{digits}f} ± {stat['ci']:.{digits}f}"


def paired_difference(per_seed: Mapping[int, dict], other: Mapping[int, dict], split: str) -> dict[str, dict]:
    """Mean ± CI over the seeds both have of (this arm's quality minus the other's), per metric."""
    seeds = [s for s in per_seed if s in other]
    return {metric: mean_ci([quality(per_seed[s], split)[metric] - quality(other[s], split)[metric] for s in seeds])
            for metric in METRICS}


def macro(by_family: Mapping[str, float]) -> float:
    return float(np.mean(list(by_family.values())))


# --------------------------------------------------------------------------- one arm
def time_to_target(result: dict, base: dict, full: dict, startup: dict, selection: dict) -> dict[str, Any]:
    """Total time (CPU s over both ranks, and wall s) until the arm's validation loss first reaches the target."""
    base_loss, full_loss = macro(base["validation"]["loss"]), macro(full["validation"]["loss"])
    target = full_loss + TARGET_SHARE * (base_loss - full_loss)
    for point in result.get("validation_curve", []):
        if macro(point["loss"]) <= target:
            return {"target": target, "reached": True, "epoch": point["epoch"], **{
                kind: startup[kind] + selection[kind] + point["loop"][kind] for kind in ("cpu", "wall")}}
    return {"target": target, "reached": False}


def times(result: dict, startup: dict, selection: dict) -> dict[str, float]:
    """Time of one arm, CPU seconds over both ranks (and wall), split into its parts; `selection`: the cost of the
    analysis it reads."""
    parts = {"startup": startup, "selection": selection, "loop": result["time"]["loop"],
             "evaluation": result["time"]["evaluation"]}
    out = {f"{name}_{kind}": float(part[kind]) for name, part in parts.items() for kind in ("cpu", "wall")}
    for kind in ("cpu", "wall"):
        out[f"total_{kind}"] = out[f"startup_{kind}"] + out[f"selection_{kind}"] + out[f"loop_{kind}"]
        out[f"loop_selection_{kind}"] = out[f"selection_{kind}"] + out[f"loop_{kind}"]
    return out


def job_startup(result: dict, fallback: dict) -> dict:
    """The start-up of the job that trained the arm; `fallback` (the work folder's last job) for arms written
    before arms recorded it."""
    return result.get("startup", fallback)


# --------------------------------------------------------------------------- a work folder
def load_results(work: Path, arms: Sequence[Arm], exact_match_families: Optional[Sequence[str]] = None
                 ) -> dict[str, dict]:
    """The finished arms' results; with `exact_match_families`, exact match kept on those families only (an arm
    resumed from a run that scored more of them is then compared on the same ones)."""
    results = {}
    for arm in arms:
        path = work / "arms" / f"{arm.name}.json"
        if path.exists():
            result = json.loads(path.read_text())
            if exact_match_families is not None:
                for split in ("validation", "heldout"):
                    if result.get(split, {}).get("exact_match"):
                        result[split]["exact_match"] = {family: value for family, value in
                                                        result[split]["exact_match"].items()
                                                        if family in exact_match_families}
            results[arm.name] = result
    return results


def analysis_costs(work: Path, arms: Sequence[Arm]) -> dict[str, dict]:
    """The recorded cost (cost.json) of every analysis the arms read that has one."""
    costs = {}
    for arm in arms:
        path = work / "analyses" / arm.analysis / "cost.json"
        if path.exists():
            costs[arm.analysis] = json.loads(path.read_text())
    return costs


def first_arms(arms: Sequence[Arm]) -> dict[str, Arm]:
    """Each setting's first arm (every seed's arm has the same method, fraction and flags)."""
    first: dict[str, Arm] = {}
    for arm in arms:
        first.setdefault(arm.setting, arm)
    return first


def finished_by_setting(arms: Sequence[Arm], results: Mapping[str, dict]) -> dict[str, dict[int, Arm]]:
    """Setting -> seed -> arm, of the arms with a result (in the arms' order)."""
    runs: dict[str, dict[int, Arm]] = defaultdict(dict)
    for arm in arms:
        if arm.name in results:
            runs[arm.setting][arm.seed] = arm
    return dict(runs)


@dataclass(frozen=True)
class Partners:
    """The settings one setting is compared with, paired over seeds (None: it has none)."""

    random: Optional[str]  # the random subset of its kept count (for equal steps: trained to the same steps)
    neardup: Optional[str]  # near-duplicate removal of the same kept count (the recommended preset's)
    full_cut: Optional[str]  # full data stopped at the same step count (the subsets at equal epochs)
    recommended: Optional[str]  # the static recommended preset (the adaptive schedule's)


def partners(arms: Sequence[Arm]) -> dict[str, Partners]:
    """Every setting's partners: each the unchanged setting of that method at its kept fraction."""
    first = first_arms(arms)

    def plain(method: str, fraction: float, stretch: bool = False) -> Optional[str]:
        return next((setting for setting, arm in first.items() if arm.method == method and arm.fraction == fraction
                     and arm.stretch == stretch and arm.plain), None)

    found = {}
    for setting, arm in first.items():
        fraction = arm.fraction
        if fraction is None:
            found[setting] = Partners(arm.baseline, None, None, None)
            continue
        # An arm that keeps another count than its fraction's paper arm (an ablation) names its own random subset.
        found[setting] = Partners(
            random=arm.baseline or plain(Method.RANDOM, fraction, arm.stretch),
            neardup=plain(Method.NEARDUP, fraction) if arm.method in RECOMMENDED_METHODS and not arm.stretch else None,
            full_cut=(plain(Method.FULL_CUT, fraction) if arm.method not in FULL_DATA_METHODS and not arm.stretch
                      else None),
            recommended=plain(Method.RECOMMENDED, fraction) if arm.method == Method.ADAPTIVE else None)
    return found


def full_setting(arms: Sequence[Arm]) -> Optional[str]:
    """The full-data setting (the time and quality reference)."""
    return next((arm.setting for arm in arms if arm.method == Method.FULL), None)


# --------------------------------------------------------------------------- per setting
@dataclass(frozen=True)
class _Folder:
    """What a summary reads besides the arms: the split, the folder's last start-up, the analyses' costs, the base
    model's evaluation, the finished arms' results."""

    split: str
    startup: dict
    costs: dict[str, dict]
    base: Optional[dict]
    results: Mapping[str, dict]

    def times(self, arm: Arm) -> dict[str, float]:
        result = self.results[arm.name]
        return times(result, job_startup(result, self.startup), self.costs.get(arm.analysis, NO_COST))

    def per_seed(self, runs: Mapping[int, Arm]) -> dict[int, dict]:
        return {seed: self.results[arm.name] for seed, arm in runs.items()}


def _read(path: Path, default: Any) -> Any:
    return json.loads(path.read_text()) if path.exists() else default


def summarize(arms: Sequence[Arm], results: Mapping[str, dict], work: Path, split: str) -> dict[str, Any]:
    """Per setting: quality and time over the seeds, time to target, and paired differences against full data
    and against its partners (same seed)."""
    folder = _Folder(split, _read(work / "startup.json", {"wall": 0.0, "cpu": 0.0}), analysis_costs(work, arms),
                     _read(work / "base.json", None), results)
    runs = finished_by_setting(arms, results)
    full = full_setting(arms)
    full_runs = runs.get(full, {}) if full is not None else {}
    full_time = {seed: folder.times(arm) for seed, arm in full_runs.items()}
    links = partners(arms)
    settings = {setting: _setting_entry(folder, setting, per_seed, runs, full, full_time, links[setting])
                for setting, per_seed in runs.items()}
    full_epoch = None
    if full_time:
        full_arm = next(iter(full_runs.values()))
        full_epoch = results[full_arm.name]["time"]["loop"]["wall"] / full_arm.epochs
    extraction = {name: {"extract_wall": cost.get("extract_wall"), "cluster_wall": cost.get("cluster_wall"),
                         "job_cpu": cost["cpu"], "job_wall": cost["wall"],
                         "extract_over_full_epoch": (cost.get("extract_wall", 0.0) / full_epoch)
                         if full_epoch else None}
                  for name, cost in folder.costs.items()}
    base_row = quality(folder.base, split) if folder.base is not None and split in folder.base else None
    # One start-up per job; a run resumed by later jobs holds arms of each.
    job_startups = sorted({(job["cpu"], job["wall"]) for job in (job_startup(r, folder.startup)
                                                                 for r in results.values())})
    return {"split": split, "settings": settings, "startup": folder.startup, "job_startups": job_startups,
            "selection": extraction, "base": base_row,
            "full_total_cpu": {seed: t["total_cpu"] for seed, t in full_time.items()}}


def _setting_entry(folder: _Folder, setting: str, runs: dict[int, Arm], every: Mapping[str, dict[int, Arm]],
                   full: Optional[str], full_time: Mapping[int, dict], links: Partners) -> dict[str, Any]:
    """One setting's row: quality and time over its seeds, as a share of full data's, and its paired differences."""
    per_seed = folder.per_seed(runs)
    some = next(iter(runs.values()))
    entry: dict[str, Any] = {"method": some.method, "fraction": some.fraction, "seeds": sorted(per_seed),
                             "kept_fraction": mean_ci([r["kept_fraction"] for r in per_seed.values()]),
                             "steps": mean_ci([r["steps"] for r in per_seed.values()])}
    for metric in METRICS:
        entry[metric] = mean_ci([quality(r, folder.split)[metric] for r in per_seed.values()])
    seed_times = {seed: folder.times(arm) for seed, arm in runs.items()}
    for key in ("total_cpu", "loop_selection_cpu", "total_wall", "loop_selection_wall"):
        entry[f"ratio_{key}"] = mean_ci([seed_times[s][key] / full_time[s][key] for s in per_seed if s in full_time])
    entry["time"] = {key: mean_ci([t[key] for t in seed_times.values()]) for key in next(iter(seed_times.values()))}
    some_result = per_seed[some.seed]
    entry["per_family"] = {metric: {family: mean_ci([r[folder.split][metric][family] for r in per_seed.values()])
                                    for family in some_result[folder.split].get(metric) or {}}
                           for metric in ("loss", "exact_match")}
    full_runs = every.get(full, {}) if full is not None else {}
    if folder.base is not None and full_runs:
        entry["time_to_target"] = _time_to_target(folder, runs, full_runs)
    if setting != full and full_runs:
        entry["vs_full"] = paired_difference(per_seed, folder.per_seed(full_runs), folder.split)
    for key, partner in (("vs_random", links.random), ("vs_neardup", links.neardup),
                         ("vs_full_cut", links.full_cut), ("vs_recommended", links.recommended)):
        if partner is not None and partner != setting and every.get(partner):
            entry[key] = paired_difference(per_seed, folder.per_seed(every[partner]), folder.split)
    return entry


def _time_to_target(folder: _Folder, runs: Mapping[int, Arm], full_runs: Mapping[int, Arm]) -> dict[str, Any]:
    """How many seeds reached full data's target, in what time (and as a share of full data's own), at what epoch."""
    assert folder.base is not None
    full = folder.per_seed(full_runs)
    reached = {seed: time_to_target(folder.results[arm.name], folder.base, full[seed],
                                    job_startup(folder.results[arm.name], folder.startup),
                                    folder.costs.get(arm.analysis, NO_COST))
               for seed, arm in runs.items() if seed in full}
    full_reached = {seed: time_to_target(full[seed], folder.base, full[seed], job_startup(full[seed], folder.startup),
                                         NO_COST) for seed in reached}
    hits = [seed for seed, t in reached.items() if t["reached"]]
    return {"reached": len(hits), "of": len(reached),
            "cpu": mean_ci([reached[s]["cpu"] for s in hits]), "wall": mean_ci([reached[s]["wall"] for s in hits]),
            "ratio_cpu": mean_ci([reached[s]["cpu"] / full_reached[s]["cpu"] for s in hits
                                  if full_reached[s]["reached"]]),
            "epoch": mean_ci([reached[s]["epoch"] for s in hits])}


# --------------------------------------------------------------------------- what else the report shows
def loader_overhead(arms: Sequence[Arm], results: Mapping[str, dict]) -> dict[str, list[float]]:
    """Per setting, each seed's loader wall time over its training loop's wall time."""
    shares: dict[str, list[float]] = defaultdict(list)
    for arm in arms:
        result = results.get(arm.name)
        if result is not None and "loader_wall" in result["time"]:
            shares[arm.setting].append(result["time"]["loader_wall"] / max(result["time"]["loop"]["wall"], 1e-9))
    return dict(shares)


def feature_sources(work: Path, arms: Sequence[Arm], summary: Mapping[str, Any], costs: Mapping[str, dict],
                    models: Mapping[str, str]) -> list[dict]:
    """Per feature source (the trained model's own, a feature model): what its selection cost, as a share of full
    data's whole run (start-up, loop) on the same seed, and how well its k-means clusters match the task groups
    (purity: the share of records in their cluster's largest group), mean over the analyses that read it."""
    full_cpu = {int(seed): value for seed, value in summary.get("full_total_cpu", {}).items()}
    rows: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    seen = set()
    for arm in arms:
        folder = work / "analyses" / arm.analysis
        if arm.analysis in seen or arm.analysis not in costs or not (folder / "summary.json").exists():
            continue
        seen.add(arm.analysis)
        cost, clusters = costs[arm.analysis], json.loads((folder / "summary.json").read_text())
        if "purity" not in clusters or "source" not in cost:
            continue
        row = rows[cost["source"]]
        row["extract_cpu"].append(cost.get("extract_cpu", 0.0))
        row["cluster_cpu"].append(cost.get("cluster_cpu", 0.0))
        row["purity"].append(clusters["purity"])
        row["clusters"].append(clusters["num_clusters"])
        if arm.seed in full_cpu:
            row["share_of_full"].append(cost["cpu"] / full_cpu[arm.seed])
    return [{"source": source, "model": models.get(source, source), "analyses": len(row["purity"]),
             **{key: float(np.mean(values)) if values else None for key, values in row.items()}}
            for source, row in sorted(rows.items())]


def against_first_candidate(arms: Sequence[Arm], results: Mapping[str, dict], candidates: Mapping[str, dict],
                            fraction: float, split: str) -> Optional[dict[str, Any]]:
    """Each fixed-budget candidate minus the first one declared (the base the others change one thing of), paired
    over seeds: what a cheaper setting costs in quality. None with fewer than two candidates finished."""
    runs = finished_by_setting(arms, results)
    first = first_arms(arms)
    fixed = [next((s for s, arm in first.items() if arm.candidate == name and arm.fraction == fraction), None)
             for name, block in candidates.items() if block.get("budget_ratio") != "auto"]
    fixed = [setting for setting in fixed if setting is not None and runs.get(setting)]
    if len(fixed) < 2:
        return None
    per_seed = {setting: {seed: results[arm.name] for seed, arm in runs[setting].items()} for setting in fixed}
    return {"base": fixed[0], "settings": {setting: {"vs_first": paired_difference(per_seed[setting],
                                                                                   per_seed[fixed[0]], split)}
                                          for setting in fixed[1:]}}
