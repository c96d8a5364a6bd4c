"""The quality benchmark's report: paired differences with confidence intervals, time to target, goals.

Reads WORK/base.json and WORK/arms/*.json (bench/quality_job.py) and writes RESULTS/NAME.json (every
arm and every summary), NAME.md (tables) and NAME.png (quality against total time, one point per
setting, and the first seed's validation curves against total time).

Time to target, per seed: the target is full data's final macro validation loss plus TARGET_SHARE of
the drop from the base model's to it (within 5% of the base-to-full drop); an arm's time to target is
its start-up + selection (feature extraction and clustering, or the near-duplicate groups) + training
loop time until the first epoch-end validation at or below the target; "not reached" otherwise.
"""
from __future__ import annotations

import json
import os
import platform
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from bench.instrument import default_base_model
from bench.real import STORIES260K_DIR
from bench.stats import format_stat, mean_ci, quality

TARGET_SHARE = 0.05


def macro(by_family: dict[str, float]) -> float:
    return float(np.mean(list(by_family.values())))


def time_to_target(result: dict, base: dict, full: dict, startup: dict, selection: dict) -> dict[str, Any]:
    """Total time (CPU s over both ranks, and wall s) until the arm's validation loss first reaches the target."""
    base_loss, full_loss = macro(base["validation"]["loss"]), macro(full["validation"]["loss"])
    target = full_loss + TARGET_SHARE * (base_loss - full_loss)
    for point in result.get("validation_curve", []):
        if macro(point["loss"]) <= target:
            return {"target": target, "reached": True, "epoch": point["epoch"], **{
                kind: startup[kind] + selection[kind] + point["loop"][kind] for kind in ("cpu", "wall")}}
    return {"target": target, "reached": False}


def times(result: dict, startup: dict, analyses_cost: dict) -> dict[str, float]:
    """Time of one arm, CPU seconds over both ranks (and wall), split into its parts."""
    selection = analyses_cost.get(result["arm"]["analysis"], {"wall": 0.0, "cpu": 0.0})
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


def load_results(work: Path, arms: list[dict], exact_match_families: Optional[Sequence[str]] = None
                 ) -> dict[str, dict]:
    """The finished arms' results; with `exact_match_families`, exact match kept on those families only (an arm
    resumed from a run that scored more of them is then compared on the same ones)."""
    results = {}
    for arm in arms:
        path = work / "arms" / f"{arm['name']}.json"
        if path.exists():
            result = json.loads(path.read_text())
            if exact_match_families is not None:
                for split in ("validation", "heldout"):
                    if result.get(split, {}).get("exact_match"):
                        result[split]["exact_match"] = {family: value for family, value in
                                                        result[split]["exact_match"].items()
                                                        if family in exact_match_families}
            results[arm["name"]] = result
    return results


