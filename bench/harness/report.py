"""The quality benchmark's report (rendering only): RESULTS/NAME.md (tables), NAME.json (every arm and every
summary) and NAME.png (quality against total time, one point per setting, and the first seed's validation curves
against total time), composed from the summary (bench/harness/summary.py) and the declared rules (gate, goals,
choice, ablations)."""
from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from bench.harness import gate as gate_rule
from bench.harness.ablations import ablation_rows
from bench.harness.arms import Arm
from bench.harness.choice import AUTO_FAST_RATIO, AutoChoice, Choice, FixedChoice, choose
from bench.harness.data import PreparedData
from bench.harness.goals import evaluate_goals
from bench.harness.instrument import Settings, default_base_model
from bench.harness.summary import (TARGET_SHARE, against_first_candidate, analysis_costs, feature_sources,
                                   first_arms, job_startup, load_results, loader_overhead, macro, summarize)
from bench.harness.tables import (ablation_table, arm_wall_table, difference_table, family_table,
                                  feature_source_table, full_cut_paired_table, full_paired_table, paired_table,
                                  recommended_paired_table, setting_order, table, target_table, time_table)
from bench.real import STORIES260K_DIR


# --------------------------------------------------------------------------- the rules' outputs as text
def plateau_direction(per_epoch: Sequence[float]) -> str:
    """", rising" or ", falling" for the last epoch's change ("" with one epoch): the plateau check reads its size
    only, and a rising loss is overfitting where a falling one is unfinished."""
    if len(per_epoch) < 2:
        return ""
    return ", rising" if per_epoch[-1] > per_epoch[-2] else ", falling"


def gate_text(gate: Mapping[str, Any]) -> str:
    """The calibration gate's decision as the job prints it and WORK/gate.json keeps it."""
    checks, passed = gate["checks"], gate["passed"]
    if gate["kind"] == "real":
        learns, plateau, margin = checks["full_learns"], checks["full_plateau"], checks["random30_worse_than_full"]
        verdict = "PASSED" if passed else "FAILED"
        per_epoch = plateau["per_epoch_macro_loss"]
        direction = plateau_direction(per_epoch)
        lines = [f"calibration gate: {verdict} (real instrument, validation split, first seed)",
                 f"  full data improves macro answer loss over the base model by {learns['value']:.1%} "
                 f"({learns['base_macro_loss']:.4f} -> {learns['full_macro_loss']:.4f}; >= "
                 f"{gate_rule.FULL_IMPROVEMENT_MIN:.0%})",
                 f"  full data, macro loss change over the last epoch {plateau['value']:.2%}{direction} (< "
                 f"{gate_rule.PLATEAU_MAX:.0%}; per epoch " + ", ".join(f"{loss:.4f}" for loss in per_epoch) + ")",
                 f"  random 30% worse than full data by {margin['value']:.1%} macro "
                 f"({margin['random_macro_loss']:.4f}; >= {gate_rule.RANDOM_MARGIN_MIN:.0%})"]
        if not passed:
            lines.append("  the benchmark stops here: change the recipe (on validation), never the gate")
        return "\n".join(lines)
    every, small = checks["full_every_family"], checks["random30_loses_on_a_small_family"]
    lines = [f"calibration gate: {'PASSED' if passed else 'FAILED'} (synthetic instrument, validation split)",
             f"  base model copy probe {checks['copy_probe']['value']:.3f} (>= {gate_rule.COPY_PROBE_MIN})",
             f"  full data, worst family exact match {every['value']:.3f} "
             f"({every['worst_family']}; >= {gate_rule.FULL_EXACT_MATCH_MIN} on every family)",
             f"  full data, validation loss change over the last epoch {checks['full_plateau']['value']:.4f}"
             f"{plateau_direction(checks['full_plateau']['per_epoch_macro_loss'])} (< {gate_rule.PLATEAU_MAX})",
             "  random 30% on the small families: exact match drop "
             + ", ".join(f"{f} {d:+.2f}" for f, d in small["exact_match_drop"].items()) + "; loss margin "
             + ", ".join(f"{f} {m:+.2f}" for f, m in small["loss_margin"].items())
             + f" (>= {gate_rule.RANDOM_EXACT_MATCH_DROP} drop or >= {gate_rule.RANDOM_LOSS_MARGIN:.0%} margin on one)"]
    if not passed:
        lines.append("  the benchmark stops here: change the tasks or the model, never the gate")
    return "\n".join(lines)


