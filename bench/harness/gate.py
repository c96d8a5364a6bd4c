"""The calibration gate of the quality benchmark (a declared rule): can the instrument tell methods apart at all?

Checked on the validation split of the first seed, after the full-data and random-30% arms and before
any method comparison. A run that misses the gate says so and stops: change the recipe (on
validation), the tasks or the model, never the gate.

Real instrument (a real mixture and base model; the default):

1. full data learns: its macro validation answer loss is at least FULL_IMPROVEMENT_MIN (relative)
   below the base model's;
2. full data has plateaued: its macro validation answer loss changes by less than PLATEAU_MAX
   (relative) over its last epoch;
3. there is something to win: a random 30% subset's macro validation answer loss is at least
   RANDOM_MARGIN_MIN (relative) above full data's.

Synthetic instrument (toy tasks and toy base model, a check of the machinery):

1. the base model copies: greedy exact match >= COPY_PROBE_MIN on strings of 3 to 8 random letters;
2. full data reaches >= FULL_EXACT_MATCH_MIN on every family and has plateaued (PLATEAU_MAX);
3. a random subset of 30% loses >= RANDOM_EXACT_MATCH_DROP exact match, or >= RANDOM_LOSS_MARGIN of
   answer loss (relative), on at least one small family (the smaller half of the families).

Each check returns its decision and the figures it read; the report's `gate_text` writes them out.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Real instrument.
FULL_IMPROVEMENT_MIN = 0.30
RANDOM_MARGIN_MIN = 0.05
# Both instruments.
PLATEAU_MAX = 0.02
# Synthetic instrument.
COPY_PROBE_MIN = 0.95
FULL_EXACT_MATCH_MIN = 0.7
RANDOM_EXACT_MATCH_DROP = 0.2
RANDOM_LOSS_MARGIN = 0.25  # a "clear" loss margin: the random subset's loss at least 25% above full data's


def macro(by_family: dict[str, float]) -> float:
    return sum(by_family.values()) / len(by_family)


def last_epoch_change(result: dict) -> tuple[float, list[float]]:
    """Relative change of the macro validation loss over the arm's last epoch, and the per-epoch macro losses."""
    per_epoch = [macro(losses) for losses in result["validation_loss_per_epoch"]]
    change = abs(per_epoch[-1] - per_epoch[-2]) / per_epoch[-2] if len(per_epoch) >= 2 else float("inf")
    return change, per_epoch


def calibration_gate(work: Path, gate: Any) -> dict[str, Any]:
    """The instrument's checks from the base model's and the finished gate arms' results in `work`; `gate`: the
    spec's `GateSpec` (its kind and its two arms)."""
    base = json.loads((work / "base.json").read_text())
    full = json.loads((work / "arms" / f"{gate.full}.json").read_text())
    random30 = json.loads((work / "arms" / f"{gate.random}.json").read_text())
    if gate.kind == "synthetic":
        return synthetic_gate(base, full, random30, gate.small_families)
    return real_gate(base, full, random30)


def real_gate(base: dict, full: dict, random30: dict) -> dict[str, Any]:
    """The real instrument's three checks on validation."""
    base_loss = macro(base["validation"]["loss"])
    full_loss = macro(full["validation"]["loss"])
    random_loss = macro(random30["validation"]["loss"])
    improvement = (base_loss - full_loss) / base_loss
    change, per_epoch = last_epoch_change(full)
    margin = random_loss / full_loss - 1.0
    checks = {
        "full_learns": {"value": improvement, "base_macro_loss": base_loss, "full_macro_loss": full_loss,
                        "passed": improvement >= FULL_IMPROVEMENT_MIN},
        "full_plateau": {"value": change, "per_epoch_macro_loss": per_epoch, "passed": change < PLATEAU_MAX},
        "random30_worse_than_full": {"value": margin, "random_macro_loss": random_loss,
                                     "passed": margin >= RANDOM_MARGIN_MIN},
    }
    return {"passed": all(check["passed"] for check in checks.values()), "kind": "real", "checks": checks}


def synthetic_gate(base: dict, full: dict, random30: dict, small: list[str]) -> dict[str, Any]:
    """The synthetic instrument's four checks on validation; `small`: the smaller half of the families."""
    probe = base["copy_probe"]["exact_match"]
    full_em, random_em = full["validation"]["exact_match"], random30["validation"]["exact_match"]
    full_loss, random_loss = full["validation"]["loss"], random30["validation"]["loss"]
    change, per_epoch = last_epoch_change(full)
    drops = {family: full_em[family] - random_em[family] for family in small}
    margins = {family: random_loss[family] / max(full_loss[family], 1e-9) - 1.0 for family in small}
    checks = {
        "copy_probe": {"value": probe, "passed": probe >= COPY_PROBE_MIN},
        "full_every_family": {"value": min(full_em.values()), "worst_family": min(full_em, key=full_em.get),
                              "passed": min(full_em.values()) >= FULL_EXACT_MATCH_MIN},
        "full_plateau": {"value": change, "per_epoch_macro_loss": per_epoch, "passed": change < PLATEAU_MAX},
        "random30_loses_on_a_small_family": {
            "exact_match_drop": drops, "loss_margin": margins,
            "passed": any(d >= RANDOM_EXACT_MATCH_DROP for d in drops.values())
                      or any(m >= RANDOM_LOSS_MARGIN for m in margins.values())},
    }
    return {"passed": all(check["passed"] for check in checks.values()), "kind": "synthetic", "checks": checks}
