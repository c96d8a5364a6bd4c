"""The instrument: what every arm of a quality run shares (`Settings`), the recipes and adaptive presets it runs, the
lists the choosing flags run, and where the base model, the data files and the job's environment come from."""
from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

from bench.toy.models import default_cache_root

REPO = Path(__file__).resolve().parents[2]
logger = logging.getLogger("bench.quality")

WORLD_SIZE = 2
SMOLLM2_DIR = REPO / ".cache" / "smollm2-135m-instruct"
# SmolLM2 tokens per sample for its features: about 90% of the T0 records fit whole (1.35 tokens per
# word on their word counts); extraction keeps the full width, so its cost is proportional to this.
SMOLLM2_FEATURE_MAX_LENGTH = 96

REAL_ARMS = ("full_cut", "random", "paper", "recommended", "oracle", "neardup", "recommended_smollm2")
SYNTHETIC_ARMS = ("full_cut", "random", "paper", "recommended", "oracle")
# adaptive: the adaptive schedule at the subsets' step count; auto: it with budget_ratio "auto", up to full data's
# steps; recommended_small: the recommended preset on a small feature model's features (stories260K under SmolLM2);
# recommended_lora: the recommended preset on the `lora` features (the trained model with seeded LoRA adapters).
KNOWN_ARMS = REAL_ARMS + ("adaptive", "auto", "recommended_small", "recommended_lora")
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
# instrument's own list); the results are named quality_<flag>.
CHOICE_LISTS: dict[str, Optional[str]] = {"choose_adaptive": "adaptive", "choose_auto": "auto",
                                          "choose_overhead": "adaptive_overhead",
                                          "choose_auto_overhead": "auto_overhead",
                                          "choose_auto_signal": "auto_signal", "choose": None}
# The choosing runs whose rule reads the loader's share of the loop against OVERHEAD_LIMIT.
OVERHEAD_CHOICES = ("choose_overhead", "choose_auto_overhead", "choose_auto_signal")


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
    # Full data (and the automatic budget, read against it) on the first N seeds only (None: every seed); the gate's
    # is always run.
    full_seeds: Optional[int] = None
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
    # "lora": every arm trains LoRA adapters of rank `lora_rank` (alpha 2 x rank, seeded by the arm's seed) on the
    # attention and MLP projections of the frozen base model (ds_cluster.data.models.with_lora); "none": every weight.
    peft: str = "none"
    lora_rank: int = 8
    time_goal: float = 0.40  # the preset's total time at the headline fraction, over full data's
    auto_time_goal: float = 0.5  # the automatic budget's total time, over full data's
    candidates: dict = field(default_factory=dict)  # --choose: name -> cluster_sampling block
    # --choose-overhead: only candidates whose mean loader share of the training loop is below this may be chosen
    overhead_limit: Optional[float] = None
    ablations: bool = False
    equal_steps: bool = False
    gate_only: bool = False
    validation_only: bool = False  # evaluate and report validation only (a pilot that chooses; never held-out)
    heldout_per_family: Optional[int] = None
    copy_probe_records: int = 200
    smollm2: Optional[Path] = SMOLLM2_DIR
    smollm2_feature_max_length: int = SMOLLM2_FEATURE_MAX_LENGTH
    # Feature extractions shared by the runs on one mixture (features_folder); None: each work folder its own.
    features_cache: Optional[Path] = field(default_factory=lambda: default_cache_root() / "bench_features")
    skipped: tuple[str, ...] = ()  # arms left out, with the reason (the report repeats it)
    # The targeted instrument (`--target`, bench/harness/targeted.py): its declared design, None otherwise.
    targeted: Optional[Any] = None
    validation_fraction: Optional[float] = None  # of every family (None: data.VALIDATION_FRACTION)
    job_timeout_s: float = 4 * 3600
    command: str = "python bench/quality.py"


