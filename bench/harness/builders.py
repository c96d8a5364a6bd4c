"""The arms of a run and the analyses they read (`build_arms`): one builder per method, and the ablations.

Features are extracted once per feature model ("features_own_proxy", "features_smollm2_proxy", ...); every k-means
analysis clusters them with its own settings and seed; every arm is charged its analysis in full. A subset arm
keeps the count the paper arm of its fraction and seed keeps (`Match`; the job's `resolve_arm`).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional

from bench.harness.arms import (SOURCED_METHODS, Analysis, Arm, Match, Method, arm_name, budget_ratio_setting,
                                kind_and_source, partner_setting, setting_name)
from bench.harness.data import PreparedData
from bench.harness.instrument import EQUAL_STEPS_KINDS, Settings, default_base_model
from bench.real import STORIES260K_DIR
from ds_cluster.planning.selection import SELECTIONS

# Full data as a block: every sample, no weights (random and full_cut read it too, at their kept count).
WHOLE = {"budget_mode": "proportional", "budget_ratio": 1.0, "selection": "random", "weighting": "none",
         "allocation": "stratified", "loss_reduction": "token"}
# The settings a k-means analysis depends on: an arm that changes one of them reads its own clustering.
CLUSTERING_KEYS = ("feature_kind", "feature_dim", "num_clusters", "capacity_factor", "kmeans_n_init")


@dataclass(frozen=True)
class SubsetRequest:
    """A subset arm asked of its method's builder: its setting, seed and fraction, the match to the paper arm's
    kept count, whether it trains to full data's steps, and what it changes of the method's block."""

    kind: str
    setting: str
    seed: int
    fraction: float
    match: Match
    stretch: bool
    changes: dict[str, Any] = field(default_factory=dict)


class ArmBuilder:
    """What the builders share: the settings, the data, and the analyses registered so far (in the spec's order)."""

    def __init__(self, settings: Settings, data: PreparedData) -> None:
        self.settings, self.data = settings, data
        self.root = settings.work_dir / "analyses"
        self.analyses: dict[str, Analysis] = {"one_cluster": Analysis(str(self.root / "one_cluster")),
                                              "families": Analysis(str(self.root / "families"))}
        self.feature_models: dict[str, dict[str, Any]] = {
            "own": {"model": str(default_base_model(settings))},
            "small": {"model": str(settings.small_feature_model or STORIES260K_DIR),
                      "feature_max_length": settings.small_feature_max_length}}
        # The trained model with seeded untrained adapters (an adapter folder the job writes): the `lora` features.
        self.feature_models["lora"] = {"model": str(self.root / f"lora_adapters_r{settings.lora_rank}")}
        if settings.smollm2 is not None:
            self.feature_models["smollm2"] = {"model": str(settings.smollm2),
                                              "feature_max_length": settings.smollm2_feature_max_length}

    def arm(self, request: SubsetRequest, analysis: str, block: dict, **extra: Any) -> Arm:
        return Arm(name=arm_name(request.setting, request.seed), setting=request.setting, method=request.kind,
                   seed=request.seed, analysis=analysis, fraction=request.fraction,
                   cluster_sampling={**block, "seed": request.seed}, epochs=self.settings.epochs, match=request.match,
                   stretch=request.stretch, changes=tuple(request.changes.items()), **extra)

    def subset(self, kind: str, seed: int, fraction: float, stretch: bool = False, **changes: Any) -> Arm:
        """The arm of method `kind` keeping `fraction` on `seed` (a declared candidate's name builds that
        candidate); `stretch`: trained to full data's step count; `changes`: an ablation's change of its block."""
        match = Match(self.paper_analysis(seed), fraction=fraction)
        request = SubsetRequest(kind, setting_name(kind, fraction, stretch, changes), seed, fraction, match, stretch,
                                changes)
        return SUBSET_BUILDERS.get(kind, candidate_arm)(self, request)

    # ------------------------------------------------------------------ analyses
    def features_of(self, source: str, block: dict) -> str:
        """The feature analysis of one feature model and feature kind (registered once)."""
        name = f"features_{source}_{block.get('feature_kind', 'proxy')}{block.get('feature_dim') or ''}"
        if name not in self.analyses:
            entry = {"source": source, **self.feature_models[source], "cluster_sampling": {
                k: block[k] for k in ("feature_kind", "feature_dim", "normalize_features") if k in block}}
            self.analyses[name] = Analysis(str(features_folder(self.settings, self.data, name, entry)), **entry)
        return name

    def paper_analysis(self, seed: int) -> str:
        """The paper preset's clustering on `seed`: what every subset arm's kept count is matched to."""
        name = f"paper_s{seed}"
        block = {**_expand({"preset": "paper"}), "seed": seed}
        features = self.features_of("own", block)
        self.analyses.setdefault(name, Analysis(str(self.root / name), cluster_sampling=block, features=features))
        return name

    def clustering_analysis(self, seed: int, block: dict, source: str) -> str:
        """The k-means analysis of `block`'s clustering settings on `seed`, on `source`'s features."""
        tag = "_".join(f"{k}{block[k]}" for k in CLUSTERING_KEYS + ("preset",) if k in block) or "default"
        name = f"k_{tag}{'' if source == 'own' else '_' + source}_s{seed}"
        # An explicit null (capacity_factor: no cap) over a preset stays: _expand drops it, the preset refills it.
        nulls = {k: v for k, v in block.items() if v is None} if "preset" in block else {}
        expanded = {**_expand(block), **nulls, "seed": seed}
        features = self.features_of(source, expanded)
        self.analyses.setdefault(name, Analysis(str(self.root / name), cluster_sampling=expanded, features=features))
        # Arms of one K share its clustering; the first arm's selection need not be the one that reads features.
        if SELECTIONS.get_rule(expanded.get("selection", "random")).reads_features:
            self.analyses[name] = replace(self.analyses[name], keep_features=True)
        return name


def features_folder(settings: Settings, data: PreparedData, name: str, entry: dict) -> Path:
    """Where a feature model's features of this training split live: in the work folder, or with
    `features_cache` set, in a folder keyed by the split, the max length and the feature settings, so every
    run on the same mixture (the default run, --choose, --ablations) extracts them once. Their cost is
    recorded with them (cost.json) and charged to every arm that reads them, in every run."""
    if settings.features_cache is None:
        return settings.work_dir / "analyses" / name
    key = hashlib.sha256(Path(data.paths["train"]).read_bytes())
    key.update(json.dumps({"max_length": settings.max_length, **entry}, sort_keys=True, default=str).encode())
    return Path(settings.features_cache) / f"{name}-{key.hexdigest()[:16]}"


def _expand(block: dict) -> dict:
    """The block with its preset filled in (the analysis depends on the resolved feature and K settings)."""
    from ds_cluster.config import ClusterSamplingConfig

    expanded = ClusterSamplingConfig.from_dict({**block, "enabled": True}).model_dump(exclude_none=True)
    return {k: v for k, v in expanded.items() if k not in ("enabled", "analysis_path")}


# --------------------------------------------------------------------------- one builder per method
def full_arm(builder: ArmBuilder, seed: int) -> Arm:
    """All of the data, `epochs` epochs: the time and quality reference."""
    return Arm(name=arm_name("full", seed), setting="full", method="full", seed=seed, analysis="one_cluster",
               fraction=None, cluster_sampling={**WHOLE, "seed": seed}, epochs=builder.settings.epochs)


def auto_arm(builder: ArmBuilder, seed: int, name: str = "auto", block: Optional[dict] = None) -> Arm:
    """The adaptive schedule with budget_ratio "auto": up to full data's step count, or until every cluster has
    stopped improving; `name` and `block`: a declared auto candidate's."""
    block = {**builder.settings.recommended, **(block or builder.settings.auto)}
    return Arm(name=arm_name(name, seed), setting=name, method="auto", seed=seed,
               analysis=builder.clustering_analysis(seed, block, "own"), fraction=None,
               cluster_sampling={**block, "seed": seed}, epochs=builder.settings.epochs,
               candidate=None if name == "auto" else name)


def random_arm(builder: ArmBuilder, request: SubsetRequest) -> Arm:
    """A uniform random subset of the paper arm's kept size."""
    return builder.arm(request, "one_cluster", {**WHOLE, **request.changes})


def full_cut_arm(builder: ArmBuilder, request: SubsetRequest) -> Arm:
    """All of the data, stopped at the subset arms' step count (equal steps, full data's side)."""
    return builder.arm(request, "one_cluster", WHOLE, cut=True)


def oracle_arm(builder: ArmBuilder, request: SubsetRequest) -> Arm:
    """Family-balanced: labels = family, an even budget, random within a family."""
    return builder.arm(request, "families", {**WHOLE, "budget_mode": "equal", **request.changes})


def neardup_arm(builder: ArmBuilder, request: SubsetRequest) -> Arm:
    """Near-duplicate removal to the same kept size (bench/near_duplicates.py has the rule)."""
    name = f"neardup_f{request.fraction:g}_s{request.seed}"
    builder.analyses.setdefault(name, Analysis(str(builder.root / name),
                                               near_duplicates=str(builder.root / "near_duplicates"),
                                               seed=request.seed))
    return builder.arm(request, name, {**WHOLE, **request.changes})


def paper_arm(builder: ArmBuilder, request: SubsetRequest) -> Arm:
    """The CluSTER paper preset (K = world size, r set so that it keeps about the fraction)."""
    # A change of K or of the capacity clusters anew; the arm then keeps `fraction` of its own clusters.
    clustering = {k: v for k, v in request.changes.items() if k in CLUSTERING_KEYS}
    if clustering:
        analysis = builder.clustering_analysis(request.seed, {"preset": "paper", **clustering}, "own")
        request = replace(request, match=replace(request.match, analysis=analysis))
    return builder.arm(request, request.match.analysis, {"preset": "paper", **request.changes})


def preset_arm(builder: ArmBuilder, request: SubsetRequest, block: dict, source: str,
               candidate: Optional[str] = None) -> Arm:
    """`block` (a preset, or a candidate's) on `source`'s features, clustered for this arm's seed."""
    block = {**block, **request.changes}
    if source == "smollm2":
        # SmolLM2's proxy features, the candidate measured (its lm_head extraction was not: 49k-word vocabulary).
        block.update(feature_kind="proxy", **_feature_model_keys(builder, "smollm2"))
    elif source == "small":
        block.update(_feature_model_keys(builder, "small"))
    elif source == "lora":
        block.update(feature_kind="lora")
    cut = block.get("schedule") == "adaptive"
    if cut:
        block["budget_ratio"] = request.fraction  # at the subsets' step count: the fraction sets the budget
    return builder.arm(request, builder.clustering_analysis(request.seed, block, source), block, cut=cut,
                       candidate=candidate, source=source)


def _feature_model_keys(builder: ArmBuilder, source: str) -> dict[str, Any]:
    model = builder.feature_models[source]
    return {"feature_model": model["model"], "feature_max_length": model["feature_max_length"]}


def recommended_arm(builder: ArmBuilder, request: SubsetRequest, source: str = "own") -> Arm:
    """ds_cluster's recommended preset, on the trained model's own features or a feature model's."""
    return preset_arm(builder, request, builder.settings.recommended, source)


def adaptive_arm(builder: ArmBuilder, request: SubsetRequest) -> Arm:
    """The adaptive schedule on the recommended preset's clusters, at the subsets' step count."""
    return preset_arm(builder, request, {**builder.settings.recommended, **builder.settings.adaptive}, "own")


def candidate_arm(builder: ArmBuilder, request: SubsetRequest) -> Arm:
    """A declared candidate (--choose*), on the trained model's features or a feature model's (NAME_SOURCE)."""
    base, source = kind_and_source(request.kind, builder.settings.candidates)
    block = builder.settings.candidates.get(base) or builder.settings.recommended
    return preset_arm(builder, request, block, source, candidate=request.kind)


SUBSET_BUILDERS: dict[str, Callable[[ArmBuilder, SubsetRequest], Arm]] = {
    Method.FULL_CUT: full_cut_arm, Method.RANDOM: random_arm, Method.PAPER: paper_arm, Method.ORACLE: oracle_arm,
    Method.NEARDUP: neardup_arm, Method.RECOMMENDED: recommended_arm, Method.ADAPTIVE: adaptive_arm,
    **{method: (lambda builder, request, source=source: recommended_arm(builder, request, source))
       for method, (_, source) in SOURCED_METHODS.items()},
}


# --------------------------------------------------------------------------- the ablations
# The real instrument's ablation rows at the headline fraction. K != W needs allocation "stratified"
# (cluster_per_rank is one cluster per rank), so the paper preset with "stratified" alone is the K rows' control.
# Capacity 3.0 is left out: at K = 2 a factor >= 2 never binds (ceil(3.0 x N / 2) >= N), so it would repeat
# capacity null sample for sample. On T0 even 1.5 need not bind at K = 2; at K = 8 the proxy's largest cluster
# exceeds 1.5 N / 8, hence that α row.
REAL_ABLATION_ROWS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("paper", {"weighting": "none"}), ("paper", {"selection": "random"}), ("paper", {"selection": "core"}),
    ("paper", {"allocation": "stratified"}), ("paper", {"num_clusters": 4, "allocation": "stratified"}),
    ("paper", {"num_clusters": 8, "allocation": "stratified"}), ("paper", {"capacity_factor": None}),
    ("paper", {"num_clusters": 8, "allocation": "stratified", "capacity_factor": None}),
    ("recommended", {"loss_reduction": "sample"}))
