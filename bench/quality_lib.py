"""The parts of the time-to-quality benchmark (bench/quality.py): analyses, runs, evaluation, report.

Runs are real 2-rank `deepspeed` launches of launch/train.py; each one's result is a JSON file in
its run folder, written last, so an interrupted benchmark resumes where it stopped.
"""
from __future__ import annotations

import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from tests.launching import free_port, job_env

REPO = Path(__file__).resolve().parents[1]
BIN = REPO / ".venv" / "bin"
WORLD_SIZE = 2
ONE_CLUSTER = "one_cluster"  # hand-made analysis: every sample in cluster 0 (full data and random subsets)
PAPER_ANALYSIS = "paper_k2"   # ds-cluster analyze, paper preset: proxy features, K = world size = 2
BEST_ANALYSIS = "k8"          # ds-cluster analyze, the same proxy features, K = 8


@dataclass(frozen=True)
class BenchSettings:
    """What every run shares. The defaults are the benchmark's; the test shrinks them."""

    work_dir: Path = REPO / "runs" / "bench_quality"
    results_dir: Path = REPO / "bench" / "results"
    epochs: int = 3
    learning_rate: float = 1e-3
    seeds: tuple[int, ...] = (0, 1, 2)
    data: Path = REPO / "ds_cluster" / "data" / "default" / "train.jsonl"
    heldout: Path = REPO / "ds_cluster" / "data" / "default" / "heldout.jsonl"
    base_config: Path = REPO / "ds_configs" / "zero2.json"
    model: str = "tiny-base"
    headline_ratio: float = 0.5
    extra_ratios: tuple[float, ...] = (1.0, 0.75)
    best_num_clusters: int = 8
    best_budget_mode: str = "neyman"
    max_steps: int = 0                      # 0: whole epochs (the test cuts runs short)
    heldout_per_family: Optional[int] = None  # None: every held-out record
    max_new_tokens: int = 16
    ablations: bool = True
    include_best: bool = True                 # the K = 8 analysis and ds_cluster's best-settings runs
    run_timeout_s: float = 3600.0
    command: str = "python bench/quality.py"


@dataclass
class AnalysisRecord:
    """An analysis directory and what producing it cost (charged to every run that uses it)."""

    name: str
    path: Path
    num_clusters: int
    job_wall_s: float = 0.0
    job_cpu_s: float = 0.0
    selection_wall_s: float = 0.0  # feature extraction + clustering, from the analysis summary
    purity: Optional[float] = None
    cluster_sizes: list[int] = field(default_factory=list)
    cluster_families: list[dict[str, int]] = field(default_factory=list)


@dataclass(frozen=True)
class RunSpec:
    """One training run: which data it keeps (the cluster_sampling block) and with which seed."""

    name: str
    setting: str
    method: str                # full, random, cluster_paper, cluster_best, ablation
    label: str                 # what the table shows
    seed: int
    analysis: str
    cluster_sampling: dict[str, Any]
    size_of_ratio: Optional[float]  # the paper ratio r whose kept size this run matches
    headline: bool


# --------------------------------------------------------------------------- launching
@dataclass
class JobTiming:
    wall_s: float
    cpu_s: float  # user + sys of every process the job started (launcher and ranks)


def run_timed(cmd: Sequence[str], log_path: Path, timeout_s: float) -> JobTiming:
    """Run a job to completion with its output in `log_path`; wall and children's CPU time.

    Raises RuntimeError with the log's tail when the job fails.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        result = subprocess.run(list(cmd), cwd=REPO, env=job_env(), stdout=log, stderr=subprocess.STDOUT,
                                timeout=timeout_s)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        tail = log_path.read_text(encoding="utf-8", errors="replace")[-4000:]
        raise RuntimeError(f"{' '.join(cmd[:8])} ... exited {result.returncode}; log {log_path}:\n{tail}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return JobTiming(wall_s=wall, cpu_s=cpu)


def deepspeed_command(script: Sequence[str]) -> list[str]:
    launcher = BIN / "deepspeed"
    return [str(launcher if launcher.exists() else "deepspeed"), "--num_gpus", str(WORLD_SIZE),
            "--master_addr", "127.0.0.1", "--master_port", str(free_port()), *script]


def ds_config(settings: BenchSettings, cluster_sampling: dict[str, Any]) -> dict[str, Any]:
    """The ZeRO-2 config every run shares, with this run's cluster_sampling block and the learning rate."""
    config = json.loads(settings.base_config.read_text(encoding="utf-8"))
    config["optimizer"]["params"]["lr"] = settings.learning_rate
    config["data_efficiency"]["data_sampling"]["cluster_sampling"] = cluster_sampling
    return config