def summarize(arms: list[dict], results: dict, work: Path, split: str) -> dict[str, Any]:
    """Per setting: quality and time over the seeds, time to target, and paired differences against the
    random subset of the same size and against full data (same seed)."""
    startup = json.loads((work / "startup.json").read_text()) if (work / "startup.json").exists() else \
        {"wall": 0.0, "cpu": 0.0}
    costs = {}
    for arm in arms:
        cost_path = Path(work / "analyses" / arm["analysis"] / "cost.json")
        if cost_path.exists():
            costs[arm["analysis"]] = json.loads(cost_path.read_text())
    by_setting: dict[str, dict[int, dict]] = defaultdict(dict)
    for arm in arms:
        if arm["name"] in results:
            by_setting[arm["setting"]][arm["seed"]] = results[arm["name"]]
    full_time = {seed: times(r, job_startup(r, startup), costs) for seed, r in by_setting.get("full", {}).items()}
    base = json.loads((work / "base.json").read_text()) if (work / "base.json").exists() else None
    no_cost = {"wall": 0.0, "cpu": 0.0}
    settings: dict[str, Any] = {}
    for setting, per_seed in by_setting.items():
        some = next(iter(per_seed.values()))
        entry: dict[str, Any] = {"method": some["arm"]["method"], "fraction": some["arm"]["fraction"],
                                 "seeds": sorted(per_seed), "kept_fraction": mean_ci([r["kept_fraction"] for r in per_seed.values()]),
                                 "steps": mean_ci([r["steps"] for r in per_seed.values()])}
        for metric in ("loss_macro", "loss_worst", "em_macro", "em_worst"):
            entry[metric] = mean_ci([quality(r, split)[metric] for r in per_seed.values()])
        seed_times = {seed: times(r, job_startup(r, startup), costs) for seed, r in per_seed.items()}
        for key in ("total_cpu", "loop_selection_cpu", "total_wall", "loop_selection_wall"):
            ratios = [seed_times[s][key] / full_time[s][key] for s in per_seed if s in full_time]
            entry[f"ratio_{key}"] = mean_ci(ratios)
        entry["time"] = {key: mean_ci([t[key] for t in seed_times.values()]) for key in next(iter(seed_times.values()))}
        entry["per_family"] = {metric: {family: mean_ci([r[split][metric][family] for r in per_seed.values()])
                                        for family in some[split].get(metric) or {}}
                               for metric in ("loss", "exact_match")}
        if base is not None and by_setting.get("full"):
            reached = {seed: time_to_target(r, base, by_setting["full"][seed], job_startup(r, startup),
                                            costs.get(r["arm"]["analysis"], no_cost))
                       for seed, r in per_seed.items() if seed in by_setting["full"]}
            full_reached = {seed: time_to_target(by_setting["full"][seed], base, by_setting["full"][seed],
                                                 job_startup(by_setting["full"][seed], startup),
                                                 no_cost) for seed in reached}
            hits = [seed for seed, t in reached.items() if t["reached"]]
            entry["time_to_target"] = {
                "reached": len(hits), "of": len(reached),
                "cpu": mean_ci([reached[s]["cpu"] for s in hits]), "wall": mean_ci([reached[s]["wall"] for s in hits]),
                "ratio_cpu": mean_ci([reached[s]["cpu"] / full_reached[s]["cpu"] for s in hits
                                      if full_reached[s]["reached"]]),
                "epoch": mean_ci([reached[s]["epoch"] for s in hits])}
        full_runs = by_setting.get("full", {})
        if setting != "full" and full_runs:
            paired = [s for s in per_seed if s in full_runs]
            entry["vs_full"] = {metric: mean_ci([quality(per_seed[s], split)[metric]
                                                 - quality(full_runs[s], split)[metric] for s in paired])
                                for metric in ("loss_macro", "loss_worst", "em_macro", "em_worst")}
        fraction = some["arm"]["fraction"]
        # Equal-steps subsets are paired with the random subset trained to the same steps; an arm that keeps
        # another count than its fraction's paper arm (an ablation) names its own random subset.
        baseline_name = some["arm"].get("baseline") or (
            f"random{'_steps' if '_steps_' in setting else ''}_f{fraction:g}" if fraction is not None else None)
        baseline = by_setting.get(baseline_name) if baseline_name else None
        if baseline and setting != baseline_name:
            paired = [s for s in per_seed if s in baseline]
            entry["vs_random"] = {metric: mean_ci([quality(per_seed[s], split)[metric]
                                                   - quality(baseline[s], split)[metric] for s in paired])
                                  for metric in ("loss_macro", "loss_worst", "em_macro", "em_worst")}
        # Issue-level goal: the recommended arms against near-duplicate removal of the same kept count, paired.
        neardup = by_setting.get(f"neardup_f{fraction:g}") if fraction is not None else None
        if neardup and some["arm"]["method"].startswith("recommended") and "_steps_" not in setting:
            entry["vs_neardup"] = paired_difference(per_seed, neardup, split)
        # The bar a user gets for free: full data stopped at the same step count (every subset at equal epochs).
        cut = by_setting.get(f"full_cut_f{fraction:g}") if fraction is not None else None
        if cut and not setting.startswith("full") and "_steps_" not in setting:
            entry["vs_full_cut"] = paired_difference(per_seed, cut, split)
        static = by_setting.get(f"recommended_f{fraction:g}") if fraction is not None else None
        if static and some["arm"]["method"] == "adaptive":
            entry["vs_recommended"] = paired_difference(per_seed, static, split)
        settings[setting] = entry
    full_epoch = None
    if full_time:
        full_any = next(iter(by_setting["full"].values()))
        full_epoch = full_any["time"]["loop"]["wall"] / full_any["arm"]["epochs"]
    extraction = {name: {"extract_wall": cost.get("extract_wall"), "cluster_wall": cost.get("cluster_wall"),
                         "job_cpu": cost["cpu"], "job_wall": cost["wall"],
                         "extract_over_full_epoch": (cost.get("extract_wall", 0.0) / full_epoch) if full_epoch else None}
                  for name, cost in costs.items()}
    base_row = quality(base, split) if base is not None and split in base else None
    # One start-up per job; a run resumed by later jobs holds arms of each.
    job_startups = sorted({(job["cpu"], job["wall"]) for job in (job_startup(r, startup) for r in results.values())})
    return {"split": split, "settings": settings, "startup": startup, "job_startups": job_startups,
            "selection": extraction, "base": base_row,
            "full_total_cpu": {seed: t["total_cpu"] for seed, t in full_time.items()}}


