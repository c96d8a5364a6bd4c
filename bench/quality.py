"""Time to quality: which sampling reaches full-data quality in less time? 2 ranks, ZeRO-2 by default, CPU.

    python bench/quality.py                       # the default run: the T0 slice on stories260K (bench/README.md)
    python bench/quality.py --quick               # a smoke run of the same instrument (at most 10 min)
    python bench/quality.py --data bench/real/data/flan_cot --recipe epochs=4 --name quality_flan_cot
                            --arms random,recommended,neardup
                                                  # the confirmation mixture (FLAN CoT; chooses no method;
                                                  # 4 epochs: its gate's recipe, bench/README.md)
    python bench/quality.py --data DIR            # any folder with train.jsonl[.gz] and heldout.jsonl[.gz]
                                                  # (Alpaca fields plus `family`)
    python bench/quality.py --synthetic           # the synthetic instrument (toy tasks, toy base model): a check
                                                  # of the machinery, not a quality claim
    python bench/quality.py --gate-only           # only the calibration gate's arms
    python bench/quality.py --choose              # the candidates for the recommended preset, validation only
    python bench/quality.py --choose-overhead     # the adaptive schedule's window and probe size, under 1% of the loop
    python bench/quality.py --report-only         # rebuild the report from finished arms
    python bench/quality.py --base-model DIR      # another base model (a Hugging Face checkpoint folder)
    python bench/quality.py --arms random,recommended --no-ablations   # only these arms beside full data
    python bench/quality.py --equal-steps         # add random and recommended at 30% trained to full data's steps

Validation is carved from train here (VALIDATION_FRACTION of every family, at least VALIDATION_MIN,
a fixed split seed); every choice is made on it, never on held-out. All arms run in one DeepSpeed job
(bench/quality_job.py); a rerun resumes where it stopped. Arms, per seed and kept fraction f:

- full: all of the data, `epochs` epochs (the time and quality reference);
- full_cut: all of the data, stopped at the subset arms' step count (equal steps, full data's side);
- random: a uniform random subset of the paper arm's kept size;
- paper: the CluSTER paper preset (K = world size = 2, r set so that it keeps about f);
- recommended: ds_cluster's recommended preset on the trained model's own features, same kept size;
- recommended_smollm2: the same preset on SmolLM2-135M-Instruct's features (`feature_model`), when
  .cache/smollm2-135m-instruct exists (else skipped, and the report says so);
- oracle: family-balanced (labels = family, even budget, random within a family), same kept size;
- neardup: near-duplicate removal to the same kept size (bench/near_duplicates.py has the rule);
- KIND_steps (with --equal-steps): the subset trained for more epochs, to full data's step count.

A seed changes the data order, the random subset and the k-means seed together, the same for every arm.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import random
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from ds_cluster.data.dataset import prompt_text, read_jsonl, write_jsonl  # noqa: E402
from ds_cluster.distributed import free_port  # noqa: E402
from ds_cluster.planning.selection import SELECTIONS  # noqa: E402
from bench.instrument import data_file, default_base_model, job_env  # noqa: E402
from bench.real import STORIES260K_DIR  # noqa: E402
from bench.toy.models import default_cache_root  # noqa: E402

logger = logging.getLogger("bench.quality")

VALIDATION_FRACTION = 0.1
VALIDATION_MIN = 12
SPLIT_SEED = 20261130
WORLD_SIZE = 2
# A family's answers are labels (greedy exact match is scored on it) when its CATEGORICAL_TOP_ANSWERS
# most frequent distinct answers (whitespace stripped) cover at least CATEGORICAL_COVERAGE_MIN of its
# records in the whole training file (before any slice). On the T0 slice: paraphrase 1.00, topic 1.00,
# sentiment 0.92 are labels; closed-book QA 0.55, multiple choice 0.25, summaries 0.21 and generated sentences 0.13 are not.
CATEGORICAL_TOP_ANSWERS = 20
CATEGORICAL_COVERAGE_MIN = 0.9
SMOLLM2_DIR = REPO / ".cache" / "smollm2-135m-instruct"
# SmolLM2 tokens per sample for its features: about 90% of the T0 records fit whole (1.35 tokens per
# word on their word counts); extraction keeps the full width, so its cost is proportional to this.
SMOLLM2_FEATURE_MAX_LENGTH = 96

REAL_ARMS = ("full_cut", "random", "paper", "recommended", "oracle", "neardup", "recommended_smollm2")
SYNTHETIC_ARMS = ("full_cut", "random", "paper", "recommended", "oracle")
# adaptive: the adaptive schedule at the subsets' step count; auto: it with budget_ratio "auto", up to full data's
# steps; recommended_small: the recommended preset on a small feature model's features (stories260K under SmolLM2).
KNOWN_ARMS = REAL_ARMS + ("adaptive", "auto", "recommended_small")
# The adaptive schedule the benchmark runs: the candidate bench/candidates.json's "adaptive" choice picked on T0's
# validation split (bench/README.md, docs/adaptive.md), on the recommended preset's clusters.
# Chosen 2026-12-03 (bench/results/real/quality_choose_adaptive.md): adaptive_loss, the lowest mean macro validation
# loss of the declared candidates; its window and probe size then from candidates.json's "adaptive_overhead" list
# (bench/results/real/quality_choose_overhead.md: window 20 with a probe of 2, the only one under 1% of the loop).
# The automatic budget: auto_cooldown_maintenance of candidates.json's "auto" list (bench/results/real/
# quality_choose_auto.md: the lowest macro validation loss and the fastest, none within 0.5 of full data's time),
# after both earlier auto candidates failed (quality_choose_adaptive.md); its stopping signal then from the
# "auto_overhead" list (quality_choose_auto_overhead.md: window 10, no probe set, each cluster's training loss of
# the window; 0.45% of the loop, within the noise of full data's validation loss).
ADAPTIVE_PRESET: dict[str, Any] = {"schedule": "adaptive", "adaptive_rule": "loss", "adapt_every": 20,
                                   "adaptive_pool": "all", "probe_size": 2, "exploration": 0.1, "weighting": "cluster"}
AUTO_PRESET: dict[str, Any] = {**ADAPTIVE_PRESET, "adapt_every": 10, "probe_size": 0, "budget_ratio": "auto",
                               "auto_tolerance": 0.03, "auto_patience": 3, "auto_cooldown": 0.2,
                               "auto_maintenance": 0.25}
EQUAL_STEPS_KINDS = ("random", "recommended")
# Issue 33's bound on the adaptive schedule's cost: the loader's share of the training loop (--choose-overhead).
OVERHEAD_LIMIT = 0.01
# Each choosing flag (--choose, --choose-adaptive, ...) and its list in bench/candidates.json (None: the
# instrument's own list); the results are named quality_<flag>. The *_overhead lists are judged by OVERHEAD_LIMIT.
CHOICE_LISTS: dict[str, Optional[str]] = {"choose_adaptive": "adaptive", "choose_auto": "auto",
                                          "choose_overhead": "adaptive_overhead",
                                          "choose_auto_overhead": "auto_overhead", "choose": None}


@dataclass(frozen=True)
class Settings:
    """What every arm shares. The defaults are the real instrument's; SYNTHETIC_RECIPE replaces them for the
    synthetic one (how each recipe was chosen, and that the real one has not passed its gate yet: bench/README.md)."""

    instrument: str = "real"  # "real": a real mixture and base model; "synthetic": the toy check of the machinery
    data: Path = REPO / "bench" / "real" / "data" / "t0"
    work_dir: Path = REPO / "runs" / "bench_real_quality"
    results_dir: Path = REPO / "bench" / "results" / "real"
    results_name: str = "quality"
    base_model: Optional[Path] = None  # default: stories260K (real) or the toy base model (synthetic)
    # The recipe: of those that passed the gate on validation, the cheapest in CPU s, then the lowest full-data
    # validation loss (bench/README.md, "Recipes tried").
    epochs: int = 2
    learning_rate: float = 1e-3
    adam_eps: float = 1e-5  # 1e-8 and 1e-6 failed the synthetic plateau check (bench/README.md)
    warmup_fraction: float = 0.05
    max_length: int = 160  # for time (272 holds every T0 record whole, at 1.7x the step's cost); prompts cut first
    # "alpaca": the plain Alpaca prompt; "chat": each record as a user turn (its instruction and input) and an
    # assistant turn (its answer), rendered with the trained model's chat template (to_chat_record).
    prompt: str = "alpaca"
    micro_batch_size: int = 32
    zero_stage: int = 2  # ds_configs/zero{N}.json; fp32, so the stage changes the cost, not the arithmetic
    seeds: tuple[int, ...] = (0, 1, 2, 3)
    fractions: tuple[float, ...] = (0.3, 0.5)
    headline_fraction: float = 0.3
    ablation_seeds: int = 2  # the synthetic instrument's ablations; the real one's run on every seed
    # The real instrument's r-arms: the paper preset at budget_ratio r itself, each beside a random arm of its
    # kept count (the job's resolve_arm matches a budget_ratio as well as a fraction).
    ablation_ratios: tuple[float, ...] = (0.25, 0.5, 0.75)
    arms: tuple[str, ...] = REAL_ARMS
    recommended: dict = field(default_factory=lambda: {"preset": "recommended"})
    adaptive: dict = field(default_factory=lambda: dict(ADAPTIVE_PRESET))
    auto: dict = field(default_factory=lambda: dict(AUTO_PRESET))
    small_feature_model: Optional[Path] = None  # recommended_small's feature model (default: stories260K)
    small_feature_max_length: int = 272  # stories260K's tokens: every T0 record whole
    train_fraction: float = 1.0  # a seeded share of every family of the train file (the SmolLM2 instrument's slice)
    # "bf16": DeepSpeed's bf16 block (the SmolLM2 instrument: bench/results/train_throughput.md); "autocast":
    # torch autocast to bf16 in the DeepSpeed config.
    precision: str = "fp32"
    gradient_accumulation_steps: int = 1
    time_goal: float = 0.40  # the preset's total time at the headline fraction, over full data's
    candidates: dict = field(default_factory=dict)  # --choose: name -> cluster_sampling block
    # --choose-overhead: only candidates whose mean loader share of the training loop is below this may be chosen
    overhead_limit: Optional[float] = None
    ablations: bool = False
    equal_steps: bool = False
    gate_only: bool = False
    heldout_per_family: Optional[int] = None
    copy_probe_records: int = 200
    smollm2: Optional[Path] = SMOLLM2_DIR
    smollm2_feature_max_length: int = SMOLLM2_FEATURE_MAX_LENGTH
    # Feature extractions shared by the runs on one mixture (features_folder); None: each work folder its own.
    features_cache: Optional[Path] = field(default_factory=lambda: default_cache_root() / "bench_features")
    skipped: tuple[str, ...] = ()  # arms left out, with the reason (the report repeats it)
    job_timeout_s: float = 4 * 3600
    command: str = "python bench/quality.py"


# The capable-model instrument (`--model smollm2`): SmolLM2-135M-Instruct fine-tuned in bf16 on a slice of the
# T0 mixture sized so one full-data run takes about 7 minutes here. Its recipe is the first of the declared
# candidates (bench/candidates.json, "smollm2_recipes") to pass the calibration gate on validation, 2026-12-03
# (bench/results/real/quality_smollm2_gate_epochs3_lr1e-4.md): 7% of every family's train records, 3 epochs,
# lr 1e-4. The first recipe (15%, 2 epochs) missed the plateau check (-7.0%). The plain Alpaca prompt was kept
# over the chat template by the declared rule ("smollm2_prompt"; bench/results/real/quality_smollm2_gate_chat.md).
SMOLLM2_RECIPE: dict[str, Any] = {
    "base_model": SMOLLM2_DIR, "train_fraction": 0.07, "heldout_per_family": 50, "max_length": 136,
    "micro_batch_size": 8, "gradient_accumulation_steps": 2, "precision": "bf16", "zero_stage": 0,
    "learning_rate": 1e-4,
    "adam_eps": 1e-8, "epochs": 3, "seeds": (0, 1, 2), "fractions": (0.3,),
    "arms": ("full_cut", "random", "recommended", "recommended_small", "adaptive", "auto"), "smollm2": None,
    "time_goal": 0.33,
    # Its 30% arms take 15 optimizer steps: the chosen 20-step window would never close (no adaptation at all),
    # so this instrument keeps the window 10 and probe 4 its figures were measured with (quality_smollm2.md),
    # for the automatic budget too.
    "adaptive": {**ADAPTIVE_PRESET, "adapt_every": 10, "probe_size": 4},
    "auto": {**AUTO_PRESET, "probe_size": 4},
    "work_dir": REPO / "runs" / "bench_smollm2_quality"}
SYNTHETIC_RECIPE: dict[str, Any] = {
    "instrument": "synthetic", "data": REPO / "bench" / "toy" / "data" / "default",
    "results_dir": REPO / "bench" / "results", "epochs": 16, "learning_rate": 1e-3, "max_length": 96,
    "micro_batch_size": 8,
    "arms": SYNTHETIC_ARMS, "ablations": True, "smollm2": None,
    # The preset as chosen on this instrument (proxy features), so its published figures reproduce.
    "recommended": {"preset": "recommended", "feature_kind": "proxy"}}


# --------------------------------------------------------------------------- data
def carve_validation(records: list[dict], fraction: float = VALIDATION_FRACTION, minimum: int = VALIDATION_MIN,
                     seed: int = SPLIT_SEED) -> tuple[list[dict], list[dict]]:
    """(train, validation): `fraction` of every family (at least `minimum`) held out of train, seeded.

    Records with an `example_id` (the real slices: one underlying example under several templates)
    go to validation a whole example group at a time, so no example is on both sides.
    """
    if not any("example_id" in record for record in records):
        return _carve_records(records, fraction, minimum, seed)
    by_family: dict[str, dict[str, list[dict]]] = {}
    for index, record in enumerate(records):
        group = str(record.get("example_id", f"#{index}"))
        by_family.setdefault(str(record.get("family", "")), {}).setdefault(group, []).append(record)
    rng = random.Random(seed)
    validation_ids: set[int] = set()
    for family in sorted(by_family):
        groups = by_family[family]
        size = sum(len(members) for members in groups.values())
        count = min(max(minimum, round(fraction * size)), size // 2)
        taken = 0
        for name in rng.sample(sorted(groups), len(groups)):
            if taken >= count:
                break
            if taken + len(groups[name]) > max(count, size // 2):
                continue  # a large group would take more than half the family
            validation_ids.update(id(r) for r in groups[name])
            taken += len(groups[name])
    return ([r for r in records if id(r) not in validation_ids], [r for r in records if id(r) in validation_ids])


def _carve_records(records: list[dict], fraction: float, minimum: int, seed: int) -> tuple[list[dict], list[dict]]:
    """The split of records without example groups (the synthetic mixtures), as the recorded results used."""
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


def seeded_share(records: list[dict], fraction: float, seed: int = SPLIT_SEED) -> list[dict]:
    """The same share of every family, whole underlying examples at a time (records with one `example_id`
    stay together, so a validation split carved from it is still split by example), seeded; in file order."""
    groups: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for index, record in enumerate(records):
        groups[str(record.get("family", ""))][str(record.get("example_id", f"#{index}"))].append(index)
    rng = random.Random(seed)
    chosen: list[int] = []
    for family in sorted(groups):
        names = sorted(groups[family])
        want = round(fraction * sum(len(members) for members in groups[family].values()))
        for name in rng.sample(names, len(names)):
            if want <= 0:
                break
            chosen += groups[family][name]
            want -= len(groups[family][name])
    return [records[index] for index in sorted(chosen)]


def categorical_families(records: Sequence[Mapping[str, Any]], top: int = CATEGORICAL_TOP_ANSWERS,
                         coverage: float = CATEGORICAL_COVERAGE_MIN) -> list[str]:
    """The families whose answers are labels: their `top` most frequent answers cover >= `coverage` of them."""
    answers: dict[str, Counter] = defaultdict(Counter)
    for record in records:
        answers[str(record.get("family", ""))][str(record.get("output", "")).strip()] += 1
    return sorted(family for family, counts in answers.items()
                  if sum(n for _, n in counts.most_common(top)) >= coverage * sum(counts.values()))


def to_chat_record(record: Mapping[str, Any]) -> dict[str, Any]:
    """An Alpaca record as a chat record: a user turn (the instruction and input as plain text) and an assistant
    turn (the answer); its other fields (family, example_id, ...) kept, `output` too: the reference answer that
    exact match reads."""
    kept = {key: value for key, value in record.items() if key not in ("instruction", "input")}
    return {**kept, "messages": [{"role": "user", "content": prompt_text(record)},
                                 {"role": "assistant", "content": record["output"]}]}


def prepare_data(settings: Settings) -> dict[str, Any]:
    """Train / validation / held-out files in the work folder, the labels-only analyses, the near-duplicate groups."""
    from bench.near_duplicates import compute_groups

    train_all = read_jsonl(data_file(settings.data, "train"))
    heldout = read_jsonl(data_file(settings.data, "heldout"))
    if not all("family" in r for r in train_all + heldout):
        raise ValueError(f"{settings.data}: every record needs a 'family' field")
    # Whether a family's answers are labels is a property of the family: judged on the whole train file, since
    # in a small slice every answer of a free-text family (a few underlying examples) is among the most frequent.
    exact_match = categorical_families(train_all)
    if settings.train_fraction < 1.0:
        train_all = seeded_share(train_all, settings.train_fraction)
    if settings.prompt not in ("alpaca", "chat"):
        raise SystemExit(f"prompt: 'alpaca' or 'chat', got {settings.prompt!r}")
    if settings.prompt == "chat":
        train_all, heldout = [to_chat_record(r) for r in train_all], [to_chat_record(r) for r in heldout]
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
    near = analyses_root / "near_duplicates"
    if not (near / "groups.npy").exists():
        compute_groups(train, near)
    # The synthetic families are all short exact strings: exact match is scored on every one of them.
    if settings.instrument == "synthetic":
        exact_match = families
    return {"paths": paths, "families": families, "sizes": sizes, "num_train": len(train),
            "exact_match_families": exact_match,
            "near_duplicates": json.loads((near / "summary.json").read_text())}


# --------------------------------------------------------------------------- arms
def features_folder(settings: Settings, data: dict, name: str, entry: dict) -> Path:
    """Where a feature model's features of this training split live: in the work folder, or with
    `features_cache` set, in a folder keyed by the split, the max length and the feature settings, so every
    run on the same mixture (the default run, --choose, --ablations) extracts them once. Their cost is
    recorded with them (cost.json) and charged to every arm that reads them, in every run."""
    if settings.features_cache is None:
        return settings.work_dir / "analyses" / name
    key = hashlib.sha256(Path(data["paths"]["train"]).read_bytes())
    key.update(json.dumps({"max_length": settings.max_length, **entry}, sort_keys=True, default=str).encode())
    return Path(settings.features_cache) / f"{name}-{key.hexdigest()[:16]}"


def _arm(name: str, seed: int, analysis: str, block: dict, fraction: Optional[float], setting: str,
         **extra: Any) -> dict:
    return {"name": f"{name}_s{seed}", "setting": name, "method": setting, "seed": seed, "analysis": analysis,
            "fraction": fraction, "cluster_sampling": {**block, "seed": seed}, **extra}


def build_arms(settings: Settings, data: dict) -> tuple[list[dict], dict[str, dict]]:
    """Every arm, gate arms first, then seed-major; and the analyses they read.

    Features are extracted once per feature model ("features_own", "features_smollm2"); every k-means
    analysis clusters them with its own settings and seed; every arm is charged its analysis in full.
    """
    root = settings.work_dir / "analyses"
    analyses: dict[str, dict] = {"one_cluster": {"path": str(root / "one_cluster")},
                                 "families": {"path": str(root / "families")}}
    whole = {"budget_mode": "proportional", "budget_ratio": 1.0, "selection": "random", "weighting": "none",
             "allocation": "stratified", "loss_reduction": "token"}
    feature_sources = {"own": {"model": str(default_base_model(settings))},
                       "small": {"model": str(settings.small_feature_model or STORIES260K_DIR),
                                 "feature_max_length": settings.small_feature_max_length}}
    if settings.smollm2 is not None:
        feature_sources["smollm2"] = {"model": str(settings.smollm2),
                                      "feature_max_length": settings.smollm2_feature_max_length}
    arms: list[dict] = []
    # The settings a k-means analysis depends on: an arm that changes one of them reads its own clustering.
    clustering_keys = ("feature_kind", "feature_dim", "num_clusters", "capacity_factor", "kmeans_n_init")

    def features_of(source: str, block: dict) -> str:
        name = f"features_{source}_{block.get('feature_kind', 'proxy')}{block.get('feature_dim') or ''}"
        if name not in analyses:
            entry = {"source": source, **feature_sources[source],
                     "cluster_sampling": {k: block[k] for k in ("feature_kind", "feature_dim", "normalize_features")
                                          if k in block}}
            analyses[name] = {"path": str(features_folder(settings, data, name, entry)), **entry}
        return name

    def paper_analysis(seed: int) -> str:
        name = f"paper_s{seed}"
        block = {**_expand({"preset": "paper"}), "seed": seed}
        analyses.setdefault(name, {"path": str(root / name), "cluster_sampling": block,
                                   "features": features_of("own", block)})
        return name

    def clustering_analysis(seed: int, block: dict, source: str) -> str:
        tag = "_".join(f"{k}{block[k]}" for k in clustering_keys + ("preset",) if k in block) or "default"
        name = f"k_{tag}{'' if source == 'own' else '_' + source}_s{seed}"
        # An explicit null (capacity_factor: no cap) over a preset stays: _expand drops it, the preset refills it.
        nulls = {k: v for k, v in block.items() if v is None} if "preset" in block else {}
        expanded = {**_expand(block), **nulls, "seed": seed}
        analyses.setdefault(name, {"path": str(root / name), "cluster_sampling": expanded,
                                   "features": features_of(source, expanded)})
        # Arms of one K share its clustering; the first arm's selection need not be the one that reads features.
        if SELECTIONS.get_rule(expanded.get("selection", "random")).reads_features:
            analyses[name]["keep_features"] = True
        return name

    def subset(kind: str, seed: int, fraction: float, steps: bool = False, **changes: Any) -> dict:
        tag = f"{kind}{'_steps' if steps else ''}_f{fraction:g}" + "".join(f"_{k}-{v}" for k, v in changes.items())
        extra: dict[str, Any] = {"match": {"analysis": paper_analysis(seed), "fraction": fraction}}
        if steps:
            extra["stretch"] = True  # trained to full data's step count
        if kind == "paper":
            # A change of K or of the capacity clusters anew; the arm then keeps `fraction` of its own clusters.
            clustering = {k: v for k, v in changes.items() if k in clustering_keys}
            if clustering:
                extra["match"]["analysis"] = clustering_analysis(seed, {"preset": "paper", **clustering}, "own")
            return _arm(tag, seed, extra["match"]["analysis"], {"preset": "paper", **changes}, fraction, kind, **extra)
        if kind == "random":
            return _arm(tag, seed, "one_cluster", {**whole, **changes}, fraction, kind, **extra)
        if kind == "oracle":
            return _arm(tag, seed, "families", {**whole, "budget_mode": "equal", **changes}, fraction, kind, **extra)
        if kind == "full_cut":
            return _arm(tag, seed, "one_cluster", whole, fraction, kind, cut=True, **extra)
        if kind == "neardup":
            name = f"neardup_f{fraction:g}_s{seed}"
            analyses.setdefault(name, {"path": str(root / name), "near_duplicates": str(root / "near_duplicates"),
                                       "seed": seed})
            return _arm(tag, seed, name, {**whole, **changes}, fraction, kind, **extra)
        source = next((s for s in ("smollm2", "small") if kind.endswith(f"_{s}")), "own")
        base_kind = kind[:-len(source) - 1] if source != "own" else kind
        block = {**(settings.candidates.get(base_kind) or settings.recommended), **changes}
        if base_kind == "adaptive":
            block = {**settings.recommended, **settings.adaptive, **changes}
        if source == "smollm2":
            # SmolLM2's proxy features, the candidate measured (its lm_head extraction was not: 49k-word vocabulary).
            block.update(feature_kind="proxy", feature_model=feature_sources["smollm2"]["model"],
                         feature_max_length=feature_sources["smollm2"]["feature_max_length"])
        elif source == "small":
            block.update(feature_model=feature_sources["small"]["model"],
                         feature_max_length=feature_sources["small"]["feature_max_length"])
        if block.get("schedule") == "adaptive":
            # At the subsets' step count: the fraction sets the budget, the matched count the steps.
            block["budget_ratio"] = fraction
            extra["cut"] = True
        return _arm(tag, seed, clustering_analysis(seed, block, source), block, fraction, kind, **extra)

    def auto(seed: int, name: str = "auto", block: Optional[dict] = None) -> dict:
        """The adaptive schedule with budget_ratio "auto": up to full data's step count, or until every cluster
        has stopped improving."""
        block = {**settings.recommended, **(block or settings.auto)}
        return _arm(name, seed, clustering_analysis(seed, block, "own"), block, None, "auto")

    def full(seed: int) -> dict:
        return _arm("full", seed, "one_cluster", whole, None, "full", epochs=settings.epochs)

    def real_ablations() -> list[dict]:
        """The real instrument's ablation rows at the headline fraction on every seed, each with the random
        subset of its kept count and seed: random_fF when it keeps the paper arm's count, else a random arm
        matched to the same analysis (random_as_SETTING, named in the row's `baseline`)."""
        fraction = settings.headline_fraction
        # K != W needs allocation "stratified" (cluster_per_rank is one cluster per rank), so the paper preset
        # with "stratified" alone is the K rows' control. Capacity 3.0 is left out: at K = 2 a factor >= 2
        # never binds (ceil(3.0 x N / 2) >= N), so it would repeat capacity null sample for sample. On T0 even
        # 1.5 need not bind at K = 2; at K = 8 the proxy's largest cluster exceeds 1.5 N / 8, hence that α row.
        rows = (("paper", {"weighting": "none"}), ("paper", {"selection": "random"}), ("paper", {"selection": "core"}),
                ("paper", {"allocation": "stratified"}), ("paper", {"num_clusters": 4, "allocation": "stratified"}),
                ("paper", {"num_clusters": 8, "allocation": "stratified"}), ("paper", {"capacity_factor": None}),
                ("paper", {"num_clusters": 8, "allocation": "stratified", "capacity_factor": None}),
                ("recommended", {"loss_reduction": "sample"}))
        present = {arm["name"] for arm in arms}
        added: list[dict] = []

        def add(arm: dict) -> None:
            if arm["name"] not in present:
                present.add(arm["name"])
                added.append(arm)

        def partnered(arm: dict, match: dict) -> None:
            setting = f"random_as_{arm['setting']}"
            partner = subset("random", arm["seed"], fraction)
            partner.update(name=f"{setting}_s{arm['seed']}", setting=setting, fraction=arm["fraction"], match=match,
                           baseline=setting)
            add(dict(arm, baseline=setting))
            add(partner)

        for seed in settings.seeds:
            add(subset("paper", seed, fraction))  # the row every paper ablation changes one thing of
            add(subset("random", seed, fraction))
            for kind, changes in rows:
                arm = subset(kind, seed, fraction, **changes)
                if arm["match"]["analysis"] == paper_analysis(seed):
                    add(arm)  # keeps the paper arm's count: random_fF is its partner
                else:
                    partnered(arm, arm["match"])
            for ratio in settings.ablation_ratios:
                # r itself sets the count (floor(r x smallest cluster) each): no fraction, no match of its own.
                arm = subset("paper", seed, fraction, budget_ratio=ratio)
                setting = f"paper_budget_ratio-{ratio:g}"
                arm.update(name=f"{setting}_s{seed}", setting=setting, fraction=None)
                partnered(arm, {"analysis": arm.pop("match")["analysis"], "budget_ratio": ratio})
        return added

    first = settings.seeds[0]
    gate_random = subset("random", first, 0.3)
    arms += [full(first), gate_random]
    if settings.gate_only:
        return [dict(arm, epochs=settings.epochs) for arm in arms], analyses
    automatic = {name for name, block in settings.candidates.items() if block.get("budget_ratio") == "auto"}
    kinds = [k for k in settings.candidates if k not in automatic] if settings.candidates else \
        [k for k in settings.arms if k != "auto"]
    for seed in settings.seeds:
        # Choosing compares subsets only, unless an "auto" candidate needs full data's time beside it.
        if seed != first and (not settings.candidates or automatic):
            arms.append(full(seed))
        for fraction in settings.fractions:
            for kind in (["random"] + kinds if settings.candidates else kinds):
                arm = subset(kind, seed, fraction)
                if arm["name"] not in {a["name"] for a in arms}:
                    arms.append(arm)
        if "auto" in settings.arms and not settings.candidates:
            arms.append(auto(seed))
        for name in sorted(automatic):
            arms.append(auto(seed, name, settings.candidates[name]))
        if settings.equal_steps and not settings.candidates:
            for kind in EQUAL_STEPS_KINDS:
                arms.append(subset(kind, seed, settings.headline_fraction, steps=True))
    if settings.ablations and not settings.candidates and settings.instrument == "synthetic":
        for seed in settings.seeds[:settings.ablation_seeds]:
            # What each difference from the paper is worth.
            for kind, changes in (("paper", {"weighting": "none"}), ("paper", {"selection": "random"}),
                                  ("recommended", {"loss_reduction": "sample"})):
                arms.append(subset(kind, seed, settings.headline_fraction, **changes))
    elif settings.ablations and not settings.candidates:
        arms += real_ablations()
    for arm in arms:
        arm.setdefault("epochs", settings.epochs)
        if arm["analysis"] not in analyses:
            raise AssertionError(arm)
    return arms, analyses


def _expand(block: dict) -> dict:
    """The block with its preset filled in (the analysis depends on the resolved feature and K settings)."""
    from ds_cluster.config import ClusterSamplingConfig

    expanded = ClusterSamplingConfig.from_dict({**block, "enabled": True}).model_dump(exclude_none=True)
    return {k: v for k, v in expanded.items() if k not in ("enabled", "analysis_path")}


# --------------------------------------------------------------------------- the job
def instrument_record(settings: Settings) -> dict[str, Any]:
    """What a finished arm's numbers depend on besides the arm itself: a rerun into the same work folder
    must match it, or it would resume on arms measured with another instrument."""
    train = data_file(settings.data, "train")
    return {"instrument": settings.instrument, "data": str(Path(settings.data).resolve()),
            "train_bytes": train.stat().st_size, "base_model": str(default_base_model(settings)),
            "epochs": settings.epochs, "learning_rate": settings.learning_rate, "adam_eps": settings.adam_eps,
            "warmup_fraction": settings.warmup_fraction, "max_length": settings.max_length,
            "micro_batch_size": settings.micro_batch_size, "zero_stage": settings.zero_stage,
            "heldout_per_family": settings.heldout_per_family,
            "smollm2_feature_max_length": settings.smollm2_feature_max_length,
            "train_fraction": settings.train_fraction, "precision": settings.precision,
            "gradient_accumulation_steps": settings.gradient_accumulation_steps,
            # Only when not the default, so folders written before the setting existed still match.
            **({"prompt": settings.prompt} if settings.prompt != "alpaca" else {})}


def check_work_dir(settings: Settings) -> None:
    """Refuse a work folder whose finished arms were measured with another instrument or recipe."""
    path = settings.work_dir / "instrument.json"
    record = instrument_record(settings)
    if path.exists():
        previous = json.loads(path.read_text())
        differ = sorted(key for key in set(record) | set(previous) if record.get(key) != previous.get(key))
        if differ:
            raise SystemExit(f"{settings.work_dir} holds arms measured with other settings ({', '.join(differ)}): "
                             "pass another --work-dir or --name, or delete that folder")
    path.write_text(json.dumps(record, indent=1))


def write_spec(settings: Settings, data: dict, arms: list[dict], analyses: dict) -> Path:
    config = json.loads((REPO / "ds_configs" / f"zero{settings.zero_stage}.json").read_text())
    config.update(train_micro_batch_size_per_gpu=settings.micro_batch_size,
                  gradient_accumulation_steps=settings.gradient_accumulation_steps, steps_per_print=10 ** 9)
    if settings.precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif settings.precision == "autocast":
        config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    config.pop("train_batch_size", None)
    config["optimizer"]["params"].update(betas=[0.9, 0.95], weight_decay=0.0, eps=settings.adam_eps)
    small = sorted(data["sizes"], key=lambda f: data["sizes"][f])[:len(data["sizes"]) // 2]
    spec = {
        "instrument": settings.instrument,
        "work_dir": str(settings.work_dir), "base_model": str(default_base_model(settings)),
        **{name: str(path) for name, path in data["paths"].items()},
        "num_train": data["num_train"], "exact_match_families": data["exact_match_families"],
        "ds_config": config, "learning_rate": settings.learning_rate, "warmup_fraction": settings.warmup_fraction,
        "max_length": settings.max_length, "precision": settings.precision,
        "copy_probe_records": settings.copy_probe_records, "copy_probe_seed": 12345,
        "evaluate_splits": ["validation"] if settings.candidates else ["validation", "heldout"],
        "analyses": analyses, "arms": arms, "launched_at": time.time(), "skipped": list(settings.skipped),
        "gate": {"kind": settings.instrument, "full": arms[0]["name"], "random": arms[1]["name"],
                 "small_families": small},
        "gate_after": arms[1]["name"],
    }
    path = settings.work_dir / "spec.json"
    path.write_text(json.dumps(spec, indent=1, default=str))
    return path


def run_job(settings: Settings, spec_path: Path) -> int:
    """The one 2-rank deepspeed launch; its output goes to the console and WORK/job.log."""
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
    parser.add_argument("--data", type=Path, default=None,
                        help="folder with train.jsonl[.gz] and heldout.jsonl[.gz] (default: the T0 slice, or the "
                             "toy mixture with --synthetic)")
    parser.add_argument("--synthetic", action="store_true",
                        help="the synthetic instrument: toy tasks, the toy base model, its recipe and gate "
                             "(a check of the machinery)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: one seed, one fraction, fewer arms")
    parser.add_argument("--model", choices=("stories260k", "smollm2"), default="stories260k",
                        help="the trained model: stories260K (260K parameters, the default instrument) or "
                             "SmolLM2-135M-Instruct (a capable pretrained model, bf16; `python -m bench.real.smollm2` "
                             "writes its folder)")
    parser.add_argument("--choose", action="store_true",
                        help="run the recommended preset's candidates (bench/candidates.json) on validation only")
    parser.add_argument("--choose-adaptive", action="store_true",
                        help="run the adaptive schedule's candidates (bench/candidates.json, its \"adaptive\" list) "
                             "on validation only")
    parser.add_argument("--choose-auto", action="store_true",
                        help="choose the automatic budget (budget_ratio auto) among bench/candidates.json's \"auto\" "
                             "list, T0 validation only, beside full data and the random subset")
    parser.add_argument("--choose-auto-overhead", action="store_true",
                        help="choose the automatic budget's stopping signal among bench/candidates.json's "
                             "\"auto_overhead\" list: the fastest of those under 1%% of the loop and within the "
                             "noise of full data's loss, T0 validation only, beside full data and the random subset")
    parser.add_argument("--choose-overhead", action="store_true",
                        help="choose the adaptive schedule's window and probe size among bench/candidates.json's "
                             "\"adaptive_overhead\" list: the lowest macro validation loss among those whose loader "
                             "share of the training loop is under 1%%, T0 validation only")
    parser.add_argument("--seeds", type=int, default=len(Settings.seeds), help="paired seeds (default 4)")
    parser.add_argument("--work-dir", type=Path, default=None, help="default runs/bench_[real_]NAME")
    parser.add_argument("--results-dir", type=Path, default=None,
                        help="default bench/results/real (bench/results with --synthetic)")
    parser.add_argument("--name", default="quality", help="results file name: RESULTS_DIR/NAME.{json,md,png}")
    parser.add_argument("--report-only", action="store_true", help="no training: rebuild the report")
    parser.add_argument("--recipe", default="", metavar="K=V,...",
                        help="override the fine-tune recipe, e.g. learning_rate=2e-3,epochs=4,max_length=192 "
                             "(for choosing it on validation with --gate-only; never on held-out)")
    parser.add_argument("--base-model", type=Path, default=None,
                        help="a Hugging Face checkpoint folder to fine-tune (default: stories260K, or the toy "
                             "base model with --synthetic)")
    parser.add_argument("--gate-only", action="store_true",
                        help="only the calibration gate's arms (for choosing the recipe: bench/README.md)")
    parser.add_argument("--arms", default=None, metavar="A,B,...",
                        help=f"the subset arms to run beside full data (known: {','.join(KNOWN_ARMS)}); "
                             "a confirmation run may leave out arms its claim does not use")
    parser.add_argument("--ablations", action="store_true",
                        help="add the ablation rows (default with --synthetic); on the real instrument the paper "
                             "preset without weights, with random and core selection, K 4 and 8, no capacity cap, "
                             "and recommended with sample loss, at the headline fraction on every seed, each beside "
                             "a random subset of its kept count (run it as its own --name, e.g. quality_ablations)")
    parser.add_argument("--no-ablations", action="store_true", help="leave out the ablation rows")
    parser.add_argument("--fractions", default=None, metavar="F,...",
                        help="the kept fractions of the subset arms (default 0.3,0.5); the adaptive schedule's "
                             "claim is at 0.3 (the 30%% arms' step count)")
    parser.add_argument("--equal-steps", action="store_true",
                        help="add random and recommended at 30%% kept trained to full data's step count (each "
                             "costs a full-data run)")
    parser.add_argument("--test-epochs", type=int, default=None, help=argparse.SUPPRESS)  # tests only: tiny runs
    return parser.parse_args(argv)


def settings_from_args(args: argparse.Namespace, argv: Optional[list[str]] = None) -> Settings:
    # Each mode has its own name, so a smoke or choosing run never reuses or overwrites the default's arms.
    choosing = next((flag for flag in CHOICE_LISTS if getattr(args, flag)), None)
    name = args.name if args.name != "quality" else (
        f"quality_{choosing}" if choosing
        else "quality_quick" if args.quick else "quality_gate" if args.gate_only else "quality")
    given = argv if argv is not None else sys.argv[1:]
    # A rebuilt report names the run that measured it (the flag only re-reads its arms).
    command = " ".join(["python bench/quality.py"] + [a for a in given if a != "--report-only"])
    if "--report-only" in given:
        command += "; report rebuilt with --report-only"
    settings = Settings(command=command, results_name=name, seeds=tuple(range(args.seeds)))
    if args.synthetic:
        settings = replace(settings, **SYNTHETIC_RECIPE)
    prefix = "bench_" if args.synthetic else "bench_smollm2_" if args.model == "smollm2" else "bench_real_"
    if args.model == "smollm2":
        if args.synthetic:
            raise SystemExit("--model smollm2 is a real instrument: leave out --synthetic")
        name = name.replace("quality", "quality_smollm2", 1) if args.name == "quality" else name
        settings = replace(settings, **SMOLLM2_RECIPE, results_name=name)
    settings = replace(settings, data=args.data or settings.data, base_model=args.base_model or settings.base_model,
                       results_dir=args.results_dir or settings.results_dir,
                       work_dir=args.work_dir or REPO / "runs" / f"{prefix}{name}")
    if args.quick and args.model == "smollm2":
        settings = replace(settings, seeds=(0,), fractions=(0.3,), arms=("random", "recommended_small"),
                           ablations=False, heldout_per_family=40,
                           skipped=("full_cut, recommended on SmolLM2's own features, adaptive and auto left out of the "
                                    "quick run (its 15 minutes); 40 held-out records per family",))
    elif args.quick:
        quick_arms = ("random", "paper", "recommended") if args.synthetic else ("random", "recommended", "neardup")
        settings = replace(settings, seeds=(0,), fractions=(0.3,), arms=quick_arms, ablations=False,
                           heldout_per_family=40, copy_probe_records=60)
        if not args.synthetic:
            settings = replace(settings, skipped=(
                "recommended_smollm2, paper, oracle and full_cut left out of the quick run (a smoke run: SmolLM2's "
                "feature extraction alone takes longer than its 10 minutes)",))
    if args.arms is not None:
        arms = tuple(arm for arm in args.arms.split(",") if arm)
        unknown = sorted(set(arms) - set(KNOWN_ARMS))
        if unknown or not arms:
            raise SystemExit(f"--arms: unknown {unknown or 'empty list'}; choose from {','.join(KNOWN_ARMS)}")
        # A note on an arm left out goes when the arm is asked for.
        settings = replace(settings, arms=arms, skipped=tuple(
            note for note in settings.skipped if not any(note.startswith(f"{arm} ") for arm in arms)))
    if args.fractions is not None:
        fractions = tuple(float(value) for value in args.fractions.split(",") if value)
        if not fractions or not all(0 < value < 1 for value in fractions):
            raise SystemExit(f"--fractions: expected kept fractions in (0, 1), got {args.fractions!r}")
        settings = replace(settings, fractions=fractions, headline_fraction=fractions[0])
    if args.ablations:
        settings = replace(settings, ablations=True)
    if args.no_ablations:
        settings = replace(settings, ablations=False)
    if args.equal_steps:
        settings = replace(settings, equal_steps=True)
    if args.recipe:
        pairs = dict(item.split("=", 1) for item in args.recipe.split(","))
        settings = replace(settings, **{key: type(getattr(settings, key))(value) for key, value in pairs.items()})
    if args.gate_only:
        settings = replace(settings, seeds=settings.seeds[:1], gate_only=True, ablations=False)
    if args.test_epochs is not None:
        settings = replace(settings, epochs=args.test_epochs, fractions=(0.3,), ablations=False,
                           arms=("random", "paper"), copy_probe_records=8, features_cache=None)
    if choosing:
        declared = json.loads((REPO / "bench" / "candidates.json").read_text())[
            CHOICE_LISTS[choosing] or settings.instrument]
        candidates = {name: block for name, block in declared.items() if not name.startswith("_")}  # "_rule"
        if settings.instrument == "synthetic":
            # Declared and measured when proxy was the default feature kind; they keep it, so they reproduce.
            candidates = {name: {"feature_kind": "proxy", **block} for name, block in candidates.items()}
        settings = replace(settings, candidates=candidates, fractions=(settings.headline_fraction,),
                           ablations=False,
                           overhead_limit=OVERHEAD_LIMIT if choosing.endswith("_overhead") else None)
    return with_feature_models(settings)


def with_feature_models(settings: Settings) -> Settings:
    """Drop the SmolLM2 feature arms, saying why, when its checkpoint is not there (or not asked for)."""
    kinds = settings.candidates or settings.arms
    wanted = [kind for kind in kinds if kind.endswith("_smollm2")]
    if not wanted:
        return replace(settings, smollm2=None)
    if settings.smollm2 is not None and (Path(settings.smollm2) / "config.json").is_file():
        return settings
    reason = (f"{', '.join(wanted)} skipped: no SmolLM2 checkpoint at {settings.smollm2 or SMOLLM2_DIR} "
              "(write it with `python -m bench.real.smollm2 --out .cache/smollm2-135m-instruct`)")
    logger.warning(reason)
    return replace(settings, arms=tuple(a for a in settings.arms if a not in wanted), smollm2=None,
                   candidates={k: v for k, v in settings.candidates.items() if k not in wanted},
                   skipped=settings.skipped + (reason,))


def main(argv: Optional[list[str]] = None) -> int:
    from bench.quality_report import write_report

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    settings = settings_from_args(args, argv)
    settings.work_dir.mkdir(parents=True, exist_ok=True)
    check_work_dir(settings)
    started = time.time()
    data = prepare_data(settings)
    arms, analyses = build_arms(settings, data)
    spec_path = write_spec(settings, data, arms, analyses)
    logger.info("%s instrument: %s on %s; %d arms in one job; work folder %s", settings.instrument,
                default_base_model(settings), settings.data, len(arms), settings.work_dir)
    logger.info("exact match on the label families: %s", ", ".join(data["exact_match_families"]) or "none")
    if not args.report_only:
        code = run_job(settings, spec_path)
        if code != 0:
            logger.error("the benchmark job exited %d; see %s", code, settings.work_dir / "job.log")
            return code
    report = write_report(settings, data, arms, validation_only=bool(settings.candidates))
    logger.info("%s (%.1f min)", report["markdown_path"], (time.time() - started) / 60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