def choice_lines(choice: Choice) -> list[str]:
    """The choosing run's decision (bench/candidates.json's declared rule) as the report's section; [] without one."""
    if choice.fixed is None and choice.auto is None:
        return []
    lines = ["## Choice (the declared rule, validation only)", ""]
    if choice.fixed is not None:
        lines.append(_fixed_line(choice.fixed))
    if choice.auto is not None:
        lines.append(_auto_line(choice.auto))
    return lines + [""]


def _fixed_line(fixed: FixedChoice) -> str:
    ranked = sorted(fixed.losses.items(), key=lambda item: item[1])
    if fixed.limit is None:
        return (f"- chosen: **{fixed.chosen}** (mean macro validation answer loss "
                f"{fixed.losses[str(fixed.chosen)]:.4f}; the candidates: "
                + ", ".join(f"{n} {loss:.4f}" for n, loss in ranked) + ")")
    shares = fixed.shares or {}
    listing = ", ".join(f"{n} {loss:.4f} (loader {shares[n]:.2%})" if n in shares else
                        f"{n} {loss:.4f} (loader share not measured)" for n, loss in ranked)
    if fixed.chosen is not None:
        return (f"- adaptive schedule: **{fixed.chosen}**, the lowest mean macro validation answer loss of those "
                f"whose loader share is under {fixed.limit:.0%} ({listing})")
    return (f"- adaptive schedule: **none** has a loader share under {fixed.limit:.0%}: the goal is "
            f"not met ({listing})")


def _auto_line(auto: AutoChoice) -> str:
    if auto.limit is None:
        return (f"- auto budget: **{auto.chosen}** (" + ", ".join(
            f"{n}: macro {e['loss_macro']['mean']:.4f}, total time / full {e['ratio_total_cpu']['mean']:.3f}, kept "
            f"{e['kept_fraction']['mean']:.3f}" for n, e in sorted(auto.rows.items()))
            + ("" if auto.fast else f"; none within {AUTO_FAST_RATIO:g} of full data's time: the faster") + ")")
    shares = auto.shares or {}
    listing = "; ".join(
        f"{n}: loader {shares[n]:.2%}, macro minus full {e['vs_full']['loss_macro']['mean']:+.4f} ± "
        f"{e['vs_full']['loss_macro']['ci']:.4f}, total time / full {e['ratio_total_cpu']['mean']:.3f}, kept "
        f"{e['kept_fraction']['mean']:.3f}" if n in shares and "vs_full" in e else f"{n}: not measured"
        for n, e in sorted(auto.rows.items()))
    if auto.chosen is None:
        return (f"- auto budget: **none** is under {auto.limit:.0%} of the loop and within the noise of full "
                f"data's loss: it keeps its settings and the goal is not met ({listing})")
    return (f"- auto budget: **{auto.chosen}**, the fastest of those under {auto.limit:.0%} of the loop and within "
            f"the noise of full data's loss ({listing})")


# --------------------------------------------------------------------------- the report
def write_report(settings: Settings, data: PreparedData, arms: Sequence[Arm], validation_only: bool = False
                 ) -> dict[str, Any]:
    """Summaries on validation (and held-out unless validation_only, a gate run or a missed gate), the markdown, the
    plot and the JSON."""
    work = Path(settings.work_dir)
    gate = json.loads((work / "gate.json").read_text()) if (work / "gate.json").exists() else None
    # A gate run, or a run that missed its gate, leads to the choice of a recipe (on validation): it never shows
    # held-out figures, though its arms measured them for the grid that may reuse them.
    gate_hides_heldout = settings.gate_only or (gate is not None and not gate["passed"])
    validation_only = validation_only or gate_hides_heldout
    results = load_results(work, arms, data.exact_match_families)
    if validation_only:
        results = {name: {key: value for key, value in result.items() if key != "heldout"}
                   for name, result in results.items()}
    splits = ["validation"] if validation_only else ["validation", "heldout"]
    summaries = {split: summarize(arms, results, work, split) for split in splits}
    main_split = splits[-1]
    names = sorted(summaries[main_split]["settings"], key=setting_order(arms))
    goal_rows = [] if validation_only else evaluate_goals(summaries["heldout"], settings)
    settings.results_dir.mkdir(parents=True, exist_ok=True)
    base = settings.results_dir / settings.results_name
    costs = analysis_costs(work, arms)
    plot(summaries[main_split], names, base.with_suffix(".png"), results, arms, costs)
    lines = _header(settings, data) + ["## Calibration gate", "", "```", gate["text"] if gate else "(not run)", "```",
                                       ""]
    if gate_hides_heldout:
        lines += ["Validation only: a gate run chooses the recipe, so its held-out figures are not reported.", ""]
    for split in splits:
        lines += _split_sections(summaries[split], split, names)
    s = summaries[main_split]
    lines += _time_sections(s, summaries["validation"], names, main_split)
    lines += _feature_source_section(settings, work, arms, s, costs)
    lines += _loader_sections(arms, results)
    if settings.candidates and validation_only:
        fraction = settings.headline_fraction
        if settings.overhead_limit is not None:
            lines += against_first_candidate_lines(arms, results, settings.candidates, fraction, "validation")
        lines += choice_lines(choose(summaries["validation"], settings.candidates, fraction,
                                     loader_overhead(arms, results), settings.overhead_limit))
    ablations = ablation_rows(arms, results, main_split, settings.headline_fraction)
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