def loader_overhead(arms: list[dict], results: dict) -> dict[str, list[float]]:
    """Per setting, each seed's loader wall time over its training loop's wall time."""
    shares: dict[str, list[float]] = defaultdict(list)
    for arm in arms:
        result = results.get(arm["name"])
        if result is not None and "loader_wall" in result["time"]:
            shares[arm["setting"]].append(result["time"]["loader_wall"] / max(result["time"]["loop"]["wall"], 1e-9))
    return dict(shares)


def adaptive_choice_lines(summary: dict, candidates: dict, fraction: float,
                          overhead: Optional[dict[str, list[float]]] = None,
                          overhead_limit: Optional[float] = None) -> list[str]:
    """bench/candidates.json's declared rule applied to the validation summary: among the adaptive candidates
    at the subsets' step count, the lowest mean macro validation loss (with `overhead_limit`: among those whose
    mean loader share of the training loop, from `overhead`, is below it; none if none is); among the auto
    candidates, the lower mean macro loss of those whose mean total time is at most 0.5 of full data's (else the
    faster)."""
    rows = summary["settings"]
    fixed = {name: rows[f"{name}_f{fraction:g}"] for name, block in candidates.items()
             if block.get("budget_ratio") != "auto" and f"{name}_f{fraction:g}" in rows}
    auto = {name: rows[name] for name, block in candidates.items() if block.get("budget_ratio") == "auto"
            and name in rows}
    if not fixed and not auto:
        return []
    lines = ["## Choice (the declared rule, validation only)", ""]
    if fixed and overhead_limit is not None:
        shares = {name: float(np.mean(overhead[f"{name}_f{fraction:g}"])) for name in fixed
                  if (overhead or {}).get(f"{name}_f{fraction:g}")}
        eligible = {name: fixed[name] for name in fixed if name in shares and shares[name] < overhead_limit}
        listing = ", ".join(f"{n} {e['loss_macro']['mean']:.4f} (loader {shares[n]:.2%})" if n in shares else
                            f"{n} {e['loss_macro']['mean']:.4f} (loader share not measured)"
                            for n, e in sorted(fixed.items(), key=lambda item: item[1]["loss_macro"]["mean"]))
        if eligible:
            best = min(eligible, key=lambda name: eligible[name]["loss_macro"]["mean"])
            lines.append(f"- adaptive schedule: **{best}**, the lowest mean macro validation answer loss of those "
                         f"whose loader share is under {overhead_limit:.0%} ({listing})")
        else:
            lines.append(f"- adaptive schedule: **none** has a loader share under {overhead_limit:.0%}: the goal is "
                         f"not met ({listing})")
    elif fixed:
        best = min(fixed, key=lambda name: fixed[name]["loss_macro"]["mean"])
        lines.append(f"- adaptive schedule: **{best}** (mean macro validation answer loss "
                     f"{fixed[best]['loss_macro']['mean']:.4f}; the candidates: "
                     + ", ".join(f"{n} {e['loss_macro']['mean']:.4f}" for n, e in sorted(
                         fixed.items(), key=lambda item: item[1]["loss_macro"]["mean"])) + ")")
    if auto and overhead_limit is not None:
        lines.append(_auto_overhead_choice(auto, overhead or {}, overhead_limit))
    elif auto:
        fast = {n: e for n, e in auto.items() if e["ratio_total_cpu"]["mean"] <= 0.5}
        pool = fast or auto
        key = (lambda n: pool[n]["loss_macro"]["mean"]) if fast else (lambda n: pool[n]["ratio_total_cpu"]["mean"])
        best = min(pool, key=key)
        lines.append(f"- auto budget: **{best}** (" + ", ".join(
            f"{n}: macro {e['loss_macro']['mean']:.4f}, total time / full {e['ratio_total_cpu']['mean']:.3f}, kept "
            f"{e['kept_fraction']['mean']:.3f}" for n, e in sorted(auto.items())) + ("" if fast else
            "; none within 0.5 of full data's time: the faster") + ")")
    return lines + [""]


