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
    python bench/quality.py --model smollm2 --validation-only --seeds 4 --recipe micro_batch_size=4,...
                                                  # a power pilot of a SmolLM2 recipe (bench/candidates.json's
                                                  # "smollm2_power"; `python -m bench.harness.power` reads it)
    python bench/quality.py --report-only         # rebuild the report from finished arms
    python bench/quality.py --base-model DIR      # another base model (a Hugging Face checkpoint folder)
    python bench/quality.py --arms random,recommended --no-ablations   # only these arms beside full data
    python bench/quality.py --equal-steps         # add random and recommended at 30% trained to full data's steps
    python bench/quality.py --target each         # the targeted instrument: every task group alone as a target,
                                                  # the declared pairs and transfer target, K examples each drawn
                                                  # from validation; bench/candidates.json's "targeted" design
    python bench/quality.py --data DIR --target sentiment,topic_classification --validation-only
                                                  # on any mixture whose records carry task groups (family or
                                                  # category); these groups' targets only

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
- recommended_small: the same preset on stories260K's features (`feature_model`; the SmolLM2 instrument's cheap
  source);
- recommended_lora: the same preset on the `lora` features (per-sample gradients of seeded, untrained LoRA adapters
  on the trained model, projected); `--recipe peft=lora[,lora_rank=R]` trains LoRA adapters in every arm instead
  of every weight;
- oracle: family-balanced (labels = family, even budget, random within a family), same kept size;
- neardup: near-duplicate removal to the same kept size (bench/near_duplicates.py has the rule);
- KIND_steps (with --equal-steps): the subset trained for more epochs, to full data's step count.

A seed changes the data order, the random subset and the k-means seed together, the same for every arm.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.harness.builders import build_arms  # noqa: E402
from bench.harness.data import prepare_data  # noqa: E402
from bench.harness.instrument import (CHOICE_LISTS, KNOWN_ARMS, OVERHEAD_CHOICES, OVERHEAD_LIMIT,  # noqa: E402
                                      SMOLLM2_QUICK_RECIPE, SMOLLM2_RECIPE, SYNTHETIC_RECIPE, Settings,
                                      check_work_dir, default_base_model, with_feature_models)
from bench.harness.launch import run_job, write_spec  # noqa: E402
from bench.harness.report import write_report  # noqa: E402

logger = logging.getLogger("bench.quality")


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
    parser.add_argument("--choose-auto-signal", action="store_true",
                        help="choose the automatic budget's stopping signal (relative, a fitted learning curve, an "
                             "absolute floor) among bench/candidates.json's \"auto_signal\" list by the auto_overhead "
                             "rule, T0 validation only, beside full data and the random subset")
    parser.add_argument("--choose-overhead", action="store_true",
                        help="choose the adaptive schedule's window and probe size among bench/candidates.json's "
                             "\"adaptive_overhead\" list: the lowest macro validation loss among those whose loader "
                             "share of the training loop is under 1%%, T0 validation only")
    parser.add_argument("--choose-hidden", action="store_true",
                        help="the recommended preset on the `hidden` features beside its lm_head features and a random "
                             "subset, T0 validation only (bench/candidates.json's \"hidden_features\" list)")
    parser.add_argument("--seeds", type=int, default=None,
                        help="paired seeds (default 4; the SmolLM2 instrument's own recipe otherwise)")
    parser.add_argument("--full-seeds", type=int, default=None, metavar="N",
                        help="full data on the first N seeds only (default every seed; the subsets' arms are cheap, "
                             "full data is not): its paired rows are over those seeds, and the report says so")
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
    parser.add_argument("--validation-only", action="store_true",
                        help="evaluate and report the validation split only: a pilot that chooses a recipe (bench/"
                             "candidates.json's \"smollm2_power\"), so held-out is never seen while choosing")
    parser.add_argument("--no-ablations", action="store_true", help="leave out the ablation rows")
    parser.add_argument("--fractions", default=None, metavar="F,...",
                        help="the kept fractions of the subset arms (default 0.3,0.5); the adaptive schedule's "
                             "claim is at 0.3 (the 30%% arms' step count)")
    parser.add_argument("--equal-steps", action="store_true",
                        help="add random and recommended at 30%% kept trained to full data's step count (each "
                             "costs a full-data run)")
    parser.add_argument("--target", default=None, metavar="each|G1,G2,...",
                        help="the targeted instrument: each task group alone as a target, and the declared two-group "
                             "and transfer targets (or only these groups alone), with bench/candidates.json's declared "
                             "\"targeted\" design (K, budget, steps, candidates); docs/targeted.md")
    parser.add_argument("--target-candidates", default="", metavar="CANDIDATE,...",
                        help="with --target: only these of the declared candidates (a confirmation runs the chosen "
                             "one)")
    parser.add_argument("--target-k8", default="", metavar="CANDIDATE,...",
                        help="with --target: these candidates also run with the first 8 examples of each group of the "
                             "same draws (the K = 8 grid row, when the selection diagnostics show K = 8 selects "
                             "otherwise)")
    parser.add_argument("--test-epochs", type=int, default=None, help=argparse.SUPPRESS)  # tests only: tiny runs
    return parser.parse_args(argv)