def write_json(path: Path, document: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(path.name + ".tmp")
    staging.write_text(json.dumps(document, indent=1, sort_keys=True, default=str), encoding="utf-8")
    os.replace(staging, path)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


# --------------------------------------------------------------------------- analyses
def _num_records(path: Path) -> int:
    with open(path, encoding="utf-8") as handle:
        return sum(1 for line in handle if line.strip())


def prepare_analyses(settings: BenchSettings, run_missing: bool = True) -> dict[str, AnalysisRecord]:
    """The one-cluster analysis and the two `ds-cluster analyze` runs (paper K = 2, K = 8), once each."""
    root = settings.work_dir / "analyses"
    one = root / ONE_CLUSTER
    if not (one / "labels.npy").exists():
        one.mkdir(parents=True, exist_ok=True)
        np.save(one / "labels.npy", np.zeros(_num_records(settings.data), dtype=np.int64))
    records = {ONE_CLUSTER: AnalysisRecord(ONE_CLUSTER, one, num_clusters=1)}
    blocks = {PAPER_ANALYSIS: {"enabled": True, "preset": "paper", "seed": 1234}}
    if settings.include_best:
        blocks[BEST_ANALYSIS] = {"enabled": True, "preset": "paper", "num_clusters": settings.best_num_clusters,
                                 "seed": 1234}
    for name, block in blocks.items():
        folder = root / name
        timing_path = root / f"{name}.timing.json"
        if not timing_path.exists():
            if not run_missing:
                continue
            config_path = root / f"{name}.ds_config.json"
            write_json(config_path, ds_config(settings, block))
            print(f"analysis {name}: ds-cluster analyze, 2 ranks", flush=True)
            timing = run_timed(deepspeed_command([
                str(BIN / "ds-cluster"), "analyze", "--deepspeed", str(config_path), "--model", settings.model,
                "--data", str(settings.data), "--out", str(folder), "--no-progress", "--recompute",
            ]), root / f"{name}.log", settings.run_timeout_s)
            write_json(timing_path, asdict(timing))
        timing = read_json(timing_path)
        summary = read_json(folder / "summary.json")
        timings = summary["timings_s"]
        records[name] = AnalysisRecord(
            name, folder, num_clusters=summary["num_clusters"], job_wall_s=timing["wall_s"], job_cpu_s=timing["cpu_s"],
            selection_wall_s=timings["extract"] + timings["cluster"], purity=summary.get("purity"),
            cluster_sizes=summary["cluster_sizes"], cluster_families=summary.get("cluster_families", []))
    return records


def kept_size(settings: BenchSettings, analysis: AnalysisRecord, cluster_sampling: dict[str, Any]) -> int:
    """How many samples a run with this block keeps: the plan the hook will build, built here."""
    from ds_cluster.config import ClusterSamplingConfig
    from ds_cluster.integrations.deepspeed import load_plan_inputs
    from ds_cluster.plan import build_plan

    config = ClusterSamplingConfig(**{**cluster_sampling, "analysis_path": str(analysis.path)})
    base = json.loads(settings.base_config.read_text(encoding="utf-8"))
    inputs = load_plan_inputs(config, _num_records(settings.data))
    plan = build_plan(inputs.features, config, world_size=WORLD_SIZE,
                      micro_batch_size=base["train_micro_batch_size_per_gpu"],
                      gradient_accumulation_steps=base["gradient_accumulation_steps"],
                      labels=inputs.labels, exclude=inputs.exclude)
    return plan.num_kept


# --------------------------------------------------------------------------- the runs
def _ratio_tag(ratio: float) -> str:
    return f"r{ratio:g}"


def build_run_plan(settings: BenchSettings, analyses: dict[str, AnalysisRecord],
                   headline_only: bool = False) -> list[RunSpec]:
    """Every run, seed-major: the headline settings for each seed, then the single-seed extras.

    Headline (every seed): full data, CluSTER paper preset at the headline r, ds_cluster's best
    settings and a random subset at the paper run's kept size. Extras (first seed): ablations of the
    paper preset at the headline r (weighting off; selection random / core; stratified allocation)
    and of the best settings (weighting off; budget "equal"), then the same three methods at the
    other ratios.
    """
    one, paper, best = analyses[ONE_CLUSTER], analyses.get(PAPER_ANALYSIS), analyses.get(BEST_ANALYSIS)
    if paper is None or (best is None and settings.include_best):
        return []
    sizes = {ratio: kept_size(settings, paper, {"enabled": True, "preset": "paper", "budget_ratio": ratio})
             for ratio in (settings.headline_ratio, *settings.extra_ratios)}

    def full(seed: int) -> RunSpec:
        block = {"enabled": True, "budget_mode": "proportional", "budget_ratio": 1.0, "selection": "random",
                 "weighting": "none", "allocation": "stratified"}
        return _spec("full", "full", "full data", seed, one, block, None, True)

    def random_subset(seed: int, ratio: float, headline: bool) -> RunSpec:
        block = {"enabled": True, "budget_mode": "proportional", "budget_samples": sizes[ratio],
                 "selection": "random", "weighting": "none", "allocation": "stratified"}
        return _spec(f"random_{_ratio_tag(ratio)}", "random", f"random subset (size of r={ratio:g})", seed, one,
                     block, ratio, headline)

    def cluster_paper(seed: int, ratio: float, headline: bool, **changes: Any) -> RunSpec:
        block = {"enabled": True, "preset": "paper", "budget_ratio": ratio, **changes}
        suffix = "".join(f"_{key}_{value}" for key, value in changes.items())
        method = "ablation" if changes else "cluster_paper"
        label = f"CluSTER paper r={ratio:g}" + "".join(f", {key} {value}" for key, value in changes.items())
        return _spec(f"paper_{_ratio_tag(ratio)}{suffix}", method, label, seed, paper, block, ratio, headline)

    def cluster_best(seed: int, ratio: float, headline: bool, **changes: Any) -> RunSpec:
        block = {"enabled": True, "preset": "paper", "num_clusters": settings.best_num_clusters,
                 "budget_mode": settings.best_budget_mode, "budget_samples": sizes[ratio],
                 "allocation": "stratified", **changes}
        suffix = "".join(f"_{key}_{value}" for key, value in changes.items())
        method = "ablation" if changes else "cluster_best"
        label = (f"ds_cluster best (K={settings.best_num_clusters}, {settings.best_budget_mode}) size of r={ratio:g}"
                 + "".join(f", {key} {value}" for key, value in changes.items()))
        return _spec(f"best_{_ratio_tag(ratio)}{suffix}", method, label, seed, best, block, ratio, headline)

    ratio = settings.headline_ratio
    runs: list[RunSpec] = []
    with_best = settings.include_best
    for seed in settings.seeds:
        runs += [full(seed), random_subset(seed, ratio, True), cluster_paper(seed, ratio, True)]
        runs += [cluster_best(seed, ratio, True)] if with_best else []
    if headline_only:
        return runs
    first = settings.seeds[0]
    if settings.ablations:  # before the other ratios: two of the goals are judged on these
        runs += [cluster_paper(first, ratio, False, weighting="none"),
                 cluster_paper(first, ratio, False, selection="random"),
                 cluster_paper(first, ratio, False, selection="core"),
                 cluster_paper(first, ratio, False, allocation="stratified")]
        runs += [cluster_best(first, ratio, False, weighting="none"),
                 cluster_best(first, ratio, False, budget_mode="equal")] if with_best else []
    for extra in settings.extra_ratios:
        runs += [cluster_paper(first, extra, False), random_subset(first, extra, False)]
        runs += [cluster_best(first, extra, False)] if with_best else []
    return runs


def _spec(setting: str, method: str, label: str, seed: int, analysis: AnalysisRecord, block: dict[str, Any],
          ratio: Optional[float], headline: bool) -> RunSpec:
    block = {**block, "seed": seed, "analysis_path": str(analysis.path)}
    return RunSpec(name=f"{setting}_s{seed}", setting=setting, method=method, label=label, seed=seed,
                   analysis=analysis.name, cluster_sampling=block, size_of_ratio=ratio, headline=headline)


def run_all(settings: BenchSettings, analyses: dict[str, AnalysisRecord], runs: Sequence[RunSpec]) -> None:
    """Train and evaluate every run whose result is missing, in order."""
    for number, spec in enumerate(runs, start=1):
        result_path = settings.work_dir / "runs" / spec.name / "result.json"
        if result_path.exists():
            print(f"[{number}/{len(runs)}] {spec.name}: done before", flush=True)
            continue
        started = time.strftime("%H:%M:%S")
        result = train_and_evaluate(settings, analyses[spec.analysis], spec)
        write_json(result_path, result)
        print(f"[{number}/{len(runs)}] {spec.name} (started {started}): kept {result['kept_fraction']:.3f}, "
              f"train {result['train_job_wall_s']:.0f} s wall / {result['train_job_cpu_s']:.0f} s CPU, "
              f"macro {result['accuracy']['macro_avg']:.3f}, worst {result['accuracy']['worst']:.3f} "
              f"({result['accuracy']['worst_family']})", flush=True)


def train_and_evaluate(settings: BenchSettings, analysis: AnalysisRecord, spec: RunSpec) -> dict[str, Any]:
    """One 2-rank training job (timed), its saved model evaluated on the held-out set."""
    from ds_cluster.plan import Plan

    folder = settings.work_dir / "runs" / spec.name
    if folder.exists():
        shutil.rmtree(folder)  # a run that did not finish: start it again
    config_path = folder / "ds_config.json"
    write_json(config_path, ds_config(settings, spec.cluster_sampling))
    model_dir = folder / "model"
    script = [str(REPO / "launch" / "train.py"), "--deepspeed", str(config_path), "--model", settings.model,
              "--data", str(settings.data), "--output-dir", str(folder), "--epochs", str(settings.epochs),
              "--save-model", str(model_dir)]
    if settings.max_steps:
        script += ["--max-steps", str(settings.max_steps)]
    timing = run_timed(deepspeed_command(script), folder / "train.log", settings.run_timeout_s)
    rank_summaries = [read_json(folder / f"summary_rank{rank}.json") for rank in range(WORLD_SIZE)]
    plan_summary = Plan.load(folder / "plan").summary()
    quality = evaluate_model(settings, model_dir)
    shutil.rmtree(folder / "checkpoints", ignore_errors=True)
    return {
        "spec": asdict(spec),
        "epochs": settings.epochs,
        "learning_rate": settings.learning_rate,
        "num_samples": plan_summary["num_samples"],
        "num_kept": plan_summary["num_kept"],
        "kept_fraction": plan_summary["kept_fraction"],
        "kept_sizes": plan_summary["kept_sizes"],
        "steps": rank_summaries[0]["steps"],
        "train_job_wall_s": timing.wall_s,
        "train_job_cpu_s": timing.cpu_s,
        "train_loop_wall_s": max(summary["train_seconds"] for summary in rank_summaries),
        "train_loop_cpu_s": sum(summary.get("train_cpu_seconds", float("nan")) for summary in rank_summaries),
        "selection_wall_s": analysis.selection_wall_s,
        "selection_job_wall_s": analysis.job_wall_s,
        "selection_job_cpu_s": analysis.job_cpu_s,
        "purity": analysis.purity,
        "final_losses": rank_summaries[0]["last_losses"],
        **quality,
        "load_average_after": os.getloadavg(),
    }


def heldout_records(settings: BenchSettings) -> list[dict[str, Any]]:
    records = [json.loads(line) for line in settings.heldout.read_text(encoding="utf-8").splitlines() if line.strip()]
    if settings.heldout_per_family is None:
        return records
    taken: dict[str, int] = {}
    kept = []
    for record in records:
        family = record.get("family", "")
        if taken.get(family, 0) < settings.heldout_per_family:
            taken[family] = taken.get(family, 0) + 1
            kept.append(record)
    return kept


def evaluate_model(settings: BenchSettings, model_dir: Path) -> dict[str, Any]:
    """Held-out loss and greedy exact match per family (one thread: the machine is shared)."""
    import torch

    from ds_cluster import evaluate
    from ds_cluster.data.instructions import load_instruction_dataset
    from ds_cluster.models import load_model_and_tokenizer

    torch.set_num_threads(1)
    started = time.perf_counter()
    model, tokenizer = load_model_and_tokenizer(str(model_dir))
    records = heldout_records(settings)
    dataset = load_instruction_dataset(records, tokenizer)
    loss = evaluate.heldout_loss_by_family(model, dataset)
    accuracy = evaluate.exact_match_by_family(model, tokenizer, records, max_new_tokens=settings.max_new_tokens)
    return {
        "heldout_loss": loss,
        "heldout_loss_macro": sum(loss.values()) / len(loss),
        "accuracy_by_family": accuracy,
        "accuracy": evaluate.summarize(accuracy),
        "eval_wall_s": time.perf_counter() - started,
        "num_heldout": len(records),
    }


# --------------------------------------------------------------------------- the report
def _mean(values: Sequence[float]) -> float:
    return float(statistics.fmean(values)) if values else float("nan")


def _spread(values: Sequence[float]) -> float:
    return float(statistics.stdev(values)) if len(values) > 1 else 0.0


def machine_description() -> dict[str, Any]:
    import torch

    try:
        import deepspeed

        deepspeed_version = deepspeed.__version__
    except ImportError:  # pragma: no cover - the venv has it
        deepspeed_version = None
    cpu_model = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    return {"platform": platform.platform(), "cpu": cpu_model, "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__, "deepspeed": deepspeed_version}


def training_families(settings: BenchSettings) -> list[str]:
    with open(settings.data, encoding="utf-8") as handle:
        return [str(json.loads(line).get("family", "")) for line in handle if line.strip()]


def load_results(settings: BenchSettings, runs: Sequence[RunSpec]) -> list[dict[str, Any]]:
    """Every finished run's result, with the number of kept samples of each family (from its saved plan)."""
    families = training_families(settings)
    results = []
    for spec in runs:
        folder = settings.work_dir / "runs" / spec.name
        if not (folder / "result.json").exists():
            continue
        result = read_json(folder / "result.json")
        selected = np.load(folder / "plan" / "selected.npy")
        kept: dict[str, int] = {family: 0 for family in sorted(set(families))}
        for index in selected.tolist():
            kept[families[index]] += 1
        result["kept_by_family"] = kept
        results.append(result)
    return results


def add_time_ratios(results: list[dict[str, Any]]) -> Optional[dict[str, float]]:
    """Total (selection job + training job) over the mean full-data training job, in CPU and wall time."""
    full = [r for r in results if r["spec"]["method"] == "full"]
    if not full:
        return None
    reference = {"cpu_s": _mean([r["train_job_cpu_s"] for r in full]),
                 "wall_s": _mean([r["train_job_wall_s"] for r in full])}
    for result in results:
        result["total_cpu_s"] = result["selection_job_cpu_s"] + result["train_job_cpu_s"]
        result["total_wall_s"] = result["selection_job_wall_s"] + result["train_job_wall_s"]
        result["total_cpu_ratio"] = result["total_cpu_s"] / reference["cpu_s"]
        result["total_wall_ratio"] = result["total_wall_s"] / reference["wall_s"]
    return reference


def summarize_settings(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per setting (seeds pooled): mean and standard deviation of what the table shows."""
    by_setting: dict[str, list[dict[str, Any]]] = {}
    for result in results:
        by_setting.setdefault(result["spec"]["setting"], []).append(result)
    rows = []
    for setting, group in by_setting.items():
        families = sorted(group[0]["accuracy_by_family"])

        def stat(values: list[float]) -> dict[str, float]:
            return {"mean": _mean(values), "sd": _spread(values)}

        worst_by_mean = min(families, key=lambda f: _mean([r["accuracy_by_family"][f] for r in group]))
        rows.append({
            "setting": setting,
            "label": group[0]["spec"]["label"],
            "method": group[0]["spec"]["method"],
            "headline": group[0]["spec"]["headline"],
            "seeds": [r["spec"]["seed"] for r in group],
            "kept_fraction": stat([r["kept_fraction"] for r in group]),
            "num_kept": stat([r["num_kept"] for r in group]),
            "selection_wall_s": group[0]["selection_wall_s"],
            "selection_job_cpu_s": group[0]["selection_job_cpu_s"],
            "train_job_cpu_s": stat([r["train_job_cpu_s"] for r in group]),
            "train_job_wall_s": stat([r["train_job_wall_s"] for r in group]),
            "train_loop_cpu_s": stat([r["train_loop_cpu_s"] for r in group]),
            "total_cpu_ratio": stat([r["total_cpu_ratio"] for r in group]),
            "total_wall_ratio": stat([r["total_wall_ratio"] for r in group]),
            "macro_accuracy": stat([r["accuracy"]["macro_avg"] for r in group]),
            "worst_accuracy": stat([r["accuracy"]["worst"] for r in group]),
            "worst_families": [r["accuracy"]["worst_family"] for r in group],
            "worst_family_of_mean": worst_by_mean,
            "heldout_loss_macro": stat([r["heldout_loss_macro"] for r in group]),
            "heldout_loss_worst": stat([max(r["heldout_loss"].values()) for r in group]),
            "accuracy_by_family": {f: stat([r["accuracy_by_family"][f] for r in group]) for f in families},
            "heldout_loss": {f: stat([r["heldout_loss"][f] for r in group]) for f in families},
            "purity": group[0]["purity"],
            "kept_by_family": {f: stat([r["kept_by_family"][f] for r in group]) for f in group[0]["kept_by_family"]},
        })
    return rows


def evaluate_goals(rows: Sequence[dict[str, Any]], settings: BenchSettings) -> list[dict[str, Any]]:
    """The benchmark's goals, each met or not with the figures it was judged on (None: runs missing)."""
    by_setting = {row["setting"]: row for row in rows}
    tag = _ratio_tag(settings.headline_ratio)
    full, random_subset = by_setting.get("full"), by_setting.get(f"random_{tag}")
    goals: list[dict[str, Any]] = []

    def goal(name: str, met: Optional[bool], figures: str) -> None:
        goals.append({"goal": name, "met": met, "figures": figures})

    for key, name in ((f"paper_{tag}", "CluSTER paper preset"), (f"best_{tag}", "ds_cluster best settings")):
        row = by_setting.get(key)
        if row is None or full is None:
            goal(f"{name} r={settings.headline_ratio:g}: goals", None, "runs missing")
            continue
        ratio = row["total_cpu_ratio"]["mean"]
        goal(f"{name} r={settings.headline_ratio:g}: total CPU time <= 0.40 of full data", ratio <= 0.40,
             f"{ratio:.3f} (sd {row['total_cpu_ratio']['sd']:.3f}; wall {row['total_wall_ratio']['mean']:.3f})")
        gap = full["macro_accuracy"]["mean"] - row["macro_accuracy"]["mean"]
        goal(f"{name} r={settings.headline_ratio:g}: macro accuracy within 1 point of full data", gap <= 0.01,
             f"{row['macro_accuracy']['mean']:.3f} ± {row['macro_accuracy']['sd']:.3f} vs full "
             f"{full['macro_accuracy']['mean']:.3f} ± {full['macro_accuracy']['sd']:.3f} (gap {100 * gap:+.1f} points)")
        if random_subset is not None:
            mine, theirs = row["worst_accuracy"]["mean"], random_subset["worst_accuracy"]["mean"]
            goal(f"{name} r={settings.headline_ratio:g}: worst-family accuracy above the random subset",
                 mine > theirs, f"{mine:.3f} ± {row['worst_accuracy']['sd']:.3f} vs random {theirs:.3f} ± "
                 f"{random_subset['worst_accuracy']['sd']:.3f} (for information, worst-family held-out loss "
                 f"{row['heldout_loss_worst']['mean']:.3f} vs random {random_subset['heldout_loss_worst']['mean']:.3f})")
    first = settings.seeds[0]

    def seed_row(setting: str) -> Optional[dict[str, Any]]:
        """A setting's first-seed result (ablations have one seed; compare like with like)."""
        return by_setting.get(setting, {}).get("first_seed")

    for base, off in ((f"paper_{tag}", f"paper_{tag}_weighting_none"), (f"best_{tag}", f"best_{tag}_weighting_none")):
        on_row, off_row = seed_row(base), seed_row(off)
        if on_row is None or off_row is None:
            goal(f"weighting on beats weighting off ({base}, seed {first})", None, "runs missing")
            continue
        on_acc, off_acc = on_row["accuracy"]["macro_avg"], off_row["accuracy"]["macro_avg"]
        goal(f"weighting on beats weighting off ({base}, seed {first})", on_acc > off_acc,
             f"macro {on_acc:.3f} on vs {off_acc:.3f} off; held-out loss {on_row['heldout_loss_macro']:.3f} on vs "
             f"{off_row['heldout_loss_macro']:.3f} off")
    strategies = {"peripheral": seed_row(f"paper_{tag}"), "random": seed_row(f"paper_{tag}_selection_random"),
                  "core": seed_row(f"paper_{tag}_selection_core")}
    if all(strategies.values()):
        ordered = sorted(strategies, key=lambda s: -strategies[s]["accuracy"]["macro_avg"])  # type: ignore[index]
        figures = ", ".join(f"{s} {strategies[s]['accuracy']['macro_avg']:.3f}" for s in ordered)  # type: ignore[index]
        goal(f"selection strategy ordering (paper: peripheral > random > core), seed {first}",
             ordered == ["peripheral", "random", "core"], " > ".join(ordered) + f" ({figures})")
    else:
        goal("selection strategy ordering", None, "runs missing")
    return goals


def _attach_first_seed(rows: list[dict[str, Any]], results: Sequence[dict[str, Any]], first_seed: int) -> None:
    for row in rows:
        row["first_seed"] = next((r for r in results if r["spec"]["setting"] == row["setting"]
                                  and r["spec"]["seed"] == first_seed), None)


def _pm(stat: dict[str, float], digits: int = 3, scale: float = 1.0) -> str:
    if stat["sd"]:
        return f"{scale * stat['mean']:.{digits}f} ± {scale * stat['sd']:.{digits}f}"
    return f"{scale * stat['mean']:.{digits}f}"


def _family_table(rows: Sequence[dict[str, Any]], key: str, digits: int) -> list[str]:
    """A markdown table: one row per setting, one column per family, the seed mean of row[key][family]."""
    families = sorted(rows[0][key]) if rows else []
    lines = ["| setting | " + " | ".join(families) + " |", "|---" * (len(families) + 1) + "|"]
    for row in rows:
        lines.append(f"| {row['label']} | " + " | ".join(f"{row[key][f]['mean']:.{digits}f}" for f in families) + " |")
    return lines


def markdown_report(settings: BenchSettings, rows: Sequence[dict[str, Any]], goals: Sequence[dict[str, Any]],
                    reference: Optional[dict[str, float]], machine: dict[str, Any],
                    analyses: dict[str, AnalysisRecord]) -> str:
    lines = [
        "# Time to quality: CluSTER against full data and a random subset",
        "",
        f"Command: `{settings.command}`. Machine: {machine['cpu'] or 'CPU'}, {machine['cpu_count']} cores shared "
        f"with other jobs, {machine['platform']}; Python {machine['python']}, torch {machine['torch']}, "
        f"DeepSpeed {machine['deepspeed']}.",
        f"Every run: 2 ranks, ZeRO-2, CPU, the `deepspeed` launcher, base model `{settings.model}`, AdamW lr "
        f"{settings.learning_rate:g}, micro batch 4 x accumulation 2 x 2 ranks = 16 per step, {settings.epochs} "
        f"epochs over the run's own kept data"
        + (f" (cut at {settings.max_steps} steps)" if settings.max_steps else "") + ".",
        "Time ratios are CPU time (user + sys of the launcher and both ranks, whole jobs with start-up) of "
        "selection (the analysis job, charged in full to each run that uses it) + training, over the mean "
        "full-data training job"
        + (f" ({reference['cpu_s']:.0f} CPU s, {reference['wall_s']:.0f} wall s)" if reference else "")
        + "; wall-time ratios are in quality.json. Mean ± standard deviation over seeds where a setting has several.",
        "",
        "| setting | seeds | kept | selection s (wall) | train CPU s | total / full (CPU) | macro acc | "
        "worst family acc | held-out loss (macro / worst family) | purity |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        worst = _pm(row["worst_accuracy"]) + f" ({row['worst_family_of_mean']})"
        purity = f"{row['purity']:.2f}" if row["purity"] is not None else "—"
        lines.append(
            f"| {row['label']} | {len(row['seeds'])} | {_pm(row['kept_fraction'])} | {row['selection_wall_s']:.1f} | "
            f"{_pm(row['train_job_cpu_s'], 0)} | {_pm(row['total_cpu_ratio'])} | {_pm(row['macro_accuracy'])} | "
            f"{worst} | {_pm(row['heldout_loss_macro'])} / {_pm(row['heldout_loss_worst'])} | {purity} |")
    for key, title, digits in (
            ("accuracy_by_family", "Exact-match accuracy per family (greedy decoding on heldout.jsonl, mean over seeds)", 2),
            ("heldout_loss", "Held-out token loss per family (mean over seeds)", 3),
            ("kept_by_family", "Kept training samples per family (mean over seeds; full data in the first row)", 0)):
        lines += ["", f"{title}:", ""] + _family_table(rows, key, digits)
    lines += ["", "Analyses (done once each, charged to every run that uses them):", "",
              "| analysis | K | cluster sizes | extract + cluster s (wall) | job CPU s | family purity |",
              "|---|---|---|---|---|---|"]
    for record in analyses.values():
        purity = f"{record.purity:.3f}" if record.purity is not None else "—"
        lines.append(f"| {record.name} | {record.num_clusters} | {record.cluster_sizes or '—'} | "
                     f"{record.selection_wall_s:.1f} | {record.job_cpu_s:.0f} | {purity} |")
    lines += ["", "Goals:", ""]
    for item in goals:
        verdict = {True: "met", False: "NOT met", None: "not measured"}[item["met"]]
        lines.append(f"- {item['goal']}: **{verdict}** — {item['figures']}")
    return "\n".join(lines) + "\n"


def plot_accuracy_against_time(results: Sequence[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"full": "black", "random": "tab:grey", "cluster_paper": "tab:blue", "cluster_best": "tab:green",
               "ablation": "tab:orange"}
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharex=True)
    for axis, key, title in ((axes[0], "macro_avg", "macro-average accuracy"),
                             (axes[1], "worst", "worst-family accuracy")):
        seen: set[str] = set()
        for result in results:
            method = result["spec"]["method"]
            axis.scatter(result["total_cpu_ratio"], result["accuracy"][key], color=colours.get(method, "tab:red"),
                         label=None if method in seen else method, alpha=0.8, s=28)
            seen.add(method)
        axis.set_xlabel("total time / full data (CPU time, selection + training)")
        axis.set_ylabel(title)
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    figure.suptitle("Time to quality, one point per run (2 ranks, ZeRO-2, CPU)")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write_report(settings: BenchSettings, analyses: dict[str, AnalysisRecord],
                 runs: Sequence[RunSpec]) -> dict[str, Any]:
    """quality.json, quality.md and quality.png from every finished run."""
    results = load_results(settings, runs)
    reference = add_time_ratios(results)
    if reference is None:
        rows, goals = [], []
    else:
        rows = summarize_settings(results)
        _attach_first_seed(rows, results, settings.seeds[0])
        goals = evaluate_goals(rows, settings)
    machine = machine_description()
    planned = [spec.name for spec in runs]
    finished = [result["spec"]["name"] for result in results]
    document = {
        "command": settings.command,
        "machine": machine,
        "settings": {key: (str(value) if isinstance(value, Path) else value) for key, value in asdict(settings).items()},
        "time_ratio_basis": "CPU seconds (user+sys, launcher and both ranks, whole jobs) of analysis + training "
                            "over the mean full-data training job",
        "full_data_reference": reference,
        "analyses": {name: {**asdict(record), "path": str(record.path)} for name, record in analyses.items()},
        "runs_planned": planned,
        "runs_finished": finished,
        "runs_missing": [name for name in planned if name not in finished],
        "settings_summary": [{k: v for k, v in row.items() if k != "first_seed"} for row in rows],
        "goals": goals,
        "runs": results,
    }
    settings.results_dir.mkdir(parents=True, exist_ok=True)
    json_path = settings.results_dir / "quality.json"
    markdown_path = settings.results_dir / "quality.md"
    plot_path = settings.results_dir / "quality.png"
    write_json(json_path, document)
    if rows:
        markdown_path.write_text(markdown_report(settings, rows, goals, reference, machine, analyses),
                                 encoding="utf-8")
        plot_accuracy_against_time(results, plot_path)
    return {"json_path": json_path, "markdown_path": markdown_path, "plot_path": plot_path, "rows": rows,
            "goals": goals, "missing": document["runs_missing"]}


def tiny_settings(work_dir: Path, data: Path, heldout: Path, base_config: Path) -> BenchSettings:
    """The whole pipeline at a tiny size, for the test: a few steps, one seed, three families' worth of decoding."""
    return replace(BenchSettings(), work_dir=work_dir, results_dir=work_dir / "results", data=data, heldout=heldout,
                   base_config=base_config, epochs=1, seeds=(0,), max_steps=2, heldout_per_family=2,
                   max_new_tokens=6, extra_ratios=(), ablations=False, include_best=False, run_timeout_s=240.0,
                   command="pytest tests/test_bench_quality.py")