def _auto_overhead_choice(auto: dict, overhead: dict[str, list[float]], overhead_limit: float) -> str:
    """The "auto_overhead" rule: among the auto candidates whose mean loader share is under the limit and whose
    macro loss is within the noise of full data's or below (the paired 95% CI reaches 0 or lies below), the
    lowest mean total time over full data's."""
    def within_full(entry: dict) -> bool:
        difference = entry.get("vs_full", {}).get("loss_macro")
        return difference is not None and difference["mean"] - difference["ci"] <= 0

    shares = {name: float(np.mean(overhead[name])) for name in auto if overhead.get(name)}
    eligible = [name for name in auto if name in shares and shares[name] < overhead_limit and within_full(auto[name])]
    listing = "; ".join(
        f"{n}: loader {shares[n]:.2%}, macro minus full {e['vs_full']['loss_macro']['mean']:+.4f} ± "
        f"{e['vs_full']['loss_macro']['ci']:.4f}, total time / full {e['ratio_total_cpu']['mean']:.3f}, kept "
        f"{e['kept_fraction']['mean']:.3f}" if n in shares and "vs_full" in e else f"{n}: not measured"
        for n, e in sorted(auto.items()))
    if not eligible:
        return (f"- auto budget: **none** is under {overhead_limit:.0%} of the loop and within the noise of full "
                f"data's loss: it keeps its settings and the goal is not met ({listing})")
    best = min(eligible, key=lambda name: auto[name]["ratio_total_cpu"]["mean"])
    return (f"- auto budget: **{best}**, the fastest of those under {overhead_limit:.0%} of the loop and within "
            f"the noise of full data's loss ({listing})")


def paired_difference(per_seed: dict, other: dict, split: str) -> dict[str, dict]:
    """Mean ± CI over the seeds both have of (this arm's quality minus the other's), per metric."""
    seeds = [s for s in per_seed if s in other]
    return {metric: mean_ci([quality(per_seed[s], split)[metric] - quality(other[s], split)[metric] for s in seeds])
            for metric in ("loss_macro", "loss_worst", "em_macro", "em_worst")}


def against_first_candidate(arms: list[dict], results: dict, candidates: dict, fraction: float,
                            split: str) -> list[str]:
    """Each fixed-budget candidate minus the first one declared (the base the others change one thing of),
    paired over seeds: what a cheaper setting costs in quality."""
    per_setting: dict[str, dict[int, dict]] = defaultdict(dict)
    for arm in arms:
        if arm["name"] in results:
            per_setting[arm["setting"]][arm["seed"]] = results[arm["name"]]
    fixed = [f"{name}_f{fraction:g}" for name, block in candidates.items() if block.get("budget_ratio") != "auto"]
    fixed = [setting for setting in fixed if per_setting.get(setting)]
    if len(fixed) < 2:
        return []
    base = fixed[0]
    differences = {"settings": {setting: {"vs_first": paired_difference(per_setting[setting], per_setting[base], split)}
                                for setting in fixed[1:]}}
    return [f"## {split}: each candidate minus the first declared ({base}), paired over seeds", "",
            _difference_table(differences, fixed[1:], "vs_first", "candidate minus the first declared (same seed)"),
            ""]


def _order(name: str) -> tuple:
    method_rank = {"full": 0, "full_cut": 1, "random": 2, "neardup": 3, "oracle": 4, "paper": 5, "recommended": 6,
                   "recommended_small": 7, "recommended_smollm2": 8, "adaptive": 9, "auto": 10, "random_steps": 11,
                   "recommended_steps": 12}
    method = name.split("_f")[0]
    return (method_rank.get(method, 20), name)


def table(summary: dict, names: list[str]) -> str:
    header = ("| setting | seeds | kept | steps | total / full (CPU) | loop+selection / full (CPU) | answer loss macro "
              "| answer loss worst | exact match macro | exact match worst |")
    lines = [header, "|" + "---|" * 10]
    if summary.get("base"):
        b = summary["base"]
        em = "—" if b["em_macro"] != b["em_macro"] else f"{b['em_macro']:.3f} | {b['em_worst']:.3f}"
        lines.append(f"| base model | — | — | 0 | — | — | {b['loss_macro']:.3f} | {b['loss_worst']:.3f} | "
                     + (em if em != "—" else "— | —") + " |")
    for name in names:
        e = summary["settings"][name]
        lines.append(f"| {name} | {len(e['seeds'])} | {format_stat(e['kept_fraction'])} | {e['steps']['mean']:.0f} | "
                     f"{format_stat(e['ratio_total_cpu'])} | {format_stat(e['ratio_loop_selection_cpu'])} | {format_stat(e['loss_macro'])} | "
                     f"{format_stat(e['loss_worst'])} | {format_stat(e['em_macro'])} | {format_stat(e['em_worst'])} |")
    return "\n".join(lines)


