"""The targeted instrument's figures, from the finished arms (every record's answer loss, the kept indices):
per target and seed, the target group's answer loss (validation: the target group's records left after that
seed's examples were drawn, their whole example groups out; held-out: the group's shipped records), the other
groups' macro loss (what the selection costs them), paired differences against the random subset and full data at
the same steps, averages over the single-group targets with 95% intervals over the paired seeds, the oracle's lead
that a method closes, and the selections' own diagnostics (the target's share, token lengths, overlap with the
oracle).
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from bench.harness.arms import Arm, Method
from bench.harness.summary import mean_ci
from bench.harness.targeted import BALANCED, LEXICAL, ORACLE
from bench.harness.targets import group_of
from ds_cluster.data.dataset import read_jsonl, task_group

BASELINES = (Method.RANDOM, Method.FULL_CUT, BALANCED)


class TargetedRun:
    """A targeted run's finished arms, its splits and draws: what every figure below is read from."""

    def __init__(self, work: Path, arms: Sequence[Arm]) -> None:
        self.work = work
        self.draws = json.loads((work / "targets" / "draws.json").read_text())
        self.targets = {t["name"]: t for t in self.draws["targets"]}
        self.validation = read_jsonl(work / "data" / "validation.jsonl")
        self.pool = read_jsonl(work / "data" / "train.jsonl")
        self.pool_groups = np.array([task_group(record) for record in self.pool])
        self.results: dict[str, dict] = {}
        for arm in arms:
            path = work / "arms" / f"{arm.name}.json"
            if path.exists():
                self.results[arm.name] = json.loads(path.read_text())
        self.arms = [arm for arm in arms if arm.name in self.results]
        tokens = work / "data" / "train_tokens.npy"
        self.tokens = np.load(tokens) if tokens.exists() else None

    # ------------------------------------------------------------------ one arm
    def arm(self, method: str, target: str, seed: int) -> Optional[Arm]:
        """The arm of `method` that serves `target` on `seed`: its own, or the shared baseline of its pool."""
        transfer = self.targets[target]["transfer"]
        for arm in self.arms:
            if arm.method != method or arm.seed != seed:
                continue
            if arm.target == target or (arm.target is None and method in BASELINES and not transfer):
                return arm
        return None

    def target_loss(self, arm: Arm, target: str, split: str) -> float:
        """The target's answer loss (mean over its groups) on `split`; on validation, without the records of the
        example groups drawn as this seed's target examples."""
        groups = self.targets[target]["groups"]
        result = self.results[arm.name]
        if split != "validation":
            return float(np.mean([result[split]["loss"][group] for group in groups]))
        drawn = set(self.draws["draws"][f"{target}_s{arm.seed}"]["example_groups"])
        losses = result["validation"]["record_loss"]
        per_group = []
        for group in groups:
            kept = [loss for index, (record, loss) in enumerate(zip(self.validation, losses))
                    if task_group(record) == group and group_of(record, index) not in drawn]
            per_group.append(float(np.mean(kept)))
        return float(np.mean(per_group))

    def others_loss(self, arm: Arm, target: str, split: str = "heldout") -> float:
        """Macro answer loss over the groups that are not the target's: the selection's collateral cost."""
        groups = set(self.targets[target]["groups"])
        losses = self.results[arm.name][split]["loss"]
        return float(np.mean([value for group, value in losses.items() if group not in groups]))

    def target_exact_match(self, arm: Arm, target: str, split: str = "heldout") -> Optional[float]:
        matches = self.results[arm.name][split].get("exact_match") or {}
        groups = [group for group in self.targets[target]["groups"] if group in matches]
        return float(np.mean([matches[group] for group in groups])) if groups else None

    def selection(self, arm: Arm, target: str) -> dict[str, float]:
        """What an arm trained on: the share of its records from the target's groups, their mean tokens."""
        selected = np.asarray(self.results[arm.name].get("selected") or [], dtype=np.int64)
        if selected.size == 0:
            return {}
        share = float(np.isin(self.pool_groups[selected], self.targets[target]["groups"]).mean())
        out = {"target_share": share, "records": int(selected.size)}
        if self.tokens is not None:
            out["tokens_mean"] = float(self.tokens[selected].mean())
        return out

    # ------------------------------------------------------------------ over seeds and targets
    def methods(self) -> list[str]:
        seen: list[str] = []
        for arm in self.arms:
            if arm.method not in seen and arm.method != Method.FULL:
                seen.append(arm.method)
        return seen

    def table(self, split: str) -> dict[str, dict[str, dict]]:
        """method -> target -> {"value", "vs_random", "vs_full_cut", "others", "exact_match"}: mean ± CI over seeds."""
        out: dict[str, dict[str, dict]] = defaultdict(dict)
        seeds = sorted({arm.seed for arm in self.arms})
        for method in self.methods():
            for target in self.targets:
                cells: dict[str, list] = defaultdict(list)
                for seed in seeds:
                    arm = self.arm(method, target, seed)
                    random, cut = self.arm(Method.RANDOM, target, seed), self.arm(Method.FULL_CUT, target, seed)
                    if arm is None:
                        continue
                    value = self.target_loss(arm, target, split)
                    cells["value"].append(value)
                    if random is not None:
                        cells["vs_random"].append(value - self.target_loss(random, target, split))
                    if cut is not None:
                        cells["vs_full_cut"].append(value - self.target_loss(cut, target, split))
                    if split == "heldout":
                        cells["others"].append(self.others_loss(arm, target))
                        if random is not None:
                            cells["others_vs_random"].append(self.others_loss(arm, target)
                                                             - self.others_loss(random, target))
                    shares = self.selection(arm, target)
                    if shares:
                        cells["target_share"].append(shares["target_share"])
                if cells:
                    out[method][target] = {key: mean_ci(values) for key, values in cells.items()}
        return out

    def averaged(self, split: str, singles: Sequence[str]) -> dict[str, dict[str, dict]]:
        """Per method, averaged over the single-group targets seed by seed: the target loss and its paired
        differences, mean ± CI over the seeds."""
        seeds = sorted({arm.seed for arm in self.arms})
        out: dict[str, dict[str, dict]] = {}
        for method in self.methods():
            rows: dict[str, list] = defaultdict(list)
            for seed in seeds:
                per_target = defaultdict(list)
                for target in singles:
                    arm = self.arm(method, target, seed)
                    random, cut = self.arm(Method.RANDOM, target, seed), self.arm(Method.FULL_CUT, target, seed)
                    if arm is None or random is None or cut is None:
                        break
                    value = self.target_loss(arm, target, split)
                    per_target["value"].append(value)
                    per_target["vs_random"].append(value - self.target_loss(random, target, split))
                    per_target["vs_full_cut"].append(value - self.target_loss(cut, target, split))
                else:
                    for key, values in per_target.items():
                        rows[key].append(float(np.mean(values)))
            if rows:
                out[method] = {key: mean_ci(values) for key, values in rows.items()}
        return out

    def paired(self, method: str, reference: str, split: str, singles: Sequence[str]) -> Optional[dict]:
        """`method`'s target-group loss minus `reference`'s, averaged over the single-group targets seed by seed,
        mean ± CI over the seeds (None until both have every target of a seed)."""
        per_seed = []
        for seed in sorted({arm.seed for arm in self.arms}):
            pairs = [(self.arm(method, target, seed), self.arm(reference, target, seed)) for target in singles]
            if pairs and all(mine is not None and theirs is not None for mine, theirs in pairs):
                per_seed.append(float(np.mean([self.target_loss(mine, target, split) -
                                               self.target_loss(theirs, target, split)
                                               for (mine, theirs), target in zip(pairs, singles)])))
        return mean_ci(per_seed) if per_seed else None

    def oracle_closed(self, method: str, split: str, singles: Sequence[str]) -> Optional[float]:
        """(random - method) / (random - oracle), summed over the single-group targets and seeds: the share of the
        oracle's lead over random the method closes."""
        gained, lead = 0.0, 0.0
        for target in singles:
            for seed in sorted({arm.seed for arm in self.arms}):
                arm, random, oracle = (self.arm(name, target, seed) for name in (method, Method.RANDOM, ORACLE))
                if arm is None or random is None or oracle is None:
                    continue
                base = self.target_loss(random, target, split)
                gained += base - self.target_loss(arm, target, split)
                lead += base - self.target_loss(oracle, target, split)
        return gained / lead if lead > 0 else None


def overlap_with_oracle(run: TargetedRun, method: str, target: str, seed: int) -> Optional[float]:
    """The share of a method's records the label oracle (same target, same seed) took too."""
    arm, oracle = run.arm(method, target, seed), run.arm(ORACLE, target, seed)
    if arm is None or oracle is None:
        return None
    mine = set(run.results[arm.name].get("selected") or [])
    theirs = set(run.results[oracle.name].get("selected") or [])
    return len(mine & theirs) / max(len(mine), 1)


def method_label(method: str, candidates: Mapping[str, Any]) -> str:
    labels = {Method.RANDOM: "random subset", Method.FULL_CUT: "full data, same steps",
              BALANCED: "random, balanced over groups", ORACLE: "label oracle", LEXICAL: "lexical (hashed n-grams)"}
    if method in labels:
        return labels[method]
    block = candidates.get(method, {})
    return f"{block.get('feature_kind', '?')} + {block.get('selection', '?')} (`{method}`)"