def _header(settings: Settings, data: PreparedData) -> list[str]:
    """What was run: the command, the machine, the instrument, the data, the recipe, what was skipped."""
    instrument = settings.instrument
    accumulated = (f" x {settings.gradient_accumulation_steps} accumulated"
                   if settings.gradient_accumulation_steps > 1 else "")
    lines = [f"# Quality benchmark: {settings.results_name}", "",
             f"Command: `{settings.command}`. Machine: {machine()}.",
             f"Instrument: {instrument}; base model `{default_base_model(settings)}`.",
             f"Data: `{settings.data}` ({data.num_train} training records after carving validation; family sizes "
             + ", ".join(f"{f} {n}" for f, n in sorted(data.sizes.items(), key=lambda kv: -kv[1])) + ").",
             f"Recipe: {settings.epochs} epochs, lr {settings.learning_rate}, max length {settings.max_length} tokens, "
             f"warmup {settings.warmup_fraction:.0%} then cosine to 0 at each arm's own last step, AdamW (0.9, 0.95, "
             f"eps {settings.adam_eps}), 2 ranks x micro batch {settings.micro_batch_size}{accumulated}, "
             f"ZeRO-{settings.zero_stage}, {_precision_text(settings.precision)}, one DeepSpeed job "
             "for every arm" + (f", {settings.train_fraction:.0%} of every family's training records"
                                if settings.train_fraction < 1.0 else "") + ".",
             "Greedy exact match is scored on the label families only: "
             + (", ".join(data.exact_match_families) or "none")
             + (" (every family: the synthetic answers are short exact strings)." if instrument == "synthetic" else
                " (a family's 20 most frequent answers cover >= 90% of its training records).")]
    if settings.full_seeds is not None and settings.full_seeds < len(settings.seeds):
        lines.append(f"Full data and the automatic budget ran on the first {settings.full_seeds} of the "
                     f"{len(settings.seeds)} seeds (the subsets' arms on every seed): every row paired with full "
                     "data (the rows against it, the time ratios, the automatic budget's) is over those seeds only.")
    near = data.near_duplicates
    if near:
        lines.append(f"Near-duplicate groups (MinHash on the prompt, word {near['rule']['shingle_words']}-grams, "
                     f"Jaccard >= {near['rule']['jaccard_threshold']}): {near['groups']} groups over "
                     f"{near['records']} training records, {near['records_in_shared_groups']} of them in a group of "
                     f"two or more (largest {near['largest_group']}).")
    for reason in settings.skipped:
        lines.append(f"Skipped: {reason}.")
    return lines + [""]


def _split_sections(s: Mapping[str, Any], split: str, names: list[str]) -> list[str]:
    lines = [f"## {split}: every setting (mean ± 95% CI over paired seeds)", "", table(s, names), "",
             f"## {split}: paired differences against the random subset of the same size (equal epochs)", "",
             paired_table(s, names), "",
             f"## {split}: paired differences against full data stopped at the same step count", "",
             full_cut_paired_table(s, names), "",
             f"## {split}: paired differences against full data (full_cut and *_steps: equal steps)", "",
             full_paired_table(s, names), ""]
    if any("vs_recommended" in e for e in s["settings"].values()):
        lines += [f"## {split}: the adaptive schedule against the static recommended preset", "",
                  recommended_paired_table(s, names), ""]
    return lines