def settings_from_args(args: argparse.Namespace, argv: Optional[list[str]] = None) -> Settings:
    """The run's settings: its instrument and recipe, then each flag's change, in this order."""
    choosing = next((flag for flag in CHOICE_LISTS if getattr(args, flag)), None)
    if args.target and args.name == "quality":
        args.name = "quality_targeted"  # its own work folder and results, never the default run's
    settings = _instrument(args, argv, choosing)
    if args.quick:
        settings = _quick(settings, args)
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
    if args.validation_only:
        settings = replace(settings, validation_only=True)
    if args.full_seeds is not None:
        if not 1 <= args.full_seeds <= len(settings.seeds):
            raise SystemExit(f"--full-seeds: between 1 and the {len(settings.seeds)} seeds, got {args.full_seeds}")
        settings = replace(settings, full_seeds=args.full_seeds)
    if args.recipe:
        pairs = dict(item.split("=", 1) for item in args.recipe.split(","))
        settings = replace(settings, **{key: type(getattr(settings, key))(value) for key, value in pairs.items()})
    if settings.peft not in ("none", "lora"):
        raise SystemExit(f"--recipe peft={settings.peft}: expected none or lora")
    if args.gate_only:
        settings = replace(settings, seeds=settings.seeds[:1], gate_only=True, ablations=False)
    if args.test_epochs is not None:
        settings = replace(settings, epochs=args.test_epochs, fractions=(0.3,), ablations=False,
                           arms=("random", "paper"), copy_probe_records=8, features_cache=None)
    if choosing:
        settings = _choosing(settings, choosing)
    if args.target:
        settings = _targeted(settings, args.target, smollm2=args.model == "smollm2")
        declared = settings.targeted.candidates  # type: ignore[union-attr]
        small = tuple(name for name in args.target_k8.split(",") if name)
        only = tuple(name for name in args.target_candidates.split(",") if name) or tuple(declared)
        unknown = sorted((set(small) | set(only)) - set(declared))
        if unknown:
            raise SystemExit(f"--target-k8/--target-candidates: {unknown} are not declared targeted candidates")
        settings = replace(settings, targeted=replace(settings.targeted, small_k=small,
                                                      candidates={name: declared[name] for name in only}))
    return with_feature_models(settings)


def _targeted(settings: Settings, spec: str, smollm2: bool = False) -> Settings:
    """The targeted instrument: the declared design and candidates of bench/candidates.json's "targeted" list
    (with `smollm2`, its "_smollm2" part too: the whole mixture, and the LoRA and small-feature-model candidates)."""
    from bench.harness.targeted import TargetedSettings
    from bench.harness.targets import TARGETED_VALIDATION_FRACTION

    declared = json.loads((REPO / "bench" / "candidates.json").read_text())["targeted"]
    designs = declared["_design"]
    design = dict(designs.get(Path(settings.data).name, designs["default"]))  # pairs and transfer name its groups
    candidates = {name: block for name, block in declared.items() if not name.startswith("_")}
    if smollm2:
        if spec == "each":
            targets = declared["_smollm2"]["targets"].get(Path(settings.data).name)
            raise SystemExit("--model smollm2 --target: name the targets chosen on validation "
                             f"(bench/candidates.json's targeted._smollm2: {targets or 'none declared for this data'})")
        candidates.update(declared["_smollm2"]["candidates"])
        settings = replace(settings, **declared["_smollm2"]["design"])
    # "each": every group alone, the declared pairs and transfer targets; a list: those groups alone, nothing else.
    only = () if spec == "each" else tuple(group for group in spec.split(",") if group)
    targeted = TargetedSettings(per_group=design["per_group"], budget_fraction=design["budget_fraction"],
                                epochs=design["epochs"],
                                pairs=tuple(tuple(p) for p in design.get("pairs", ())) if not only else (),
                                transfer=tuple(design.get("transfer", ())) if not only else (), only=only,
                                candidates=candidates)
    return replace(settings, targeted=targeted, validation_fraction=TARGETED_VALIDATION_FRACTION, features_cache=None,
                   arms=(), skipped=(), max_length=design.get("max_length", settings.max_length))


