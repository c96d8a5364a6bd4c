"""The calibration gate of the quality benchmark: can the instrument tell methods apart at all?

Checked on the validation split, before any method comparison:

1. the base model copies: greedy exact match >= COPY_PROBE_MIN on strings of 3 to 8 random letters;
2. full data reaches >= FULL_EXACT_MATCH_MIN on every family and has plateaued (validation answer
   loss changes by less than PLATEAU_MAX over its last epoch);
3. a random subset of 30% loses >= RANDOM_EXACT_MATCH_DROP exact match, or >= RANDOM_LOSS_MARGIN of
   answer loss (relative), on at least one small family (the smaller half of the families).

A run that misses the gate says so and stops: change the tasks or the model, never the gate.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

COPY_PROBE_MIN = 0.95
FULL_EXACT_MATCH_MIN = 0.7
PLATEAU_MAX = 0.02
RANDOM_EXACT_MATCH_DROP = 0.2
RANDOM_LOSS_MARGIN = 0.25  # a "clear" loss margin: the random subset's loss at least 25% above full data's


def calibration_gate(work: Path, spec: dict) -> dict[str, Any]:
    """The three checks from the finished gate arms' results in `work`; `text` says what was measured."""
    gate = spec["gate"]
    probe = json.loads((work / "copy_probe.json").read_text())["exact_match"]
    full = json.loads((work / "arms" / f"{gate['full']}.json").read_text())
    random30 = json.loads((work / "arms" / f"{gate['random']}.json").read_text())
    full_em, random_em = full["validation"]["exact_match"], random30["validation"]["exact_match"]
    full_loss, random_loss = full["validation"]["loss"], random30["validation"]["loss"]
    per_epoch = [sum(epoch.values()) / len(epoch) for epoch in full["validation_loss_per_epoch"]]
    change = abs(per_epoch[-1] - per_epoch[-2]) / per_epoch[-2] if len(per_epoch) >= 2 else float("inf")
    small = gate["small_families"]
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
    passed = all(check["passed"] for check in checks.values())
    lines = [f"calibration gate: {'PASSED' if passed else 'FAILED'} (validation split)",
             f"  base model copy probe {probe:.3f} (>= {COPY_PROBE_MIN})",
             f"  full data, worst family exact match {checks['full_every_family']['value']:.3f} "
             f"({checks['full_every_family']['worst_family']}; >= {FULL_EXACT_MATCH_MIN} on every family)",
             f"  full data, validation loss change over the last epoch {change:.4f} (< {PLATEAU_MAX})",
             "  random 30% on the small families: exact match drop "
             + ", ".join(f"{f} {d:+.2f}" for f, d in drops.items()) + "; loss margin "
             + ", ".join(f"{f} {m:+.2f}" for f, m in margins.items())
             + f" (>= {RANDOM_EXACT_MATCH_DROP} drop or >= {RANDOM_LOSS_MARGIN:.0%} margin on one)"]
    if not passed:
        lines.append("  the benchmark stops here: change the tasks or the model, never the gate")
    return {"passed": passed, "checks": checks, "text": "\n".join(lines)}