def _time_sections(s: Mapping[str, Any], validation: Mapping[str, Any], names: list[str], split: str) -> list[str]:
    """Per family, time to target, time, and what each job's start-up and each selection cost."""
    return [f"## {split}: answer loss per family", "", family_table(s, names, "loss"), "",
            f"## {split}: exact match per family", "", family_table(s, names, "exact_match"), "",
            "## Time to target (validation)", "",
            f"Target per seed: full data's final macro validation loss + {TARGET_SHARE:.0%} of the base-to-full "
            "drop; time = start-up + selection + training loop until the first epoch-end validation at or below "
            "it (mean over the seeds that reached it).", "", target_table(validation, names), "",
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


def _feature_source_section(settings: Settings, work: Path, arms: Sequence[Arm], s: Mapping[str, Any],
                            costs: Mapping[str, dict]) -> list[str]:
    models = {"own": str(default_base_model(settings)),
              "small": str(settings.small_feature_model or STORIES260K_DIR),
              "smollm2": str(settings.smollm2 or "SmolLM2-135M-Instruct"),
              "lora": f"{default_base_model(settings)} with seeded LoRA adapters of rank {settings.lora_rank}"}
    sources = feature_sources(work, arms, s, costs, models)
    if not sources:
        return []
    return ["## Feature sources: cost and cluster purity", "",
            "Each source's selection (the features pass over all the training records, once per source, plus "
            "k-means, per seed) in CPU s over both ranks, and as a share of full data's whole run on the same "
            "seed; purity: the share of training records in their cluster's largest task group (mean over "
            "the analyses of that source).", "", feature_source_table(sources), ""]


def _loader_sections(arms: Sequence[Arm], results: Mapping[str, dict]) -> list[str]:
    """Every arm's wall time, the loader's share of the loop overall, and per setting beside the adaptive ones."""
    lines = ["## Wall time per arm", "",
             "Every arm is its own run, full data stopped at the subsets' step count (full_cut) included: its learning "
             "rate warms up over the recipe's share of its own steps and decays by cosine to 0 at its own last step, "
             "never "
             "a cut of a longer run's schedule (the learning-rate column: as the job recorded it).", "",
             arm_wall_table(results, arms), ""]
    shares = [r["time"]["loader_wall"] / max(r["time"]["loop"]["wall"], 1e-9) for r in results.values()
              if "loader_wall" in r["time"]]
    if shares:
        lines += [f"The cluster loader (the hook's sampler: plan lookup, per-epoch set-up, collate) took "
                  f"{np.mean(shares):.2%} of the training loop's wall time on average, at most {max(shares):.2%} "
                  f"(over {len(shares)} arms).", ""]
    overhead = loader_overhead(arms, results)
    first = first_arms(arms)
    if any(first[name].adaptive for name in overhead):
        order = setting_order(arms)
        lines += ["## The loader's share of the training loop, per setting", "",
                  "Wall time in the loader (for the adaptive schedule: drawing each window, the probe set's forward "
                  "passes, the all-reduce of the figures and the shares' check) over the training loop's wall time, "
                  "mean over seeds; the static arms beside them ran in the same job.", "",
                  "| setting | seeds | loader / loop |", "|---|---|---|"]
        lines += [f"| {name} | {len(values)} | {np.mean(values):.2%} (max {max(values):.2%}) |"
                  for name, values in sorted(overhead.items(), key=lambda item: order(item[0]))] + [""]
    return lines


def against_first_candidate_lines(arms: Sequence[Arm], results: Mapping[str, dict],
                                  candidates: Mapping[str, dict], fraction: float, split: str) -> list[str]:
    """The section pairing each fixed-budget candidate with the first declared (summary.against_first_candidate)."""
    differences = against_first_candidate(arms, results, candidates, fraction, split)
    if differences is None:
        return []
    later = list(differences["settings"])
    return [f"## {split}: each candidate minus the first declared ({differences['base']}), paired over seeds", "",
            difference_table(differences, later, "vs_first", "candidate minus the first declared (same seed)"), ""]


# --------------------------------------------------------------------------- plot and machine
def plot(summary: Mapping[str, Any], names: list[str], path: Path, results: Mapping[str, dict], arms: Sequence[Arm],
         costs: Mapping[str, dict]) -> None:
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
    first_seed = min((arm.seed for arm in arms), default=0)
    for arm in arms:
        result = results.get(arm.name)
        if result is None or arm.seed != first_seed or not result.get("validation_curve"):
            continue
        offset = job_startup(result, startup)["cpu"] + costs.get(arm.analysis, {"cpu": 0.0})["cpu"]
        curve = result["validation_curve"]
        axes[2].plot([offset + point["loop"]["cpu"] for point in curve], [macro(point["loss"]) for point in curve],
                     marker=".", label=arm.setting)
    axes[2].set_xlabel(f"total CPU s (seed {first_seed}: start-up + selection + training)")
    axes[2].set_ylabel("macro validation answer loss, after each epoch")
    axes[2].grid(alpha=0.3)
    axes[2].legend(fontsize=6, loc="best")
    figure.savefig(path, format="png", metadata={"Software": None})


def machine() -> str:
    """The CPU, the platform and the versions the figures were measured with."""
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


def _precision_text(precision: str) -> str:
    return {"bf16": "DeepSpeed's bf16 block (bench/results/train_throughput.md: the faster on these CPUs)",
            "autocast": "torch autocast to bf16"}.get(precision, "float32")
