"""The declared choice rules of the choosing runs (`--choose*`, bench/candidates.json's "_rule"s), applied to the
validation summary. Each returns its decision and the figures it read; the report writes them out.

- the fixed-budget candidates (the adaptive schedule at the subsets' step count, or the static ones): the lowest
  mean macro validation loss; with an overhead limit, among those whose mean loader share of the training loop
  is under it (none, and the goal not met, if none is);
- the auto candidates (budget_ratio "auto"): the lower mean macro loss of those whose mean total time is at most
  AUTO_FAST_RATIO of full data's (else the faster); with an overhead limit, the fastest of those under it whose
  macro loss is within the noise of full data's or below (the paired 95% CI reaches 0 or lies below).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

import numpy as np

from bench.harness.arms import setting_name

AUTO_FAST_RATIO = 0.5


@dataclass(frozen=True)
class FixedChoice:
    """The fixed-budget candidates' choice: `chosen` (None: none qualifies), each one's mean macro validation loss
    (in the declared order), and with `limit` each measured one's mean loader share."""

    chosen: Optional[str]
    losses: dict[str, float]
    limit: Optional[float] = None
    shares: Optional[dict[str, float]] = None


@dataclass(frozen=True)
class AutoChoice:
    """The auto candidates' choice: `chosen` (None: none qualifies), the figures it read per candidate (their summary
    rows), and with `limit` each measured one's mean loader share; `fast`: whether any was within AUTO_FAST_RATIO
    of full data's time (without a limit)."""

    chosen: Optional[str]
    rows: dict[str, dict]
    limit: Optional[float] = None
    shares: Optional[dict[str, float]] = None
    fast: bool = True


@dataclass(frozen=True)
class Choice:
    fixed: Optional[FixedChoice]
    auto: Optional[AutoChoice]


def choose(summary: Mapping[str, Any], candidates: Mapping[str, dict], fraction: float,
           overhead: Optional[Mapping[str, list[float]]] = None, overhead_limit: Optional[float] = None) -> Choice:
    """The declared rules on the validation summary: the fixed-budget candidates at `fraction`, and the auto ones;
    `overhead`: each setting's loader shares (summary.loader_overhead), read with `overhead_limit`."""
    rows = summary["settings"]
    fixed = {name: rows[setting_name(name, fraction)] for name, block in candidates.items()
             if block.get("budget_ratio") != "auto" and setting_name(name, fraction) in rows}
    auto = {name: rows[name] for name, block in candidates.items() if block.get("budget_ratio") == "auto"
            and name in rows}
    fixed_shares = {name: _mean_share(overhead, setting_name(name, fraction)) for name in fixed}
    return Choice(fixed=_choose_fixed(fixed, fixed_shares, overhead_limit) if fixed else None,
                  auto=_choose_auto(auto, {name: _mean_share(overhead, name) for name in auto}, overhead_limit)
                  if auto else None)


def _mean_share(overhead: Optional[Mapping[str, list[float]]], setting: str) -> Optional[float]:
    values = (overhead or {}).get(setting)
    return float(np.mean(values)) if values else None


def _choose_fixed(fixed: dict[str, dict], shares: dict[str, Optional[float]], limit: Optional[float]) -> FixedChoice:
    losses = {name: entry["loss_macro"]["mean"] for name, entry in fixed.items()}
    if limit is None:
        return FixedChoice(min(losses, key=lambda name: losses[name]), losses)
    measured = {name: share for name, share in shares.items() if share is not None}
    eligible = [name for name in losses if name in measured and measured[name] < limit]
    chosen = min(eligible, key=lambda name: losses[name]) if eligible else None
    return FixedChoice(chosen, losses, limit, measured)


def within_full(entry: Mapping[str, Any]) -> bool:
    """Macro loss within the noise of full data's or below: the paired 95% CI reaches 0 or lies below."""
    difference = entry.get("vs_full", {}).get("loss_macro")
    return difference is not None and difference["mean"] - difference["ci"] <= 0


def _choose_auto(auto: dict[str, dict], shares: dict[str, Optional[float]], limit: Optional[float]) -> AutoChoice:
    if limit is not None:
        measured = {name: share for name, share in shares.items() if share is not None}
        eligible = [name for name in auto if name in measured and measured[name] < limit and within_full(auto[name])]
        chosen = min(eligible, key=lambda name: auto[name]["ratio_total_cpu"]["mean"]) if eligible else None
        return AutoChoice(chosen, auto, limit, measured)
    fast = {name: entry for name, entry in auto.items() if entry["ratio_total_cpu"]["mean"] <= AUTO_FAST_RATIO}
    pool = fast or auto
    key = "loss_macro" if fast else "ratio_total_cpu"
    return AutoChoice(min(pool, key=lambda name: pool[name][key]["mean"]), auto, fast=bool(fast))
