"""The `cluster_sampling` block of a DeepSpeed JSON config.

It lives at ``data_efficiency.data_sampling.cluster_sampling``; DeepSpeed keeps
unknown keys there, so the same file drives both DeepSpeed and ds_cluster.

The keys that name a rule (feature kind, budget, selection, weighting,
allocation, clustering back-end) are validated against the rule registries
of the stages, so this module sits above the features, clustering and
planning floors: those stages never import it (they are handed the config
object or plain values).
"""
from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ds_cluster.clustering.kmeans import BACKENDS
from ds_cluster.ds_config import BLOCK_PATH, ConfigSource, cluster_block, read_ds_config
from ds_cluster.features.kinds import FEATURE_KINDS
from ds_cluster.planning.allocation import ALLOCATIONS
from ds_cluster.planning.auto import AUTO_SIGNALS
from ds_cluster.planning.budget import BUDGETS
from ds_cluster.planning.selection import SELECTIONS
from ds_cluster.planning.shares import ADAPTIVE_RULES
from ds_cluster.planning.weights import WEIGHTINGS
from ds_cluster.registry import Registry
from ds_cluster.settings import (ClusteringSettings, FeatureSettings, LossSettings, ScheduleSettings,
                                 SelectionSettings, StageSettings, TargetSettings, default_of)

# What the reference implementation does (docs/design.md, "The paper preset").
PAPER_PRESET: dict[str, Any] = {
    "num_clusters": "auto",
    "budget_mode": "min",
    "selection": "peripheral",
    "capacity_factor": 1.5,
    "kmeans_n_init": 10,
    "allocation": "cluster_per_rank",
    "weighting": "cluster",
    "loss_reduction": "token",
    "feature_kind": "proxy",
    "normalize_features": True,
}
# ds_cluster's recommended settings: of the real candidates in bench/candidates.json, the lowest mean macro
# validation answer loss on the T0 slice at 30% kept over 4 paired seeds (docs/choosing.md). K, budget,
# selection and weighting are also the synthetic choice; the output-layer gradient features (lm_head) are
# the real choice, ahead of a random subset by about its own seed noise. They are the stages' defaults
# (ds_cluster/settings.py): the preset names the keys it fixes.
RECOMMENDED_PRESET: dict[str, Any] = {key: default_of(key) for key in PAPER_PRESET}
PRESETS: dict[str, dict[str, Any]] = {"paper": PAPER_PRESET, "recommended": RECOMMENDED_PRESET}
# The keys that name a rule, and the registry each is read from (the one list of the names there are).
RULE_REGISTRIES: dict[str, Registry] = {"feature_kind": FEATURE_KINDS, "budget_mode": BUDGETS, "selection": SELECTIONS,
                                        "weighting": WEIGHTINGS, "allocation": ALLOCATIONS, "backend": BACKENDS,
                                        "adaptive_rule": ADAPTIVE_RULES, "auto_signal": AUTO_SIGNALS}
RULE_KEYS = tuple(RULE_REGISTRIES)
# The keys no stage reads: the switch, the preset (already applied) and where files are.
NOT_STAGE_KEYS = ("enabled", "preset", "analysis_path", "schedule_log")