# The synthetic instrument's: what each difference from the paper is worth (its results depend on these three).
SYNTHETIC_ABLATION_ROWS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("paper", {"weighting": "none"}), ("paper", {"selection": "random"}), ("recommended", {"loss_reduction": "sample"}))


def real_ablations(builder: ArmBuilder, present: set[str]) -> list[Arm]:
    """The real instrument's ablation rows at the headline fraction on every seed, each with the random subset of
    its kept count and seed: random_fF when it keeps the paper arm's count, else a random arm matched to the same
    analysis (random_as_SETTING, named in the row's `baseline`); and the paper preset at each budget ratio r
    itself, beside a random arm of its count. `present`: the names of the arms built already."""
    settings, fraction = builder.settings, builder.settings.headline_fraction
    added: list[Arm] = []

    def add(arm: Arm) -> None:
        if arm.name not in present:
            present.add(arm.name)
            added.append(arm)

    def partnered(arm: Arm, match: Match) -> None:
        setting = partner_setting(arm.setting)
        partner = builder.subset("random", arm.seed, fraction)
        add(replace(arm, baseline=setting))
        add(replace(partner, name=arm_name(setting, arm.seed), setting=setting, fraction=arm.fraction, match=match,
                    baseline=setting))

    for seed in settings.seeds:
        add(builder.subset("paper", seed, fraction))  # the row every paper ablation changes one thing of
        add(builder.subset("random", seed, fraction))
        for kind, changes in REAL_ABLATION_ROWS:
            arm = builder.subset(kind, seed, fraction, **changes)
            assert arm.match is not None
            if arm.match.analysis == builder.paper_analysis(seed):
                add(arm)  # keeps the paper arm's count: random_fF is its partner
            else:
                partnered(arm, arm.match)
        for ratio in settings.ablation_ratios:
            # r itself sets the count (floor(r x smallest cluster) each): no fraction, no match of its own.
            arm = builder.subset("paper", seed, fraction, budget_ratio=ratio)
            assert arm.match is not None
            setting = budget_ratio_setting(ratio)
            partnered(replace(arm, name=arm_name(setting, seed), setting=setting, fraction=None, match=None),
                      Match(arm.match.analysis, budget_ratio=ratio))
    return added


