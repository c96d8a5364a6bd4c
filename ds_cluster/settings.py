"""Each stage's settings: plain frozen dataclasses, derived once from the `cluster_sampling` block.

`config.ClusterSamplingConfig.stages()` validates the block and derives a `StageSettings`: one settings
object per stage (features, clustering, selection with its budget and weights, the schedule, the loss).
A stage is handed its own object and imports only its type, never the block, so a key reaches the code
one way. The floors below `config.py` (features, clustering, analysis, planning) read these types only.

Every field a plan depends on names its key in the block (`key` in the field's metadata). A plan records
and fingerprints what the stages declare (`StageSettings.plan_record`), so a key added to a stage is in the
fingerprint without a second list to keep. Keys added after plans were first fingerprinted are recorded only
when set away from the default they had then (`unrecorded` in the metadata): a plan built without them keeps
its fingerprint, and its checkpoints resume.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Optional, Union

_NOT_SET = object()
# `unrecorded=AT_DEFAULT`: a plan leaves the key out at its default. Should a default ever change, write the old
# default there instead, so that plans made before keep their fingerprints.
AT_DEFAULT = object()


# The keys more than one stage reads, with their one default.
SHARED_DEFAULTS: dict[str, Any] = {"seed": 1234, "sharded_clustering": False, "weighting": "cluster",
                                   "weight_temperature": 1.0}


def declared(key: str, default: Any = dataclasses.MISSING, *, unrecorded: Any = _NOT_SET) -> Any:
    """A settings field read from the block's `key`, with its default: the one place a key's default is written
    (the block's model, the presets and the stages read it here, `default_of`). `unrecorded`: the value at which a
    plan leaves it out."""
    if unrecorded is AT_DEFAULT:
        unrecorded = default
    metadata = {"key": key} if unrecorded is _NOT_SET else {"key": key, "unrecorded": unrecorded}
    return field(default=default, metadata=metadata)


class _Declared:
    """What every stage's settings share: their declared block keys and values."""

    def block_values(self) -> dict[str, Any]:
        """{block key: value} of the fields that name a key (all of them, defaults included)."""
        return {item.metadata["key"]: getattr(self, item.name) for item in dataclasses.fields(self)  # type: ignore
                if "key" in item.metadata}

    def recorded(self) -> dict[str, Any]:
        """What a plan records of this stage: `block_values`, less the keys still at their unrecorded value."""
        out = {}
        for item in dataclasses.fields(self):  # type: ignore[arg-type]
            if "key" not in item.metadata:
                continue
            value = getattr(self, item.name)
            if "unrecorded" in item.metadata and value == item.metadata["unrecorded"]:
                continue
            out[item.metadata["key"]] = value.recorded() if isinstance(value, _Declared) else value
        return out

    @classmethod
    def declared_keys(cls) -> tuple[str, ...]:
        return tuple(item.metadata["key"] for item in dataclasses.fields(cls) if "key" in item.metadata)  # type: ignore


@dataclass(frozen=True)
class TargetSettings(_Declared):
    """The `target` sub-block: a file of examples of what the user cares about (docs/targeted.md). `data` is where
    they are read, so a plan never records it (their content's fingerprint, `target_fingerprint`, is what a plan and
    an analysis record); its keys are `target.<key>` to `default_of`."""

    data: str = ""
    # The record field naming which target an example belongs to (several targets in one file); records without it
    # form one target of their own.
    group_field: Optional[str] = declared("group_field", None)
    # The fewest examples a target may have.
    min_examples: int = declared("min_examples", 1)
    # The targets the file must hold (each with at least min_examples); None: whatever groups it holds.
    groups: Optional[tuple[str, ...]] = declared("groups", None)
    # selection "clusters": every cluster keeps at least this many records (0 lets a cluster go unvisited).
    cluster_floor: int = declared("cluster_floor", 1)


@dataclass(frozen=True)
class FeatureSettings(_Declared):
    """What the features stage reads: the kind, its dimension, normalisation, the projection seed, and a separate
    feature model (a checkpoint and its token length) when the features are not the trained model's own."""

    kind: str = declared("feature_kind", "lm_head")
    dim: Optional[int] = declared("feature_dim", None)
    normalize: bool = declared("normalize_features", True)
    seed: int = declared("seed", SHARED_DEFAULTS["seed"])
    model: Optional[str] = declared("feature_model", None)
    max_length: Optional[int] = declared("feature_max_length", None)
    # Sharded clustering keeps each rank's own feature rows instead of gathering them.
    sharded: bool = declared("sharded_clustering", SHARED_DEFAULTS["sharded_clustering"])


@dataclass(frozen=True)
class ClusteringSettings(_Declared):
    """k-means: K ("auto" = the data-parallel world size), restarts, iterations, the capacity cap, the back-end."""

    num_clusters: Union[Literal["auto"], int] = declared("num_clusters", 8)
    n_init: int = declared("kmeans_n_init", 10)
    max_iter: int = declared("kmeans_max_iter", 300)
    capacity_factor: Optional[float] = declared("capacity_factor", None)
    capacity_neighbors: int = declared("capacity_neighbors", 8)
    backend: str = declared("backend", "sklearn")
    sharded: bool = declared("sharded_clustering", SHARED_DEFAULTS["sharded_clustering"])
    seed: int = declared("seed", SHARED_DEFAULTS["seed"])

    def resolved_num_clusters(self, world_size: int) -> int:
        """K: the configured number, or the data-parallel world size for "auto"."""
        return int(world_size) if self.num_clusters == "auto" else int(self.num_clusters)

    def kmeans_arguments(self, world_size: int) -> dict[str, Any]:
        """The keyword arguments of one k-means call (`clustering.kmeans.cluster_features`, less the back-end),
        in one process or sharded over the ranks."""
        return {"num_clusters": self.resolved_num_clusters(world_size), "seed": self.seed, "n_init": self.n_init,
                "max_iter": self.max_iter, "capacity_factor": self.capacity_factor,
                "capacity_neighbors": self.capacity_neighbors}


@dataclass(frozen=True)
class SelectionSettings(_Declared):
    """The planner's middle: the budget per cluster, the selection inside a cluster, the loss weights and the
    placement over steps, ranks and micro-steps."""

    budget_mode: str = declared("budget_mode", "neyman")
    budget_ratio: Union[Literal["auto"], float] = declared("budget_ratio", 1.0)
    budget_samples: Optional[int] = declared("budget_samples", None)
    selection: str = declared("selection", "random")
    dedup_similarity: float = declared("dedup_similarity", 0.95, unrecorded=AT_DEFAULT)
    # Whether the near-duplicate test reads the rows less the pool's mean unit row (anisotropic features).
    dedup_centre: bool = declared("dedup_centre", False, unrecorded=AT_DEFAULT)
    # The target examples a targeted selection ("round_robin", "clusters") reads; None: no target.
    target: Optional[TargetSettings] = declared("target", None, unrecorded=AT_DEFAULT)
    weighting: str = declared("weighting", SHARED_DEFAULTS["weighting"])
    weight_temperature: float = declared("weight_temperature", SHARED_DEFAULTS["weight_temperature"],
                                         unrecorded=AT_DEFAULT)
    allocation: str = declared("allocation", "stratified")
    seed: int = declared("seed", SHARED_DEFAULTS["seed"])

    @property
    def planned_ratio(self) -> float:
        """The budget ratio the plan is built with: everything for "auto" (the schedule decides what is used)."""
        return 1.0 if self.budget_ratio == "auto" else float(self.budget_ratio)


@dataclass(frozen=True)
class ScheduleSettings(_Declared):
    """The schedule: "static" (the plan, fixed before step 0) or "adaptive" (windows of `adapt_every` optimizer
    steps at shares that follow the clusters' losses; docs/adaptive.md), and the adaptive schedule's keys.
    It weights each window itself, so it reads the weighting rule and its temperature too."""

    kind: Literal["static", "adaptive"] = declared("schedule", "static", unrecorded=AT_DEFAULT)
    rule: str = declared("adaptive_rule", "loss", unrecorded=AT_DEFAULT)
    adapt_every: int = declared("adapt_every", 10, unrecorded=AT_DEFAULT)
    pool: Literal["all", "selected"] = declared("adaptive_pool", "all", unrecorded=AT_DEFAULT)
    probe_size: int = declared("probe_size", 4, unrecorded=AT_DEFAULT)
    exploration: float = declared("exploration", 0.1, unrecorded=AT_DEFAULT)
    tolerance: float = declared("auto_tolerance", 0.03, unrecorded=AT_DEFAULT)
    patience: int = declared("auto_patience", 3, unrecorded=AT_DEFAULT)
    signal: str = declared("auto_signal", "relative", unrecorded=AT_DEFAULT)
    fit_windows: int = declared("auto_fit_windows", 8, unrecorded=AT_DEFAULT)
    remaining: float = declared("auto_remaining", 0.2, unrecorded=AT_DEFAULT)
    floor: float = declared("auto_floor", 0.02, unrecorded=AT_DEFAULT)
    cooldown: float = declared("auto_cooldown", 0.2, unrecorded=AT_DEFAULT)
    maintenance: float = declared("auto_maintenance", 0.25, unrecorded=AT_DEFAULT)
    weighting: str = declared("weighting", SHARED_DEFAULTS["weighting"])
    temperature: float = declared("weight_temperature", SHARED_DEFAULTS["weight_temperature"], unrecorded=AT_DEFAULT)
    # Not block keys of their own: budget_ratio "auto", and where the log goes (schedule_log, else beside the
    # analysis folder); neither changes the plan.
    auto: bool = False
    log_path: Optional[str] = None

    @property
    def adaptive(self) -> bool:
        return self.kind == "adaptive"


@dataclass(frozen=True)
class LossSettings(_Declared):
    """The weighted loss's reduction: "token" (the global batch's response tokens) or "sample"."""

    reduction: Literal["sample", "token"] = declared("loss_reduction", "token")

    @classmethod
    def recorded_in(cls, record: Mapping[str, Any]) -> "LossSettings":
        """The reduction a plan was built with (its `settings`); the default for a plan that records none (made by
        hand)."""
        key = cls.declared_keys()[0]
        return cls(reduction=record[key]) if key in record else cls()


@dataclass(frozen=True)
class StageSettings:
    """Every stage's settings, derived once from one block (`ClusterSamplingConfig.stages()`)."""

    features: FeatureSettings = field(default_factory=FeatureSettings)
    clustering: ClusteringSettings = field(default_factory=ClusteringSettings)
    selection: SelectionSettings = field(default_factory=SelectionSettings)
    schedule: ScheduleSettings = field(default_factory=ScheduleSettings)
    loss: LossSettings = field(default_factory=LossSettings)

    def stages(self) -> "StageSettings":
        """Itself: whatever takes a block's stages takes these too."""
        return self

    def plan_record(self) -> dict[str, Any]:
        """What a plan records and fingerprints: every stage's declared keys (`recorded`). A key two stages
        declare (the seed, say) holds one value."""
        record: dict[str, Any] = {}
        for stage in (self.features, self.clustering, self.selection, self.schedule, self.loss):
            for key, value in stage.recorded().items():
                if key in record and record[key] != value:
                    raise ValueError(f"two stages hold different values of {key!r}: {record[key]!r} and {value!r}")
                record[key] = value
        return record

    @staticmethod
    def declared_keys() -> set[str]:
        """Every block key some stage reads."""
        return {key for stage in STAGE_TYPES for key in stage.declared_keys()}


STAGE_TYPES = (FeatureSettings, ClusteringSettings, SelectionSettings, ScheduleSettings, LossSettings)


def default_of(key: str) -> Any:
    """The default of a block key, as the stage that reads it declares it (every stage that declares it agrees:
    tests/test_config.py); a key of the target sub-block as `target.<key>`."""
    if key.startswith("target."):
        for item in dataclasses.fields(TargetSettings):
            if item.metadata.get("key") == key.removeprefix("target."):
                return item.default
        raise KeyError(f"the target sub-block has no key {key.removeprefix('target.')!r}")
    for stage in STAGE_TYPES:
        for item in dataclasses.fields(stage):
            if item.metadata.get("key") == key:
                return item.default
    raise KeyError(f"no stage reads the block key {key!r}")


def stages_of(settings: Any) -> StageSettings:
    """The stages' settings of a `ClusterSamplingConfig` or a `StageSettings` (what the public entry points take)."""
    stages = getattr(settings, "stages", None)
    if stages is None:
        raise TypeError(f"expected a ClusterSamplingConfig or StageSettings, got {type(settings).__name__}")
    return stages()