def _difference_table(summary: dict, names: list[str], key: str, title: str) -> str:
    lines = [f"| {title} | seeds | answer loss macro | answer loss worst | exact match macro | exact match worst |",
             "|---|---|---|---|---|---|"]
    for name in names:
        v = summary["settings"][name].get(key)
        if v:
            lines.append(f"| {name} | {v['loss_macro']['n']} | {format_stat(v['loss_macro'])} | "
                         f"{format_stat(v['loss_worst'])} | {format_stat(v['em_macro'])} | {format_stat(v['em_worst'])} |")
    return "\n".join(lines)


def paired_table(summary: dict, names: list[str]) -> str:
    return _difference_table(summary, names, "vs_random", "setting minus random (same size, same seed)")


def full_paired_table(summary: dict, names: list[str]) -> str:
    return _difference_table(summary, names, "vs_full", "setting minus full data (same seed)")


def full_cut_paired_table(summary: dict, names: list[str]) -> str:
    return _difference_table(summary, names, "vs_full_cut",
                             "setting minus full data stopped at the same step count (same seed)")


def recommended_paired_table(summary: dict, names: list[str]) -> str:
    return _difference_table(summary, names, "vs_recommended",
                             "adaptive schedule minus the static recommended preset (same steps, same seed)")


def target_table(summary: dict, names: list[str]) -> str:
    lines = ["| setting | reached (seeds) | epoch reached | time to target, CPU s | wall s | / full data's (CPU) |",
             "|---|---|---|---|---|---|"]
    for name in names:
        t = summary["settings"][name].get("time_to_target")
        if t is None:
            continue
        if not t["reached"]:
            lines.append(f"| {name} | 0 of {t['of']} | not reached | — | — | — |")
            continue
        lines.append(f"| {name} | {t['reached']} of {t['of']} | {format_stat(t['epoch'], 2)} | {format_stat(t['cpu'], 0)} | "
                     f"{format_stat(t['wall'], 0)} | {format_stat(t['ratio_cpu'])} |")
    return "\n".join(lines)


def family_table(summary: dict, names: list[str], metric: str) -> str:
    families = sorted(next(iter(summary["settings"].values()))["per_family"][metric])
    if not families:
        return "(no label families)"
    lines = ["| setting | " + " | ".join(families) + " |", "|---|" + "---|" * len(families)]
    for name in names:
        per = summary["settings"][name]["per_family"][metric]
        lines.append(f"| {name} | " + " | ".join(f"{per[f]['mean']:.3f}" if f in per else "—" for f in families)
                     + " |")
    return "\n".join(lines)


def time_table(summary: dict, names: list[str]) -> str:
    parts = ("startup", "selection", "loop", "evaluation")
    lines = ["| setting | " + " | ".join(f"{p} CPU s (wall s)" for p in parts) + " |", "|---|" + "---|" * len(parts)]
    for name in names:
        t = summary["settings"][name]["time"]
        lines.append(f"| {name} | " + " | ".join(f"{t[p + '_cpu']['mean']:.1f} ({t[p + '_wall']['mean']:.1f})"
                                                 for p in parts) + " |")
    return "\n".join(lines)


def _precision_text(precision: str) -> str:
    return {"bf16": "DeepSpeed's bf16 block (bench/results/train_throughput.md: the faster on these CPUs)",
            "autocast": "torch autocast to bf16"}.get(precision, "float32")


