"""The paper's ablations on real data, each read beside the trend the paper claims (a declared rule).

Every row is a paired difference over the seeds both settings ran (same seed: same data order, same
k-means seed), in answer loss, so below zero means the first setting is better. A row's reading says
whether the interval lies on the claimed side, on the other side, or reaches zero (the noise); when
every paired difference is exactly zero the change did not alter the subset at all (for example a
capacity cap that does not bind), and the reading says so.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Mapping, Sequence

from bench.harness.arms import Arm, budget_ratio_setting, partner_setting, setting_name
from bench.harness.summary import mean_ci, quality

CLAIM_BETTER = -1  # the paper claims the first setting's loss is lower
CLAIM_WORSE = 1  # ... higher (less data)
NO_CLAIM = 0


def comparisons(fraction: float) -> list[tuple[str, str, str, str, int]]:
    """(what, first setting, second setting, the paper's claim, the claimed sign of first minus second)."""
    paper = setting_name("paper", fraction)

    def changed(kind: str, **changes: Any) -> str:
        return setting_name(kind, fraction, changes=changes)

    stratified = changed("paper", allocation="stratified")
    rows = [
        ("weighting: cluster weights minus none", paper, changed("paper", weighting="none"),
         "weighting helps (without it the paper loses 1.3 points)", CLAIM_BETTER),
        ("selection: peripheral minus random", paper, changed("paper", selection="random"),
         "peripheral beats random (56.8 vs 56.1 pass@1)", CLAIM_BETTER),
        ("selection: random minus core", changed("paper", selection="random"), changed("paper", selection="core"),
         "random beats core (56.1 vs 55.3 pass@1)", CLAIM_BETTER),
    ]
    for ratio in (0.25, 0.5, 0.75):
        setting = budget_ratio_setting(ratio)
        # "Gentle" is a size, not a direction: the row reads the direction, the figure shows the size.
        rows.append((f"r = {ratio:g} minus full data", setting, "full",
                     "a gentle loss at r = 0.25 (a size: read the figure)" if ratio == 0.25 else "less data, some loss",
                     NO_CLAIM if ratio == 0.25 else CLAIM_WORSE))
        rows.append((f"r = {ratio:g} minus a random subset of its count", setting, partner_setting(setting),
                     "none (the paper compares r with full data)", NO_CLAIM))
    rows.append(("r = 0.25 minus r = 0.75", budget_ratio_setting(0.25), budget_ratio_setting(0.75),
                 "less data, some loss", CLAIM_WORSE))
    k8 = changed("paper", num_clusters=8, allocation="stratified")
    rows += [
        ("K = 4 minus K = 2 (both stratified)", changed("paper", num_clusters=4, allocation="stratified"), stratified,
         "none (the paper ties K to the GPU count)", NO_CLAIM),
        ("K = 8 minus K = 2 (both stratified)", k8, stratified, "none (the paper ties K to the GPU count)", NO_CLAIM),
        ("allocation: one cluster per rank minus stratified (K = 2)", paper, stratified,
         "none (one cluster per rank is the paper's design)", NO_CLAIM),
        ("α: cap 1.5 minus no cap (K = 2)", paper, changed("paper", capacity_factor=None),
         "none (α = 1.5 is the paper's setting)", NO_CLAIM),
        ("α: cap 1.5 minus no cap (K = 8, stratified)", k8,
         changed("paper", num_clusters=8, allocation="stratified", capacity_factor=None),
         "none (α = 1.5 is the paper's setting)", NO_CLAIM),
        ("loss: token-weighted minus sample-weighted (recommended preset)", setting_name("recommended", fraction),
         changed("recommended", loss_reduction="sample"), "none (ds_cluster's option)", NO_CLAIM),
    ]
    return rows


def _reading(stat: dict, claim: int, identical: bool) -> str:
    if identical:
        return "identical runs: the change did not alter the subset"
    low, high = stat["mean"] - stat["ci"], stat["mean"] + stat["ci"]
    if low <= 0 <= high or stat["ci"] != stat["ci"]:
        return "within the noise"
    side = CLAIM_BETTER if high < 0 else CLAIM_WORSE
    if claim == NO_CLAIM:
        return "first lower beyond the noise" if side == CLAIM_BETTER else "first higher beyond the noise"
    return "as claimed" if side == claim else "the opposite, beyond the noise"


def ablation_rows(arms: Sequence[Arm], results: Mapping[str, dict], split: str, fraction: float
                  ) -> list[dict[str, Any]]:
    """The comparisons whose two settings both have finished arms on shared seeds, on `split`: each row's settings,
    the paper's claim, the paired differences (answer loss, macro and worst family) and the reading of macro."""
    by_setting: dict[str, dict[int, dict]] = defaultdict(dict)
    for arm in arms:
        if arm.name in results and split in results[arm.name]:
            by_setting[arm.setting][arm.seed] = results[arm.name]
    rows = []
    for what, first, second, claim, sign in comparisons(fraction):
        seeds = sorted(set(by_setting.get(first, {})) & set(by_setting.get(second, {})))
        if not seeds:
            continue
        stats, identical = {}, True
        for metric in ("loss_macro", "loss_worst"):
            differences = [quality(by_setting[first][s], split)[metric] - quality(by_setting[second][s], split)[metric]
                           for s in seeds]
            identical = identical and all(d == 0.0 for d in differences)
            stats[metric] = mean_ci(differences)
        rows.append({"what": what, "first": first, "second": second, "claim": claim, "claimed_sign": sign,
                     **stats, "reading": _reading(stats["loss_macro"], sign, identical)})
    return rows