def synthetic_ablations(builder: ArmBuilder) -> list[Arm]:
    """The synthetic instrument's three ablation rows on its first `ablation_seeds` seeds."""
    settings = builder.settings
    return [builder.subset(kind, seed, settings.headline_fraction, **changes)
            for seed in settings.seeds[:settings.ablation_seeds] for kind, changes in SYNTHETIC_ABLATION_ROWS]


# --------------------------------------------------------------------------- every arm of a run
def build_arms(settings: Settings, data: PreparedData) -> tuple[list[Arm], dict[str, Analysis]]:
    """Every arm, gate arms first (full data and random 30% on the first seed), then seed-major; and the analyses
    they read."""
    builder = ArmBuilder(settings, data)
    first = settings.seeds[0]
    gate_random = builder.subset("random", first, 0.3)
    arms = [full_arm(builder, first), gate_random]
    if settings.gate_only:
        return arms, builder.analyses
    automatic = [name for name, block in settings.candidates.items() if block.get("budget_ratio") == "auto"]
    kinds = [k for k in settings.candidates if k not in automatic] if settings.candidates else \
        [k for k in settings.arms if k != "auto"]
    for seed in settings.seeds:
        # Choosing compares subsets only, unless an "auto" candidate needs full data's time beside it.
        with_full = settings.full_seeds is None or settings.seeds.index(seed) < settings.full_seeds
        if seed != first and (not settings.candidates or automatic) and with_full:
            arms.append(full_arm(builder, seed))
        for fraction in settings.fractions:
            for kind in (["random"] + kinds if settings.candidates else kinds):
                arm = builder.subset(kind, seed, fraction)
                if arm.name not in {a.name for a in arms}:
                    arms.append(arm)
        # The automatic budget's claim is against full data's loss and time on the same seed: it runs beside it.
        if "auto" in settings.arms and not settings.candidates and with_full:
            arms.append(auto_arm(builder, seed))
        for name in sorted(automatic):
            arms.append(auto_arm(builder, seed, name, settings.candidates[name]))
        if settings.equal_steps and not settings.candidates:
            for kind in EQUAL_STEPS_KINDS:
                arms.append(builder.subset(kind, seed, settings.headline_fraction, stretch=True))
    if settings.ablations and not settings.candidates and settings.instrument == "synthetic":
        arms += synthetic_ablations(builder)
    elif settings.ablations and not settings.candidates:
        arms += real_ablations(builder, {arm.name for arm in arms})
    for arm in arms:
        if arm.analysis not in builder.analyses:
            raise AssertionError(arm)
    return arms, builder.analyses