def feature_sources(work: Path, arms: list[dict], summary: dict, costs: dict[str, dict], models: dict[str, str]
                    ) -> list[dict]:
    """Per feature source (the trained model's own, a feature model): what its selection cost, as a share of full
    data's whole run (start-up, loop) on the same seed, and how well its k-means clusters match the task groups
    (purity: the share of records in their cluster's largest group), mean over the analyses that read it."""
    full_cpu = {int(seed): value for seed, value in summary.get("full_total_cpu", {}).items()}
    rows: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    seen = set()
    for arm in arms:
        folder = work / "analyses" / arm["analysis"]
        if arm["analysis"] in seen or arm["analysis"] not in costs or not (folder / "summary.json").exists():
            continue
        seen.add(arm["analysis"])
        cost, clusters = costs[arm["analysis"]], json.loads((folder / "summary.json").read_text())
        if "purity" not in clusters or "source" not in cost:
            continue
        row = rows[cost["source"]]
        row["extract_cpu"].append(cost.get("extract_cpu", 0.0))
        row["cluster_cpu"].append(cost.get("cluster_cpu", 0.0))
        row["purity"].append(clusters["purity"])
        row["clusters"].append(clusters["num_clusters"])
        if arm["seed"] in full_cpu:
            row["share_of_full"].append(cost["cpu"] / full_cpu[arm["seed"]])
    return [{"source": source, "model": models.get(source, source), "analyses": len(row["purity"]),
             **{key: float(np.mean(values)) if values else None for key, values in row.items()}}
            for source, row in sorted(rows.items())]


