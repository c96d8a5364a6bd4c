"""The targeted instrument (`python bench/quality.py --target ...`): given K examples of the task groups a user cares
about, does a targeted selection of the pool teach them better than a random subset of the same size, and than full
data trained for the same number of optimizer steps?

Every arm trains the same steps (`TargetedSettings.epochs` passes over the budget, the learning rate warmed up and
decayed to 0 within them). Per seed: the shared baselines (a random subset, full data cut to those steps, a random
subset balanced over the groups, and full data's own recipe on the first seed, the time reference); per target and
seed: the label oracle (the budget drawn from the target's groups), the lexical control (hashed n-grams), and every
declared targeted candidate (a feature kind and a selection rule of the library, given that seed's target file).
A transfer target's arms select from the pool without its groups, beside baselines of that pool. The choice among
the candidates is made on validation (the target group's records left after its examples were drawn); held-out is
read once, for the chosen one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from bench.harness.arms import Analysis, Arm, Method, arm_name
from bench.harness.builders import WHOLE, ArmBuilder
from bench.harness.data import PreparedData
from bench.harness.instrument import WORLD_SIZE, Settings
from bench.harness.targets import (TARGET_FIELD, Target, TargetDraw, draw_examples, leakage, lexical_subset,
                                   oracle_subset, pool_mask, targets_of, write_draw)
from ds_cluster.data.dataset import read_jsonl, task_group, write_jsonl
from ds_cluster.fileio import write_json_atomic

BALANCED = "balanced"  # a random subset balanced over the task groups
SMALL_K = 8  # the selection diagnostics' K (and the K = 8 grid row)
ORACLE = "label_oracle"
LEXICAL = "lexical"
PLAIN = {**WHOLE, "weighting": "none"}  # train on the records the analysis keeps, as they are


@dataclass(frozen=True)
class TargetedSettings:
    """The targeted instrument's declared design (bench/candidates.json "targeted", written before any run)."""

    per_group: int = 32  # K: target examples of each group per draw
    budget_fraction: float = 0.05  # of the pool: the literature's regime (LESS's 5%)
    epochs: int = 4  # passes over the budget: every arm's step count (LESS trains its 5% for 4 epochs)
    pairs: tuple = ()  # two-group targets
    transfer: tuple = ()  # groups removed from the pool, one transfer target each
    only: tuple = ()  # single-group targets to run (empty: every group)
    candidates: dict = field(default_factory=dict)  # name -> the targeted arm's block (a kind and a rule)
    # Candidates also run with the first SMALL_K examples of each group of the same draw (the K = 8 grid row).
    small_k: tuple = ()
    baselines: tuple = (Method.RANDOM, Method.FULL_CUT, BALANCED, ORACLE, LEXICAL)


def budget_and_steps(settings: Settings, num_pool: int) -> tuple[int, int]:
    """The budget (records) and every arm's optimizer steps."""
    targeted = settings.targeted
    assert targeted is not None
    budget = round(targeted.budget_fraction * num_pool)
    global_batch = settings.micro_batch_size * WORLD_SIZE * settings.gradient_accumulation_steps
    return budget, max(1, math.ceil(targeted.epochs * budget / global_batch))


def fitting(records: list[dict], settings: Settings) -> list[dict]:
    """The records whole within the trained model's max length (a target example may not be cut short): the ones a
    draw may take."""
    from bench.harness.instrument import default_base_model
    from ds_cluster.data.dataset import InstructionDataset
    from ds_cluster.data.models import load_tokenizer

    tokenizer = load_tokenizer(default_base_model(settings))
    lengths = InstructionDataset(records, tokenizer, max_length=4 * settings.max_length).attention_mask.sum(dim=1)
    return [record for record, length in zip(records, lengths.tolist()) if length <= settings.max_length]


def chosen_targets(settings: Settings, data: PreparedData) -> list[Target]:
    targeted = settings.targeted
    assert targeted is not None
    singles = [family for family in data.families if not targeted.only or family in targeted.only]
    return targets_of(singles, targeted.pairs, targeted.transfer)