def _instrument(args: argparse.Namespace, argv: Optional[list[str]], choosing: Optional[str]) -> Settings:
    """The instrument's recipe (real, synthetic or SmolLM2), named after the run's mode, with its folders."""
    # Each mode has its own name, so a smoke or choosing run never reuses or overwrites the default's arms.
    name = args.name if args.name != "quality" else (
        f"quality_{choosing}" if choosing
        else "quality_quick" if args.quick else "quality_gate" if args.gate_only else "quality")
    given = argv if argv is not None else sys.argv[1:]
    # A rebuilt report names the run that measured it (the flag only re-reads its arms).
    command = " ".join(["python bench/quality.py"] + [a for a in given if a != "--report-only"])
    if "--report-only" in given:
        command += "; report rebuilt with --report-only"
    settings = Settings(command=command, results_name=name)
    if args.synthetic:
        settings = replace(settings, **SYNTHETIC_RECIPE)
    prefix = "bench_" if args.synthetic else "bench_smollm2_" if args.model == "smollm2" else "bench_real_"
    if args.model == "smollm2":
        if args.synthetic:
            raise SystemExit("--model smollm2 is a real instrument: leave out --synthetic")
        name = name.replace("quality", "quality_smollm2", 1) if args.name == "quality" else name
        settings = replace(settings, **SMOLLM2_RECIPE, results_name=name)
    if args.seeds is not None:  # after the recipe: a pilot's or a grid's own seed count wins over the recipe's
        settings = replace(settings, seeds=tuple(range(args.seeds)))
    return replace(settings, data=args.data or settings.data, base_model=args.base_model or settings.base_model,
                   results_dir=args.results_dir or settings.results_dir,
                   work_dir=args.work_dir or REPO / "runs" / f"{prefix}{name}")


def _quick(settings: Settings, args: argparse.Namespace) -> Settings:
    """The smoke run: one seed, one fraction, fewer arms and held-out records."""
    if args.model == "smollm2":
        return replace(settings, seeds=(0,), fractions=(0.3,), arms=("random", "recommended_small"),
                       ablations=False, heldout_per_family=40, **SMOLLM2_QUICK_RECIPE,
                       skipped=("full_cut, recommended on SmolLM2's own features, adaptive and auto left out of the "
                                "quick run (its 15 minutes); 40 held-out records per family",))
    quick_arms = ("random", "paper", "recommended") if args.synthetic else ("random", "recommended", "neardup")
    settings = replace(settings, seeds=(0,), fractions=(0.3,), arms=quick_arms, ablations=False,
                       heldout_per_family=40, copy_probe_records=60)
    if not args.synthetic:
        settings = replace(settings, skipped=(
            "recommended_smollm2, paper, oracle and full_cut left out of the quick run (a smoke run: SmolLM2's "
            "feature extraction alone takes longer than its 10 minutes)",))
    return settings


def _choosing(settings: Settings, choosing: str) -> Settings:
    """A choosing run: the flag's declared candidates, at the headline fraction, validation only."""
    declared = json.loads((REPO / "bench" / "candidates.json").read_text())[
        CHOICE_LISTS[choosing] or settings.instrument]
    candidates = {name: block for name, block in declared.items() if not name.startswith("_")}  # "_rule"
    if settings.instrument == "synthetic":
        # Declared and measured when proxy was the default feature kind; they keep it, so they reproduce.
        candidates = {name: {"feature_kind": "proxy", **block} for name, block in candidates.items()}
    return replace(settings, candidates=candidates, fractions=(settings.headline_fraction,), ablations=False,
                   overhead_limit=OVERHEAD_LIMIT if choosing in OVERHEAD_CHOICES else None)


def main(argv: Optional[list[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    settings = settings_from_args(args, argv)
    settings.work_dir.mkdir(parents=True, exist_ok=True)
    check_work_dir(settings)
    started = time.time()
    data = prepare_data(settings)
    if settings.targeted is not None:
        from bench.harness.targeted import build_targeted_arms

        arms, analyses, _ = build_targeted_arms(settings, data)
    else:
        arms, analyses = build_arms(settings, data)
    spec_path = write_spec(settings, data, arms, analyses)
    logger.info("%s instrument: %s on %s; %d arms in one job; work folder %s", settings.instrument,
                default_base_model(settings), settings.data, len(arms), settings.work_dir)
    logger.info("exact match on the label families: %s", ", ".join(data.exact_match_families) or "none")
    if not args.report_only:
        code = run_job(settings, spec_path)
        if code != 0:
            logger.error("the benchmark job exited %d; see %s", code, settings.work_dir / "job.log")
            return code
    if settings.targeted is not None:
        from bench.harness.targeted_report import write_targeted_report

        report = write_targeted_report(settings, arms, validation_only=settings.validation_only)
    else:
        report = write_report(settings, data, arms,
                              validation_only=bool(settings.candidates) or settings.validation_only)
    logger.info("%s (%.1f min)", report["markdown_path"], (time.time() - started) / 60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