def feature_source_table(rows: list[dict]) -> str:
    lines = ["| feature source | model | analyses | extraction CPU s | k-means CPU s | selection / full data's run (CPU) "
             "| k-means purity (task groups) | clusters |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        share = f"{row['share_of_full']:.3f}" if row.get("share_of_full") is not None else "-"
        lines.append(f"| {row['source']} | `{Path(row['model']).name}` | {row['analyses']} | {row['extract_cpu']:.1f} | "
                     f"{row['cluster_cpu']:.1f} | {share} | {row['purity']:.3f} | {row['clusters']:.0f} |")
    return "\n".join(lines)


def arm_wall_table(results: dict) -> str:
    """Every arm's wall time: its training loop and its evaluation (the job's start-up and the selection are
    shared and listed above)."""
    lines = ["| arm | steps | loop wall s | evaluation wall s |", "|---|---|---|---|"]
    for name in sorted(results, key=lambda n: (results[n]["arm"]["seed"], _order(results[n]["arm"]["setting"]))):
        result = results[name]
        lines.append(f"| {name} | {result['steps']} | {result['time']['loop']['wall']:.1f} | "
                     f"{result['time']['evaluation']['wall']:.1f} |")
    return "\n".join(lines)


def plot(summary: dict, names: list[str], path: Path, results: dict, arms: list[dict], costs: dict) -> None:
    """Quality against total CPU time per setting (two panels), and the first seed's validation curves."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(15, 4.2), dpi=100, layout="constrained")
    axes = figure.subplots(1, 3)
    for axis, metric, title in zip(axes[:2], ("loss_macro", "loss_worst"),
                                   ("macro answer loss", "worst-family answer loss")):
        for name in names:
            e = summary["settings"][name]
            x, y = e["ratio_total_cpu"], e[metric]
            if x["mean"] != x["mean"]:
                continue
            axis.errorbar(x["mean"], y["mean"], xerr=0 if x["ci"] != x["ci"] else x["ci"],
                          yerr=0 if y["ci"] != y["ci"] else y["ci"], fmt="o", capsize=3, label=name)
        axis.set_xlabel("total CPU time / full data")
        axis.set_ylabel(f"{title} ({summary['split']})")
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="best")
    startup = summary["startup"]
    first_seed = min((arm["seed"] for arm in arms), default=0)
    for arm in arms:
        result = results.get(arm["name"])
        if result is None or arm["seed"] != first_seed or not result.get("validation_curve"):
            continue
        offset = job_startup(result, startup)["cpu"] + costs.get(arm["analysis"], {"cpu": 0.0})["cpu"]
        curve = result["validation_curve"]
        axes[2].plot([offset + point["loop"]["cpu"] for point in curve], [macro(point["loss"]) for point in curve],
                     marker=".", label=arm["setting"])
    axes[2].set_xlabel(f"total CPU s (seed {first_seed}: start-up + selection + training)")
    axes[2].set_ylabel("macro validation answer loss, after each epoch")
    axes[2].grid(alpha=0.3)
    axes[2].legend(fontsize=6, loc="best")
    figure.savefig(path, format="png", metadata={"Software": None})


def machine() -> str:
    cpu = "unknown CPU"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import deepspeed
    import torch

    return (f"{cpu}, {os.cpu_count()} cores; {platform.platform()}; Python {platform.python_version()}, "
            f"torch {torch.__version__}, DeepSpeed {deepspeed.__version__}")


def write_report(settings: Any, data: dict, arms: list[dict], validation_only: bool = False,
                 goals: Optional[list[dict]] = None) -> dict[str, Any]:
    """Summaries on validation (and held-out unless validation_only), the markdown, the plot and the JSON."""
    from bench.quality_goals import evaluate_goals
    from bench.quality_ablations import ablation_rows, ablation_table

    work = Path(settings.work_dir)
    results = load_results(work, arms, data.get("exact_match_families"))
    splits = ["validation"] if validation_only else ["validation", "heldout"]
    summaries = {split: summarize(arms, results, work, split) for split in splits}
    main_split = splits[-1]
    names = sorted(summaries[main_split]["settings"], key=_order)
    gate = json.loads((work / "gate.json").read_text()) if (work / "gate.json").exists() else None
    goal_rows = [] if validation_only else evaluate_goals(summaries["heldout"], settings)
    settings.results_dir.mkdir(parents=True, exist_ok=True)
    base = settings.results_dir / settings.results_name
    costs = {arm["analysis"]: json.loads((work / "analyses" / arm["analysis"] / "cost.json").read_text())
             for arm in arms if (work / "analyses" / arm["analysis"] / "cost.json").exists()}
    plot(summaries[main_split], names, base.with_suffix(".png"), results, arms, costs)
    instrument = getattr(settings, "instrument", "synthetic")

    lines = [f"# Quality benchmark: {settings.results_name}", "",
             f"Command: `{settings.command}`. Machine: {machine()}.",
             f"Instrument: {instrument}; base model `{default_base_model(settings)}`.",
             f"Data: `{settings.data}` ({data['num_train']} training records after carving validation; family sizes "
             + ", ".join(f"{f} {n}" for f, n in sorted(data["sizes"].items(), key=lambda kv: -kv[1])) + ").",
             f"Recipe: {settings.epochs} epochs, lr {settings.learning_rate}, max length {settings.max_length} tokens, "
             f"warmup {settings.warmup_fraction:.0%} then cosine to 0 at each arm's own last step, AdamW (0.9, 0.95, "
             f"eps {settings.adam_eps}), 2 ranks x micro batch {settings.micro_batch_size}"
             f"{f' x {settings.gradient_accumulation_steps} accumulated' if getattr(settings, 'gradient_accumulation_steps', 1) > 1 else ''}, "
             f"ZeRO-{settings.zero_stage}, {_precision_text(getattr(settings, 'precision', 'fp32'))}, one DeepSpeed job "
             "for every arm" + (f", {settings.train_fraction:.0%} of every family's training records"
                                if getattr(settings, "train_fraction", 1.0) < 1.0 else "") + ".",
             "Greedy exact match is scored on the label families only: "
             + (", ".join(data["exact_match_families"]) or "none")
             + (" (every family: the synthetic answers are short exact strings)." if instrument == "synthetic" else
                " (a family's 20 most frequent answers cover >= 90% of its training records).")]
    near = data.get("near_duplicates")
    if near:
        lines.append(f"Near-duplicate groups (MinHash on the prompt, word {near['rule']['shingle_words']}-grams, "
                     f"Jaccard >= {near['rule']['jaccard_threshold']}): {near['groups']} groups over "
                     f"{near['records']} training records, {near['records_in_shared_groups']} of them in a group of "
                     f"two or more (largest {near['largest_group']}).")
    for reason in getattr(settings, "skipped", ()):
        lines.append(f"Skipped: {reason}.")
    lines.append("")
    lines += ["## Calibration gate", "", "```", gate["text"] if gate else "(not run)", "```", ""]
    for split in splits:
        s = summaries[split]
        lines += [f"## {split}: every setting (mean ± 95% CI over paired seeds)", "", table(s, names), "",
                  f"## {split}: paired differences against the random subset of the same size (equal epochs)", "",
                  paired_table(s, names), "",
                  f"## {split}: paired differences against full data stopped at the same step count", "",
                  full_cut_paired_table(s, names), "",
                  f"## {split}: paired differences against full data (full_cut and *_steps: equal steps)", "",
                  full_paired_table(s, names), ""]
        if any("vs_recommended" in e for e in s["settings"].values()):
            lines += [f"## {split}: the adaptive schedule against the static recommended preset", "",
                      recommended_paired_table(s, names), ""]
    s = summaries[main_split]
    lines += [f"## {main_split}: answer loss per family", "", family_table(s, names, "loss"), "",
              f"## {main_split}: exact match per family", "", family_table(s, names, "exact_match"), "",
              "## Time to target (validation)", "",
              f"Target per seed: full data's final macro validation loss + {TARGET_SHARE:.0%} of the base-to-full "
              "drop; time = start-up + selection + training loop until the first epoch-end validation at or below "
              "it (mean over the seeds that reached it).", "", target_table(summaries["validation"], names), "",
              "## Time (CPU s over both ranks, wall s in brackets; mean over seeds)", "", time_table(s, names), "",
              "Start-up of the job that trained an arm, charged to that arm once: " + ", ".join(
                  f"{cpu:.1f} CPU s ({wall:.1f} s wall)" for cpu, wall in s.get("job_startups") or
                  [(s["startup"]["cpu"], s["startup"]["wall"])])
              + ". Selection = the analysis (forward-only feature extraction, once per feature model, + "
              "k-means; or the near-duplicate groups), charged in full to every arm that reads it: " + "; ".join(
                  f"{n}: {c['job_cpu']:.1f} CPU s" + (
                      f", extraction {c['extract_wall']:.1f} s wall = {(c['extract_over_full_epoch'] or 0):.2f} of a "
                      "full-data epoch" if c.get("extract_wall") is not None else "")
                  for n, c in s["selection"].items()) + ("(no arm that reads one has run)" if not s["selection"] else ""),
              ""]
    models = {"own": str(default_base_model(settings)),
              "small": str(getattr(settings, "small_feature_model", None) or STORIES260K_DIR),
              "smollm2": str(getattr(settings, "smollm2", None) or "SmolLM2-135M-Instruct")}
    sources = feature_sources(work, arms, s, costs, models)
    if sources:
        lines += ["## Feature sources: cost and cluster purity", "",
                  "Each source's selection (the features pass over all the training records, once per source, plus "
                  "k-means, per seed) in CPU s over both ranks, and as a share of full data's whole run on the same "
                  "seed; purity: the share of training records in their cluster's largest task group (mean over "
                  "the analyses of that source).", "", feature_source_table(sources), ""]
    lines += ["## Wall time per arm", "", arm_wall_table(results), ""]
    shares = [r["time"]["loader_wall"] / max(r["time"]["loop"]["wall"], 1e-9) for r in results.values()
              if "loader_wall" in r["time"]]
    if shares:
        lines += [f"The cluster loader (the hook's sampler: plan lookup, per-epoch set-up, collate) took "
                  f"{np.mean(shares):.2%} of the training loop's wall time on average, at most {max(shares):.2%} "
                  f"(over {len(shares)} arms).", ""]
    overhead = loader_overhead(arms, results)
    if any(name.startswith(("adaptive", "auto")) for name in overhead):
        lines += ["## The loader's share of the training loop, per setting", "",
                  "Wall time in the loader (for the adaptive schedule: drawing each window, the probe set's forward "
                  "passes, the all-reduce of the figures and the shares' check) over the training loop's wall time, "
                  "mean over seeds; the static arms beside them ran in the same job.", "",
                  "| setting | seeds | loader / loop |", "|---|---|---|"]
        lines += [f"| {name} | {len(values)} | {np.mean(values):.2%} (max {max(values):.2%}) |"
                  for name, values in sorted(overhead.items(), key=lambda item: _order(item[0]))] + [""]
    if getattr(settings, "candidates", None) and validation_only:
        fraction = getattr(settings, "headline_fraction", 0.3)
        if getattr(settings, "overhead_limit", None) is not None:
            lines += against_first_candidate(arms, results, settings.candidates, fraction, "validation")
        lines += adaptive_choice_lines(summaries["validation"], settings.candidates, fraction, overhead,
                                       getattr(settings, "overhead_limit", None))
    ablations = ablation_rows(arms, results, main_split, getattr(settings, "headline_fraction", 0.3))
    if ablations:
        lines += [f"## {main_split}: the paper's ablations beside its claims (paired over seeds, answer loss)", "",
                  "Below zero: the first setting is better. The paper's figures are pass@1 points on its own "
                  "benchmarks; only the direction is compared.", "", ablation_table(ablations), ""]
    if goal_rows:
        lines += ["## Goals", ""] + [f"- {g['goal']}: **{'met' if g['met'] else 'NOT met'}** — {g['measured']}"
                                     for g in goal_rows] + [""]
    markdown_path = base.with_suffix(".md")
    markdown_path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    base.with_suffix(".json").write_text(json.dumps({"summaries": summaries, "gate": gate, "goals": goal_rows,
                                                     "ablations": ablations,
                                                     "arms": results, "machine": machine()}, indent=1, default=str))
    return {"markdown_path": markdown_path, "summaries": summaries, "goals": goal_rows}
