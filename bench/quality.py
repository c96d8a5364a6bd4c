"""Time to quality: which sampling reaches full-data quality in less time? 2 ranks, ZeRO-2, CPU.

    python bench/quality.py                       # the default run (45-80 min on 2 idle cores: bench/README.md)
    python bench/quality.py --quick               # a smoke run (at most 10 min)
    python bench/quality.py --data DIR            # any folder with train.jsonl and heldout.jsonl (Alpaca + family)
    python bench/quality.py --choose              # the candidates for the recommended preset, validation only
    python bench/quality.py --report-only         # rebuild quality.{json,md,png} from finished arms
    python bench/quality.py --base-model DIR      # another base model (a Hugging Face checkpoint folder)
    python bench/quality.py --arms random,recommended --no-ablations   # only these arms beside full data

Validation is carved from train here (VALIDATION_FRACTION of every family, at least VALIDATION_MIN,
a fixed split seed); every choice is made on it, never on held-out. All arms run in one DeepSpeed job
(bench/quality_job.py); a rerun resumes where it stopped. Arms, per seed and kept fraction f:

- full: all of the data, EPOCHS epochs (the time and quality reference);
- full_cut: all of the data, stopped at the subset arms' step count (equal steps);
- random: a uniform random subset of the paper arm's kept size;
- paper: the CluSTER paper preset (K = world size = 2, r set so that it keeps about f);
- recommended: ds_cluster's recommended preset, same kept size;
- oracle: family-balanced (labels = family, even budget, random within a family), same kept size.

A seed changes the data order, the random subset and the k-means seed together, the same for every arm.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from ds_cluster.dataset import read_jsonl, write_jsonl  # noqa: E402
from ds_cluster.distributed import free_port  # noqa: E402

VALIDATION_FRACTION = 0.1
VALIDATION_MIN = 12
SPLIT_SEED = 20261130
WORLD_SIZE = 2


@dataclass(frozen=True)
class Settings:
    """What every arm shares (the recipe was chosen on the validation split: bench/README.md)."""

    data: Path = REPO / "ds_cluster" / "toy" / "data" / "default"
    work_dir: Path = REPO / "runs" / "bench_quality"
    results_dir: Path = REPO / "bench" / "results"
    results_name: str = "quality"
    base_model: Optional[Path] = None  # default: the toy base model
    epochs: int = 16
    learning_rate: float = 1e-3
    adam_eps: float = 1e-5  # 1e-8 and 1e-6 failed the plateau check on validation mixtures (bench/README.md)
    warmup_fraction: float = 0.05
    max_length: int = 96
    micro_batch_size: int = 8
    seeds: tuple[int, ...] = (0, 1, 2, 3)
    fractions: tuple[float, ...] = (0.3, 0.5)
    headline_fraction: float = 0.3
    ablation_seeds: int = 2
    arms: tuple[str, ...] = ("full_cut", "random", "paper", "recommended", "oracle")
    recommended: dict = field(default_factory=lambda: {"preset": "recommended"})
    candidates: dict = field(default_factory=dict)  # --choose: name -> cluster_sampling block
    ablations: bool = True
    gate_only: bool = False
    heldout_per_family: Optional[int] = None
    max_new_tokens: int = 16
    copy_probe_records: int = 200
    job_timeout_s: float = 4 * 3600
    command: str = "python bench/quality.py"


# --------------------------------------------------------------------------- data
def carve_validation(records: list[dict], fraction: float = VALIDATION_FRACTION, minimum: int = VALIDATION_MIN,
                     seed: int = SPLIT_SEED) -> tuple[list[dict], list[dict]]:
    """(train, validation): `fraction` of every family (at least `minimum`) held out of train, seeded."""
    by_family: dict[str, list[dict]] = {}
    for record in records:
        by_family.setdefault(str(record.get("family", "")), []).append(record)
    rng = random.Random(seed)
    validation_ids: set[int] = set()
    for family in sorted(by_family):
        members = by_family[family]
        count = min(max(minimum, round(fraction * len(members))), len(members) // 2)
        validation_ids.update(id(r) for r in rng.sample(members, count))
    return ([r for r in records if id(r) not in validation_ids], [r for r in records if id(r) in validation_ids])


def prepare_data(settings: Settings) -> dict[str, Any]:
    """Train / validation / held-out files in the work folder, and the labels-only analyses."""
    train_all = read_jsonl(settings.data / "train.jsonl")
    heldout = read_jsonl(settings.data / "heldout.jsonl")
    if not all("family" in r for r in train_all + heldout):
        raise ValueError(f"{settings.data}: every record needs a 'family' field")
    train, validation = carve_validation(train_all)
    if settings.heldout_per_family is not None:
        taken: dict[str, int] = {}
        heldout = [r for r in heldout if taken.setdefault(r["family"], 0) < settings.heldout_per_family
                   and not taken.__setitem__(r["family"], taken[r["family"]] + 1)]
    folder = settings.work_dir / "data"
    paths = {name: folder / f"{name}.jsonl" for name in ("train", "validation", "heldout")}
    for name, records in (("train", train), ("validation", validation), ("heldout", heldout)):
        write_jsonl(records, paths[name])
    families = sorted({r["family"] for r in train})
    sizes = {f: sum(r["family"] == f for r in train) for f in families}
    analyses_root = settings.work_dir / "analyses"
    for name, labels in (("one_cluster", np.zeros(len(train), dtype=np.int64)),
                         ("families", np.array([families.index(r["family"]) for r in train], dtype=np.int64))):
        (analyses_root / name).mkdir(parents=True, exist_ok=True)
        np.save(analyses_root / name / "labels.npy", labels)
    return {"paths": paths, "families": families, "sizes": sizes, "num_train": len(train)}


# --------------------------------------------------------------------------- arms
def _arm(name: str, seed: int, analysis: str, block: dict, fraction: Optional[float], setting: str,
         **extra: Any) -> dict:
    return {"name": f"{name}_s{seed}", "setting": name, "method": setting, "seed": seed, "analysis": analysis,
            "fraction": fraction, "cluster_sampling": {**block, "seed": seed}, **extra}


def build_arms(settings: Settings, data: dict) -> tuple[list[dict], dict[str, dict]]:
    """Every arm, gate arms first, then seed-major; and the analyses they read."""
    root = settings.work_dir / "analyses"
    analyses: dict[str, dict] = {"one_cluster": {"path": str(root / "one_cluster")},
                                 "families": {"path": str(root / "families")}}
    whole = {"budget_mode": "proportional", "budget_ratio": 1.0, "selection": "random", "weighting": "none",
             "allocation": "stratified", "loss_reduction": "token"}
    arms: list[dict] = []

    def paper_analysis(seed: int) -> str:
        name = f"paper_s{seed}"
        analyses.setdefault(name, {"path": str(root / name), "cluster_sampling": {"preset": "paper", "seed": seed}})
        return name

    def features_analysis(seed: int, block: dict) -> str:
        keys = ("feature_kind", "feature_dim", "num_clusters", "capacity_factor", "kmeans_n_init", "preset")
        tag = "_".join(f"{k}{block[k]}" for k in keys if k in block) or "default"
        name = f"k_{tag}_s{seed}"
        analyses.setdefault(name, {"path": str(root / name), "cluster_sampling": {
            **{k: block[k] for k in keys if k in block}, "seed": seed}})
        return name

    def subset(kind: str, seed: int, fraction: float, **changes: Any) -> dict:
        tag = f"{kind}_f{fraction:g}" + "".join(f"_{k}-{v}" for k, v in changes.items())
        match = {"analysis": paper_analysis(seed), "fraction": fraction}
        if kind == "paper":
            return _arm(tag, seed, match["analysis"], {"preset": "paper", **changes}, fraction, kind, match=match)
        if kind == "random":
            return _arm(tag, seed, "one_cluster", {**whole, **changes}, fraction, kind, match=match)
        if kind == "oracle":
            block = {**whole, "budget_mode": "equal", **changes}
            return _arm(tag, seed, "families", block, fraction, kind, match=match)
        if kind == "full_cut":
            return _arm(tag, seed, "one_cluster", whole, fraction, kind, match=match, cut=True)
        block = {**(settings.candidates.get(kind) or settings.recommended), **changes}
        return _arm(tag, seed, features_analysis(seed, _expand(block)), block, fraction, kind, match=match)

    def full(seed: int, per_epoch: bool = False) -> dict:
        return _arm("full", seed, "one_cluster", whole, None, "full", epochs=settings.epochs,
                    per_epoch_validation=per_epoch)

    first = settings.seeds[0]
    gate_random = subset("random", first, 0.3)
    arms += [full(first, per_epoch=True), gate_random]
    if settings.gate_only:
        return [dict(arm, epochs=settings.epochs) for arm in arms], analyses
    kinds = list(settings.candidates) if settings.candidates else list(settings.arms)
    for seed in settings.seeds:
        if seed != first and not settings.candidates:  # choosing compares subsets only
            arms.append(full(seed))
        for fraction in settings.fractions:
            for kind in (["random"] + kinds if settings.candidates else kinds):
                arm = subset(kind, seed, fraction)
                if arm["name"] != gate_random["name"] and arm["name"] not in {a["name"] for a in arms}:
                    arms.append(arm)
    if settings.ablations and not settings.candidates:
        for seed in settings.seeds[:settings.ablation_seeds]:
            # What each difference from the paper is worth (fewer rows keep the default run near 45 min).
            for kind, changes in (("paper", {"weighting": "none"}), ("paper", {"selection": "random"}),
                                  ("recommended", {"loss_reduction": "sample"})):
                arms.append(subset(kind, seed, settings.headline_fraction, **changes))
    for arm in arms:
        arm.setdefault("epochs", settings.epochs)
        if arm["analysis"] not in analyses:
            raise AssertionError(arm)
    return arms, analyses


def _expand(block: dict) -> dict:
    """The block with its preset filled in (the analysis depends on the resolved feature and K settings)."""
    from ds_cluster.config import ClusterSamplingConfig

    return ClusterSamplingConfig.from_dict({**block, "enabled": True}).model_dump(exclude_none=True)


# --------------------------------------------------------------------------- the job
def write_spec(settings: Settings, data: dict, arms: list[dict], analyses: dict) -> Path:
    from ds_cluster.toy.models import base_model_path

    config = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    config.update(train_micro_batch_size_per_gpu=settings.micro_batch_size, gradient_accumulation_steps=1,
                  steps_per_print=10 ** 9)
    config.pop("train_batch_size", None)
    config["optimizer"]["params"].update(betas=[0.9, 0.95], weight_decay=0.0, eps=settings.adam_eps)
    small = sorted(data["sizes"], key=lambda f: data["sizes"][f])[:len(data["sizes"]) // 2]
    spec = {
        "work_dir": str(settings.work_dir), "base_model": str(settings.base_model or base_model_path()),
        **{name: str(path) for name, path in data["paths"].items()},
        "ds_config": config, "learning_rate": settings.learning_rate, "warmup_fraction": settings.warmup_fraction,
        "max_length": settings.max_length, "max_new_tokens": settings.max_new_tokens,
        "copy_probe_records": settings.copy_probe_records, "copy_probe_seed": 12345,
        "evaluate_splits": ["validation"] if settings.candidates else ["validation", "heldout"],
        "analyses": analyses, "arms": arms, "launched_at": time.time(),
        "gate": {"full": arms[0]["name"], "random": arms[1]["name"], "small_families": small},
        "gate_after": arms[1]["name"],
    }
    path = settings.work_dir / "spec.json"
    path.write_text(json.dumps(spec, indent=1, default=str))
    return path


def run_job(settings: Settings, spec_path: Path) -> int:
    """The one 2-rank deepspeed launch; its output goes to the console and WORK/job.log."""
    from tests.launching import job_env

    launcher = Path(sys.executable).parent / "deepspeed"
    command = [str(launcher), "--num_gpus", str(WORLD_SIZE), "--master_addr", "127.0.0.1", "--master_port",
               str(free_port()), str(REPO / "bench" / "quality_job.py"), "--spec", str(spec_path)]
    spec = json.loads(spec_path.read_text())
    spec["launched_at"] = time.time()
    spec_path.write_text(json.dumps(spec, indent=1, default=str))
    env = job_env({"OMP_NUM_THREADS": "1"})
    with open(settings.work_dir / "job.log", "a", encoding="utf-8") as log:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True)
        assert process.stdout is not None
        for line in process.stdout:
            log.write(line)
            if not line.startswith("[") or line.startswith("[rank") or "/" in line[:8]:
                sys.stdout.write(line)
        return process.wait(timeout=settings.job_timeout_s)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Settings.data, help="folder with train.jsonl and heldout.jsonl")
    parser.add_argument("--quick", action="store_true", help="a smoke run: one seed, one fraction, fewer arms")
    parser.add_argument("--choose", action="store_true",
                        help="run the recommended preset's candidates (bench/candidates.json) on validation only")
    parser.add_argument("--seeds", type=int, default=len(Settings.seeds), help="paired seeds (default 4)")
    parser.add_argument("--work-dir", type=Path, default=None, help="default runs/bench_quality[_NAME]")
    parser.add_argument("--results-dir", type=Path, default=Settings.results_dir)
    parser.add_argument("--name", default="quality", help="results file name: RESULTS_DIR/NAME.{json,md,png}")
    parser.add_argument("--report-only", action="store_true", help="no training: rebuild the report")
    parser.add_argument("--recipe", default="", metavar="K=V,...",
                        help="override the fine-tune recipe, e.g. learning_rate=2e-3,epochs=12,adam_eps=1e-6 "
                             "(for choosing it on validation with --gate-only; never on held-out)")
    parser.add_argument("--base-model", type=Path, default=None,
                        help="a Hugging Face checkpoint folder to fine-tune (default: the shipped toy base model)")
    parser.add_argument("--gate-only", action="store_true",
                        help="only the calibration gate's arms (for a confirmation mixture: bench/README.md)")
    parser.add_argument("--arms", default=None, metavar="A,B,...",
                        help=f"the subset arms to run beside full data (default {','.join(Settings.arms)}); "
                             "a confirmation run may leave out arms its claim does not use")
    parser.add_argument("--no-ablations", action="store_true", help="leave out the ablation rows")
    parser.add_argument("--test-epochs", type=int, default=None, help=argparse.SUPPRESS)  # tests only: tiny runs
    return parser.parse_args(argv)


def settings_from_args(args: argparse.Namespace, argv: Optional[list[str]] = None) -> Settings:
    # Each mode has its own name, so a smoke or choosing run never reuses or overwrites the default's arms.
    name = args.name if args.name != "quality" else (
        "quality_choose" if args.choose else "quality_quick" if args.quick else "quality")
    command = " ".join(["python bench/quality.py"] + (argv if argv is not None else sys.argv[1:]))
    settings = Settings(data=args.data, results_dir=args.results_dir, results_name=name,
                        seeds=tuple(range(args.seeds)), command=command,
                        work_dir=args.work_dir or REPO / "runs" / f"bench_{name}", base_model=args.base_model)
    if args.quick:
        settings = replace(settings, seeds=(0,), fractions=(0.3,), arms=("random", "paper", "recommended"),
                           ablations=False, heldout_per_family=40, copy_probe_records=60)
    if args.arms is not None:
        arms = tuple(arm for arm in args.arms.split(",") if arm)
        unknown = sorted(set(arms) - set(Settings.arms))
        if unknown or not arms:
            raise SystemExit(f"--arms: unknown {unknown or 'empty list'}; choose from {','.join(Settings.arms)}")
        settings = replace(settings, arms=arms)
    if args.no_ablations:
        settings = replace(settings, ablations=False)
    if args.recipe:
        pairs = dict(item.split("=", 1) for item in args.recipe.split(","))
        settings = replace(settings, **{key: type(getattr(settings, key))(value) for key, value in pairs.items()})
    if args.gate_only:
        settings = replace(settings, seeds=settings.seeds[:1], gate_only=True, ablations=False)
    if args.test_epochs is not None:
        settings = replace(settings, epochs=args.test_epochs, fractions=(0.3,), ablations=False,
                           arms=("random", "paper"), copy_probe_records=8)
    if args.choose:
        candidates = json.loads((REPO / "bench" / "candidates.json").read_text())
        settings = replace(settings, candidates=candidates, fractions=(settings.headline_fraction,),
                           ablations=False)
    return settings


def main(argv: Optional[list[str]] = None) -> int:
    from bench.quality_report import write_report

    args = parse_args(argv)
    settings = settings_from_args(args, argv)
    settings.work_dir.mkdir(parents=True, exist_ok=True)
    data = prepare_data(settings)
    arms, analyses = build_arms(settings, data)
    spec_path = write_spec(settings, data, arms, analyses)
    print(f"{len(arms)} arms in one job; work folder {settings.work_dir}", flush=True)
    if not args.report_only:
        code = run_job(settings, spec_path)
        if code != 0:
            print(f"the benchmark job exited {code}; see {settings.work_dir / 'job.log'}", flush=True)
            return code
    report = write_report(settings, data, arms, validation_only=bool(settings.candidates))
    print(report["markdown_path"], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