# The capable-model instrument (`--model smollm2`): SmolLM2-135M-Instruct fine-tuned in bf16 on a slice of the
# T0 mixture. Its recipe is the power candidate "b8_slice10_e3_lr3e-5" of bench/candidates.json's "smollm2_power"
# (issue 42; bench/README.md, "Power"): 10% of every family's train records, global batch 8 (2 ranks x micro
# batch 4) so a 30% arm trains 93 optimizer steps, 3 epochs, lr 3e-5 (lr 1e-4 overfit at this size), every shipped
# held-out record (150 per family). The declared rule keeps it as the last candidate run (the only one through the
# gate); its seeds are the most a ~3-hour grid holds here (a 30% arm takes about 9 min with its held-out
# evaluation, full data and the automatic budget about 23 each): the 30% arms on 3 seeds, full data and the
# automatic budget on the first (4 seeds would take about 3.75 h). The recipe before it (7% slice, global
# batch 32, 15-step arms, 3 seeds) could not tell any two arms apart (bench/results/real/quality_smollm2_b32_slice7.md).
SMOLLM2_RECIPE: dict[str, Any] = {
    "base_model": SMOLLM2_DIR, "train_fraction": 0.1, "heldout_per_family": None, "max_length": 136,
    "micro_batch_size": 4, "gradient_accumulation_steps": 1, "precision": "bf16", "zero_stage": 0,
    "learning_rate": 3e-5, "adam_eps": 1e-8, "epochs": 3, "seeds": (0, 1, 2), "full_seeds": 1,
    "fractions": (0.3,),
    "arms": ("full_cut", "random", "recommended", "recommended_small", "adaptive", "auto"), "smollm2": None,
    "time_goal": 0.33, "auto_time_goal": 0.6,
    # 93-step arms: the chosen window (20 steps, probe 2) closes four times, so the benchmark's own presets hold.
    "work_dir": REPO / "runs" / "bench_smollm2_quality"}
# `--model smollm2 --quick`, a smoke run of the machinery in ~15 min: the recipe before issue 42 (7% slice, global
# batch 32, lr 1e-4), which passes its gate with a 6-minute full-data run. The grid's recipe on a 3% slice (full
# data in 6 min) failed all three of the gate's checks (bench/results/real/quality_smollm2_quick_slice3.md), so a
# quick run on it would stop after the gate's arms.
SMOLLM2_QUICK_RECIPE: dict[str, Any] = {"train_fraction": 0.07, "micro_batch_size": 8, "gradient_accumulation_steps": 2,
                                        "learning_rate": 1e-4}
SYNTHETIC_RECIPE: dict[str, Any] = {
    "instrument": "synthetic", "data": REPO / "bench" / "toy" / "data" / "default",
    "results_dir": REPO / "bench" / "results", "epochs": 16, "learning_rate": 1e-3, "max_length": 96,
    "micro_batch_size": 8,
    "arms": SYNTHETIC_ARMS, "ablations": True, "smollm2": None,
    # The preset as chosen on this instrument (proxy features), so its published figures reproduce.
    "recommended": {"preset": "recommended", "feature_kind": "proxy"}}


def default_base_model(settings: Any) -> Path:
    """The checkpoint every arm fine-tunes: `settings.base_model`, else the instrument's own."""
    if settings.base_model is not None:
        return Path(settings.base_model)
    if settings.instrument == "synthetic":
        from bench.toy.models import base_model_path

        return Path(base_model_path())
    from bench.real import STORIES260K_DIR

    return STORIES260K_DIR


def data_file(folder: Path, name: str) -> Path:
    """FOLDER/NAME.jsonl, else FOLDER/NAME.jsonl.gz (read_jsonl reads either by its bytes)."""
    for candidate in (folder / f"{name}.jsonl", folder / f"{name}.jsonl.gz"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{folder}: neither {name}.jsonl nor {name}.jsonl.gz")


def job_env(extra: Optional[dict] = None) -> dict:
    """The environment of a benchmark job: one node on loopback, offline, this venv first on PATH.

    The accelerator is DeepSpeed's own choice (CUDA where a GPU is, else the CPU) unless DS_ACCELERATOR is set.
    """
    env = os.environ.copy()
    env.update(MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo", TORCH_EXTENSIONS_DIR=str(REPO / ".torch_extensions"),
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
               PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(var, None)
    env.update(extra or {})
    return env


def with_feature_models(settings: Settings) -> Settings:
    """Drop the SmolLM2 feature arms, saying why, when its checkpoint is not there (or not asked for)."""
    from bench.harness.arms import kind_and_source

    kinds = settings.candidates or settings.arms
    wanted = [kind for kind in kinds if kind_and_source(kind, settings.candidates)[1] == "smollm2"]
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
            **({"prompt": settings.prompt} if settings.prompt != "alpaca" else {}),
            **({"peft": settings.peft, "lora_rank": settings.lora_rank} if settings.peft != "none" else {})}


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