class TargetConfig(BaseModel):
    """The `target` sub-block: examples of what the user cares about, for a targeted selection (docs/targeted.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    data: str = Field(min_length=1)
    group_field: Optional[str] = default_of("target.group_field")
    min_examples: int = Field(default_of("target.min_examples"), ge=1)
    groups: Optional[tuple[str, ...]] = Field(default_of("target.groups"), min_length=1)
    cluster_floor: int = Field(default_of("target.cluster_floor"), ge=0)

    @model_validator(mode="after")
    def _groups_need_their_field(self) -> "TargetConfig":
        if self.groups is not None and self.group_field is None:
            raise ValueError("target.groups names targets by the field target.group_field: set it too")
        return self

    def settings(self) -> TargetSettings:
        return TargetSettings(**self.model_dump())


class ClusterSamplingConfig(BaseModel):
    """Settings of cluster-balanced sampling; docs/configuration.md describes every key."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)

    enabled: bool = False
    preset: Optional[Literal["paper", "recommended"]] = None
    # Every default is the stage's (ds_cluster/settings.py, `default_of`): the recommended preset.
    num_clusters: Union[Literal["auto"], int] = default_of("num_clusters")
    budget_mode: str = default_of("budget_mode")
    # "auto" (with the adaptive schedule): the run finds its own budget (clusters stop when they stop improving).
    budget_ratio: Union[Literal["auto"], Annotated[float, Field(gt=0.0, le=1.0)]] = default_of("budget_ratio")
    budget_samples: Optional[int] = Field(default_of("budget_samples"), ge=1)
    selection: str = default_of("selection")
    # semdedup, round_robin, clusters: cosine similarity at or above which a sample is a near-duplicate of one read
    # (or taken) before it.
    dedup_similarity: float = Field(default_of("dedup_similarity"), gt=0.0, le=1.0)
    # The near-duplicate test on each row's unit vector less the pool's mean one (features where one direction
    # carries most of every row, such as a language model's last hidden layer).
    dedup_centre: bool = default_of("dedup_centre")
    capacity_factor: Optional[float] = Field(default_of("capacity_factor"), ge=1.0)
    capacity_neighbors: int = Field(default_of("capacity_neighbors"), ge=1)
    kmeans_n_init: int = Field(default_of("kmeans_n_init"), ge=1)
    kmeans_max_iter: int = Field(default_of("kmeans_max_iter"), ge=1)
    backend: str = default_of("backend")
    sharded_clustering: bool = default_of("sharded_clustering")
    allocation: str = default_of("allocation")
    weighting: str = default_of("weighting")
    # t in ((n_c/N) / (s_c/S)) ** t: 1 the unbiased weights, 0 none; between, less variance for some bias.
    weight_temperature: float = Field(default_of("weight_temperature"), ge=0.0, le=1.0)
    loss_reduction: Literal["sample", "token"] = default_of("loss_reduction")
    seed: int = Field(default_of("seed"), ge=0)
    analysis_path: Optional[str] = None
    feature_kind: str = default_of("feature_kind")
    feature_dim: Optional[int] = Field(default_of("feature_dim"), ge=1)
    normalize_features: bool = default_of("normalize_features")
    # A checkpoint folder used only to compute the features (its own forward-only engine and tokenizer).
    feature_model: Optional[str] = default_of("feature_model")
    feature_max_length: Optional[int] = Field(default_of("feature_max_length"), ge=2)
    # The schedule: "static" (a plan fixed before step 0) or "adaptive" (windows of adapt_every optimizer steps
    # whose per-cluster shares follow what the clusters' losses did in the window before; docs/adaptive.md).
    schedule: Literal["static", "adaptive"] = default_of("schedule")
    adaptive_rule: str = default_of("adaptive_rule")
    adapt_every: int = Field(default_of("adapt_every"), ge=1)
    adaptive_pool: Literal["all", "selected"] = default_of("adaptive_pool")
    probe_size: int = Field(default_of("probe_size"), ge=0)
    exploration: float = Field(default_of("exploration"), ge=0.0, le=1.0)
    auto_tolerance: float = Field(default_of("auto_tolerance"), ge=0.0, lt=1.0)
    auto_patience: int = Field(default_of("auto_patience"), ge=1)
    # budget_ratio "auto": what tells that a cluster stopped improving (planning/auto.py, docs/adaptive.md):
    # "relative" (its loss fell by auto_tolerance of its best), "curve" (a power law fitted to its last
    # auto_fit_windows losses predicts a loss at least auto_remaining lower, relatively, after as many steps again)
    # or "floor" (that curve falls by at least auto_floor nats over the next window).
    auto_signal: str = default_of("auto_signal")
    auto_fit_windows: int = Field(default_of("auto_fit_windows"), ge=2)
    auto_remaining: float = Field(default_of("auto_remaining"), ge=0.0, lt=1.0)
    auto_floor: float = Field(default_of("auto_floor"), ge=0.0)
    # budget_ratio "auto": once every cluster has stopped, the run goes on for this fraction of the steps it has
    # taken (whole windows, at least one) at the natural shares while the learning rate decays to 0
    # (lr_schedules.warmup_stable_decay); 0 ends the run at once. With auto_maintenance: a stopped cluster keeps
    # this fraction of its natural share (0: it is no longer drawn, and is forgotten). Both chosen on T0
    # validation (bench/results/real/quality_choose_auto.md); 0 and 0 failed there.
    auto_cooldown: float = Field(default_of("auto_cooldown"), ge=0.0, le=1.0)
    auto_maintenance: float = Field(default_of("auto_maintenance"), ge=0.0, lt=1.0)
    schedule_log: Optional[str] = None
    # Examples of what the user cares about, read by the targeted selections (round_robin, clusters).
    target: Optional[TargetConfig] = default_of("target")

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, values: Any) -> Any:
        # A preset fills what the user did not set; explicit keys always win.
        preset = values.get("preset") if isinstance(values, Mapping) else None
        if isinstance(preset, str) and preset in PRESETS:
            merged = dict(PRESETS[values["preset"]])
            merged.update(values)
            return merged
        return values

    @field_validator(*RULE_KEYS, mode="before")
    @classmethod
    def _names_a_rule(cls, value: Any, info: Any) -> Any:
        return RULE_REGISTRIES[info.field_name].check_name(value)

    @model_validator(mode="after")
    def _check_num_clusters(self) -> "ClusterSamplingConfig":
        if isinstance(self.num_clusters, int) and self.num_clusters < 1:
            raise ValueError(f"num_clusters must be >= 1 or 'auto', got {self.num_clusters}")
        return self

    @model_validator(mode="after")
    def _check_schedule(self) -> "ClusterSamplingConfig":
        if self.budget_ratio == "auto" and self.schedule != "adaptive":
            raise ValueError("budget_ratio 'auto' lets the run find its own budget, which only the adaptive schedule "
                             "does: set schedule 'adaptive', or give budget_ratio a number in (0, 1]")
        if self.schedule == "adaptive" and self.allocation != "stratified":
            raise ValueError("schedule 'adaptive' places every window with the stratified allocation: set allocation "
                             "'stratified' (or schedule 'static')")
        return self

    @model_validator(mode="after")
    def _check_target(self) -> "ClusterSamplingConfig":
        targeted = SELECTIONS.get_rule(self.selection).targeted
        if targeted and self.target is None:
            raise ValueError(f"selection {self.selection!r} takes the records most like a set of target examples: give "
                             "them as \"target\": {\"data\": \"examples.jsonl\"} (docs/targeted.md), or choose an "
                             "untargeted selection")
        if self.target is not None and not targeted:
            rules = ", ".join(repr(name) for name, rule in SELECTIONS.items() if rule.targeted)
            raise ValueError(f"a target is given but selection {self.selection!r} does not read it: set selection to "
                             f"{rules} (or remove the target)")
        if self.target is not None and self.schedule == "adaptive":
            raise ValueError("the adaptive schedule draws from every cluster by its training loss and does not read a "
                             "target: use schedule 'static' with a target (or remove the target)")
        if self.target is not None and self.sharded_clustering:
            raise ValueError("a targeted selection reads every feature row, which sharded_clustering keeps on their "
                             "own ranks: set sharded_clustering false with a target")
        return self

    def stages(self) -> StageSettings:
        """Every stage's settings, derived from this block: the one way a key reaches the code (ds_cluster.settings)."""
        values = self.model_dump()

        def derive(stage: type, **extra: Any) -> Any:
            return stage(**{item.name: values[item.metadata["key"]] for item in dataclasses.fields(stage)
                            if "key" in item.metadata}, **extra)

        default_log = (str(Path(self.analysis_path).absolute().parent / "schedule.jsonl")
                       if self.analysis_path else None)
        selection = dataclasses.replace(derive(SelectionSettings),
                                        target=self.target.settings() if self.target is not None else None)
        return StageSettings(features=derive(FeatureSettings), clustering=derive(ClusteringSettings),
                             selection=selection,
                             schedule=derive(ScheduleSettings, auto=self.budget_ratio == "auto",
                                             log_path=self.schedule_log or default_log),
                             loss=derive(LossSettings))

    # The stages' own readings, kept on the block for code written against 0.5.0.
    @property
    def planned_ratio(self) -> float:
        """`SelectionSettings.planned_ratio` of this block."""
        return self.stages().selection.planned_ratio

    def resolved_num_clusters(self, world_size: int) -> int:
        """`ClusteringSettings.resolved_num_clusters` of this block."""
        return self.stages().clustering.resolved_num_clusters(world_size)

    def plan_settings(self) -> dict[str, Any]:
        """`StageSettings.plan_record` of this block: what a plan records and fingerprints."""
        return self.stages().plan_record()

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_dict(cls, block: Mapping[str, Any], source: str = "cluster_sampling") -> "ClusterSamplingConfig":
        """Validate a `cluster_sampling` block, turning pydantic's errors into one clear ValueError."""
        if not isinstance(block, Mapping):
            raise ValueError(f"{source}: expected a JSON object, got {type(block).__name__}")
        unknown = [key for key in block if key not in cls.model_fields]
        if unknown:
            raise ValueError(_unknown_keys_message(unknown, source))
        try:
            return cls(**block)
        except ValidationError as err:
            raise ValueError(_validation_message(err, source)) from None

    @classmethod
    def from_ds_config(cls, ds_config: ConfigSource) -> "ClusterSamplingConfig":
        """Read the block from a DeepSpeed config (dict, JSON/HJSON path); absent block = disabled."""
        config_dict, source = read_ds_config(ds_config)
        block = cluster_block(config_dict)
        if block is None:
            return cls(enabled=False)
        return cls.from_dict(block, source=f"{source}: {'.'.join(BLOCK_PATH)}")


def _unknown_keys_message(unknown: list[str], source: str) -> str:
    allowed = sorted(ClusterSamplingConfig.model_fields)
    parts = []
    for key in unknown:
        close = difflib.get_close_matches(str(key), allowed, n=1, cutoff=0.6)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        parts.append(f"unknown key '{key}'{hint}")
    return f"{source}: {'; '.join(parts)}. Allowed keys: {', '.join(allowed)}"


def _validation_message(err: ValidationError, source: str) -> str:
    # A key that takes one of several types ("auto" or a number) reports one error per type: one line for the key.
    problems: dict[str, list[str]] = {}
    inputs: dict[str, Any] = {}
    for item in err.errors():
        key = str(item["loc"][0]) if item["loc"] else "(block)"
        if key == "target" and len(item["loc"]) > 1 and isinstance(item["loc"][1], str):
            key = f"target.{item['loc'][1]}"  # a key of the target sub-block
        problems.setdefault(key, []).append(item["msg"])
        inputs.setdefault(key, item.get("input"))
    return f"{source}: invalid value for " + "; ".join(
        f"'{key}': {', or '.join(messages)} (got {inputs[key]!r})" for key, messages in problems.items())