class TargetedBuilder(ArmBuilder):
    """The targeted instrument's arms and analyses (`build_targeted_arms`)."""

    def __init__(self, settings: Settings, data: PreparedData) -> None:
        super().__init__(settings, data)
        self.pool = read_jsonl(data.paths["train"])
        self.validation = fitting(read_jsonl(data.paths["validation"]), settings)
        self.heldout = read_jsonl(data.paths["heldout"])
        self.budget, self.steps = budget_and_steps(settings, len(self.pool))
        self.draws: dict[tuple[str, int], TargetDraw] = {}

    def arm_of(self, name: str, method: str, seed: int, analysis: str, block: dict, target: Optional[str] = None,
               candidate: Optional[str] = None, steps: Optional[int] = None) -> Arm:
        return Arm(name=arm_name(name, seed), setting=name, method=method, seed=seed, analysis=analysis,
                   fraction=self.budget / len(self.pool), cluster_sampling={**block, "seed": seed},
                   epochs=self.settings.epochs if steps is None else 1, steps=steps or None, target=target,
                   candidate=candidate)

    # ---------------------------------------------------------------- analyses
    def pool_of(self, target: Target) -> str:
        """The labels analysis of the records a target's baselines train on: every record, or a transfer target's
        pool (its groups left out, label -1)."""
        if not target.transfer:
            return "one_cluster"
        name = f"one_cluster_without_{'_'.join(target.groups)}"
        labels = np.where(pool_mask(self.pool, target), 0, -1).astype(np.int64)
        self._labels(name, labels)
        return name

    def groups_of(self, target: Target) -> str:
        """The task-group labels of a target's pool (the balanced baseline's clusters)."""
        names = sorted({task_group(record) for record in self.pool})
        labels = np.array([names.index(task_group(record)) for record in self.pool], dtype=np.int64)
        if not target.transfer:
            return "families"
        name = f"families_without_{'_'.join(target.groups)}"
        self._labels(name, np.where(pool_mask(self.pool, target), labels, -1))
        return name

    def _labels(self, name: str, labels: np.ndarray, cost: Optional[dict] = None) -> None:
        folder = self.root / name
        if name not in self.analyses:
            folder.mkdir(parents=True, exist_ok=True)
            np.save(folder / "labels.npy", labels)
            if cost is not None:
                write_json_atomic(folder / "cost.json", cost)
            self.analyses[name] = Analysis(str(folder))

    def subset(self, name: str, indices: np.ndarray, cost: Optional[dict] = None) -> str:  # type: ignore[override]
        """A subset chosen here (the oracle's, the lexical control's) as labels: 0 kept, -1 left out."""
        labels = np.full(len(self.pool), -1, dtype=np.int64)
        labels[indices] = 0
        self._labels(name, labels, cost)
        return name

    def draw(self, target: Target, seed: int) -> TargetDraw:
        if (target.name, seed) not in self.draws:
            draw = draw_examples(self.validation, target, self.settings.targeted.per_group, seed)  # type: ignore
            self.draws[(target.name, seed)] = write_draw(draw, self.settings.work_dir / "targets")
        return self.draws[(target.name, seed)]

    def small_draw(self, target: Target, seed: int) -> TargetDraw:
        """The first SMALL_K examples of each group of the seed's draw, in their own target file."""
        draw = self.draw(target, seed)
        kept, taken = [], {}
        for record in draw.examples:
            group = record[TARGET_FIELD]
            if taken.get(group, 0) < SMALL_K:
                kept.append(record)
                taken[group] = taken.get(group, 0) + 1
        path = draw.path.with_name(f"{draw.path.stem}_k{SMALL_K}.jsonl")
        write_jsonl(kept, path)
        return TargetDraw(target, seed, kept, draw.example_groups, path)

    def targeted_analysis(self, target: Target, seed: int, block: dict, source: str,
                          draw: Optional[TargetDraw] = None) -> str:
        """The candidate's clustering of the pool's features (its feature kind, K and seed) with this draw's target
        examples' features beside them."""
        # The pool's clustering (its feature kind, K and seed) is the untargeted one: the rule reads the target later.
        base = self.clustering_analysis(seed, {k: v for k, v in block.items() if k not in ("selection", "source")},
                                        source)
        small = draw is not None and draw.path != self.draw(target, seed).path
        draw = draw or self.draw(target, seed)
        name = f"{base}_{target.name}" + (f"_k{SMALL_K}" if small else "")
        self.analyses.setdefault(name, Analysis(
            str(self.root / name), cluster_sampling=self.analyses[base].cluster_sampling,
            features=self.analyses[base].features, keep_features=True, target=str(draw.path),
            leave_out=target.groups if target.transfer else None))
        return name


