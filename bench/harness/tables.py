"""The report's markdown tables (rendering only: every figure comes from bench/harness/summary.py and the rules).

Settings are listed in METHOD_ORDER's groups (`Arm.row_group`), then the rest by name.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from bench.harness.arms import Arm
from bench.harness.summary import first_arms, format_stat

METHOD_ORDER = {"full": 0, "full_cut": 1, "random": 2, "neardup": 3, "oracle": 4, "paper": 5, "recommended": 6,
                "recommended_small": 7, "recommended_smollm2": 8, "adaptive": 9, "auto": 10, "random_steps": 11,
                "recommended_steps": 12}
LATER = 20  # settings in no group (candidates, the ablations' own random partners, the budget-ratio rows)


def setting_order(arms: Sequence[Arm]) -> Callable[[str], tuple]:
    """The sort key of a setting name in the report's tables."""
    first = first_arms(arms)

    def key(setting: str) -> tuple:
        group = first[setting].row_group if setting in first else None
        return (METHOD_ORDER.get(group, LATER) if group else LATER, setting)
    return key


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
                     f"{format_stat(e['ratio_total_cpu'])} | {format_stat(e['ratio_loop_selection_cpu'])} | "
                     f"{format_stat(e['loss_macro'])} | "
                     f"{format_stat(e['loss_worst'])} | {format_stat(e['em_macro'])} | {format_stat(e['em_worst'])} |")
    return "\n".join(lines)


def difference_table(summary: dict, names: list[str], key: str, title: str) -> str:
    lines = [f"| {title} | seeds | answer loss macro | answer loss worst | exact match macro | exact match worst |",
             "|---|---|---|---|---|---|"]
    for name in names:
        v = summary["settings"][name].get(key)
        if v:
            lines.append(f"| {name} | {v['loss_macro']['n']} | {format_stat(v['loss_macro'])} | "
                         f"{format_stat(v['loss_worst'])} | {format_stat(v['em_macro'])} | "
                         f"{format_stat(v['em_worst'])} |")
    return "\n".join(lines)


def paired_table(summary: dict, names: list[str]) -> str:
    return difference_table(summary, names, "vs_random", "setting minus random (same size, same seed)")


def full_paired_table(summary: dict, names: list[str]) -> str:
    return difference_table(summary, names, "vs_full", "setting minus full data (same seed)")


def full_cut_paired_table(summary: dict, names: list[str]) -> str:
    return difference_table(summary, names, "vs_full_cut",
                             "setting minus full data stopped at the same step count (same seed)")


def recommended_paired_table(summary: dict, names: list[str]) -> str:
    return difference_table(summary, names, "vs_recommended",
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
        lines.append(f"| {name} | {t['reached']} of {t['of']} | {format_stat(t['epoch'], 2)} | "
                     f"{format_stat(t['cpu'], 0)} | {format_stat(t['wall'], 0)} | {format_stat(t['ratio_cpu'])} |")
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


def feature_source_table(rows: Sequence[Mapping[str, Any]]) -> str:
    lines = ["| feature source | model | analyses | extraction CPU s | k-means CPU s "
             "| selection / full data's run (CPU) | k-means purity (task groups) | clusters |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        share = f"{row['share_of_full']:.3f}" if row.get("share_of_full") is not None else "-"
        lines.append(f"| {row['source']} | `{Path(row['model']).name}` | {row['analyses']} | "
                     f"{row['extract_cpu']:.1f} | {row['cluster_cpu']:.1f} | {share} | {row['purity']:.3f} | "
                     f"{row['clusters']:.0f} |")
    return "\n".join(lines)


def arm_wall_table(results: Mapping[str, dict], arms: Sequence[Arm]) -> str:
    """Every arm's wall time: its training loop and its evaluation (the job's start-up and the selection are
    shared and listed above)."""
    by_name, order = {arm.name: arm for arm in arms}, setting_order(arms)
    lines = ["| arm | steps | learning rate: highest seen, at its last step | loop wall s | evaluation wall s |",
             "|---|---|---|---|---|"]
    for name in sorted(results, key=lambda n: (by_name[n].seed, order(by_name[n].setting))):
        result = results[name]
        lines.append(f"| {name} | {result['steps']} | {_schedule_cell(result)} | "
                     f"{result['time']['loop']['wall']:.1f} | {result['time']['evaluation']['wall']:.1f} |")
    return "\n".join(lines)


def _schedule_cell(result: Mapping[str, Any]) -> str:
    """The learning rates the job recorded (step 1, mid-run, the last two steps): the highest, and the last
    step's, which is 0 when the arm's schedule decayed within its own horizon."""
    rates = {int(step): rate for step, rate in result.get("learning_rate_at_step", {}).items()}
    if not rates:
        return "—"
    return f"{max(rates.values()):.1e}, {rates[max(rates)]:.1e} (step {max(rates)})"


def ablation_table(rows: Sequence[Mapping[str, Any]]) -> str:
    lines = ["| comparison (first minus second) | seeds | answer loss macro | answer loss worst | the paper's claim "
             "| reading (macro) |", "|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['what']}: `{row['first']}` minus `{row['second']}` | {row['loss_macro']['n']} | "
                     f"{format_stat(row['loss_macro'])} | {format_stat(row['loss_worst'])} | {row['claim']} | "
                     f"{row['reading']} |")
    return "\n".join(lines)