def build_targeted_arms(settings: Settings, data: PreparedData) -> tuple[list[Arm], dict[str, Analysis], dict]:
    """Every arm of a targeted run (the gate's two first: full data and the random subset of the first seed), the
    analyses they read, and the draws' record (their files and leakage checks, for the report)."""
    targeted = settings.targeted
    assert targeted is not None
    builder = TargetedBuilder(settings, data)
    targets = chosen_targets(settings, data)
    first = settings.seeds[0]
    arms = [builder.arm_of("full", Method.FULL, first, "one_cluster", PLAIN)]
    budget_block = {**PLAIN, "budget_samples": builder.budget}
    for seed in settings.seeds:
        for target in [None] + [t for t in targets if t.transfer]:
            suffix = "" if target is None else f"_{target.name}"
            pool_target = target or Target("pool", ())
            arms.append(builder.arm_of(f"random{suffix}", Method.RANDOM, seed, builder.pool_of(pool_target),
                                       budget_block, None if target is None else target.name, steps=builder.steps))
            arms.append(builder.arm_of(f"full_cut{suffix}", Method.FULL_CUT, seed, builder.pool_of(pool_target),
                                       PLAIN, None if target is None else target.name, steps=builder.steps))
            arms.append(builder.arm_of(f"{BALANCED}{suffix}", BALANCED, seed, builder.groups_of(pool_target),
                                       {**budget_block, "budget_mode": "equal"},
                                       None if target is None else target.name, steps=builder.steps))
        for target in targets:
            draw = builder.draw(target, seed)
            allowed = pool_mask(builder.pool, target)
            if not target.transfer:  # a transfer target's groups are not in the pool: no oracle exists
                chosen = oracle_subset(builder.pool, target, builder.budget, seed)
                arms.append(builder.arm_of(f"{ORACLE}_{target.name}", ORACLE, seed,
                                           builder.subset(f"{ORACLE}_{target.name}_s{seed}", chosen), PLAIN,
                                           target.name, steps=builder.steps))
            chosen = lexical_subset(builder.pool, draw, builder.budget, allowed)
            arms.append(builder.arm_of(f"{LEXICAL}_{target.name}", LEXICAL, seed,
                                       builder.subset(f"{LEXICAL}_{target.name}_s{seed}", chosen), PLAIN,
                                       target.name, steps=builder.steps))
            runs = [(name, block, draw) for name, block in targeted.candidates.items()]
            runs += [(f"{name}_k{SMALL_K}", targeted.candidates[name], builder.small_draw(target, seed))
                     for name in targeted.small_k]
            for candidate, block, examples in runs:
                source = block.get("source", "own")
                analysis = builder.targeted_analysis(target, seed, block, source, examples)
                arms.append(builder.arm_of(f"{candidate}_{target.name}", candidate, seed, analysis, {
                    **{k: v for k, v in block.items() if k != "source"}, "budget_samples": builder.budget,
                    "target": {"data": str(examples.path), "group_field": TARGET_FIELD}}, target.name, candidate,
                    steps=builder.steps))
    record = {"budget": builder.budget, "steps": builder.steps, "pool": len(builder.pool),
              "targets": [{"name": t.name, "groups": list(t.groups), "transfer": t.transfer} for t in targets],
              "draws": {f"{name}_s{seed}": {"path": str(draw.path), "examples": len(draw.examples),
                                            "example_groups": sorted(draw.example_groups),
                                            "leakage": leakage(draw, builder.pool, builder.heldout)}
                        for (name, seed), draw in builder.draws.items()}}
    write_json_atomic(settings.work_dir / "targets" / "draws.json", record)
    return arms, builder.analyses, record


def target_groups_of(record: dict[str, Any]) -> dict[str, tuple[str, ...]]:
    return {target["name"]: tuple(target["groups"]) for target in record["targets"]}


def draws_path(work: Path) -> Path:
    return work / "targets" / "draws.json"
