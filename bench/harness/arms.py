"""The typed arms and analyses of a quality run, exactly as the job's spec (WORK/spec.json) and each finished
arm's record (WORK/arms/NAME.json, its "arm") hold them, and how a setting is named.

An arm is one method trained on one seed; a setting is the arm of every seed (its name without `_sSEED`). Each
arm also carries what it was built as (`changes`, `candidate`, `source`): the summary pairs settings by these
and by the spec's own fields, never by reading names.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Mapping, Optional


class Method(str, Enum):
    """The benchmark's own methods (an arm of a declared candidate is named by its candidate instead); a str, so an
    arm's JSON holds the plain name."""

    FULL = "full"
    FULL_CUT = "full_cut"
    RANDOM = "random"
    PAPER = "paper"
    RECOMMENDED = "recommended"
    RECOMMENDED_SMALL = "recommended_small"
    RECOMMENDED_SMOLLM2 = "recommended_smollm2"
    RECOMMENDED_LORA = "recommended_lora"
    ORACLE = "oracle"
    NEARDUP = "neardup"
    ADAPTIVE = "adaptive"
    AUTO = "auto"

    def __str__(self) -> str:
        return self.value


# The methods of the recommended preset: on the trained model's own features, or a feature model's.
RECOMMENDED_METHODS = (Method.RECOMMENDED, Method.RECOMMENDED_SMALL, Method.RECOMMENDED_SMOLLM2)
FULL_DATA_METHODS = (Method.FULL, Method.FULL_CUT)


# The feature models an arm may read besides the trained model's own ("own").
FEATURE_SOURCES = ("smollm2", "small", "lora")
# The built-in methods on a feature model's features.
SOURCED_METHODS: dict[str, tuple[str, str]] = {Method.RECOMMENDED_SMALL: (Method.RECOMMENDED, "small"),
                                               Method.RECOMMENDED_SMOLLM2: (Method.RECOMMENDED, "smollm2"),
                                               Method.RECOMMENDED_LORA: (Method.RECOMMENDED, "lora")}


def kind_and_source(kind: str, candidates: Mapping[str, Any]) -> tuple[str, str]:
    """(the method or declared candidate, the feature source) an arm kind names: a built-in method, a declared
    candidate, or a declared candidate on a feature model's features (NAME_SOURCE, declared by the candidate list
    and FEATURE_SOURCES); looked up among the declared names, never cut out of the name."""
    table: dict[str, tuple[str, str]] = dict(SOURCED_METHODS)
    for name in candidates:
        table[name] = (name, "own")
        table.update({f"{name}_{source}": (name, source) for source in FEATURE_SOURCES})
    return table.get(kind, (kind, "own"))


def setting_name(kind: str, fraction: float, stretch: bool = False,
                 changes: Optional[Mapping[str, Any]] = None) -> str:
    """The one way a subset setting is named: `KIND[_steps]_fF[_key-value...]`, e.g. paper_f0.3_weighting-none."""
    return (f"{kind}{'_steps' if stretch else ''}_f{fraction:g}"
            + "".join(f"_{key}-{value}" for key, value in (changes or {}).items()))


def arm_name(setting: str, seed: int) -> str:
    return f"{setting}_s{seed}"


def partner_setting(setting: str) -> str:
    """The random subset made for one ablation row, of exactly its kept count: random_as_SETTING."""
    return f"random_as_{setting}"


def budget_ratio_setting(ratio: float) -> str:
    """The paper preset at budget_ratio r itself (no fraction: r sets the count)."""
    return f"paper_budget_ratio-{ratio:g}"


@dataclass(frozen=True)
class Match:
    """Whose kept count an arm takes (the job's `resolve_arm`): `fraction` of the analysis's data, as the paper
    preset keeps it per cluster, or the paper preset's own count at `budget_ratio`."""

    analysis: str
    fraction: Optional[float] = None
    budget_ratio: Optional[float] = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"analysis": self.analysis}
        if self.fraction is not None:
            out["fraction"] = self.fraction
        if self.budget_ratio is not None:
            out["budget_ratio"] = self.budget_ratio
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Match":
        return cls(data["analysis"], data.get("fraction"), data.get("budget_ratio"))


@dataclass(frozen=True)
class Arm:
    """One arm: a method, a seed, the analysis it reads and its cluster_sampling block.

    The fields up to `steps` are the spec's (`to_json`); `changes`, `candidate` and `source` say what the arm was
    built as. They are implied by the spec's fields (the block, the setting) but not written there, so an arm read
    back with `from_json` has their defaults, and equality leaves them out.
    """

    name: str
    setting: str
    method: str
    seed: int
    analysis: str
    fraction: Optional[float]  # the kept fraction it is matched to; None: full data, auto, the budget-ratio rows
    cluster_sampling: Mapping[str, Any]
    epochs: int
    match: Optional[Match] = None
    cut: bool = False  # stopped at the matched subset's step count
    stretch: bool = False  # trained to full data's step count (equal steps)
    baseline: Optional[str] = None  # the random setting it is paired with, when not its fraction's random subset
    steps: Optional[int] = None  # a fixed step count (the job honours one; no builder sets it)
    # What the ablation changed of its method's block, e.g. (("weighting", "none"),).
    changes: tuple[tuple[str, Any], ...] = field(default=(), compare=False)
    candidate: Optional[str] = field(default=None, compare=False)  # the declared candidate it runs (--choose*)
    source: str = field(default="own", compare=False)  # its features: "own", "small", "smollm2" or "lora"
    target: Optional[str] = None  # the targeted instrument: the target it selects for (None: a shared baseline)

    @property
    def is_partner(self) -> bool:
        """A random subset made for one ablation row only (random_as_SETTING): its own baseline."""
        return self.baseline == self.setting

    @property
    def plain(self) -> bool:
        """Its method as built, unchanged: not an ablation row, its partner or a candidate."""
        return not self.changes and self.baseline is None and self.candidate is None

    @property
    def adaptive(self) -> bool:
        """Whether it runs the adaptive schedule (the loader's share of its loop is then reported per setting)."""
        return self.cluster_sampling.get("schedule") == "adaptive"

    @property
    def row_group(self) -> Optional[str]:
        """The group of rows the report lists its setting in (`METHOD_ORDER`); None: after them, by name (the
        candidates, the ablations' own random partners, the budget-ratio rows)."""
        if self.candidate is not None or self.is_partner or (self.fraction is None and self.method == Method.PAPER):
            return None
        return f"{self.method}_steps" if self.stretch else self.method

    def to_json(self) -> dict[str, Any]:
        """The arm as the spec and the arm's record hold it (the keys in the order they were always written)."""
        out: dict[str, Any] = {"name": self.name, "setting": self.setting, "method": self.method, "seed": self.seed,
                               "analysis": self.analysis, "fraction": self.fraction,
                               "cluster_sampling": dict(self.cluster_sampling)}
        # full_cut was always written "cut" before its match, the adaptive arms after it.
        if self.cut and self.method == Method.FULL_CUT:
            out["cut"] = True
        if self.match is not None:
            out["match"] = self.match.to_json()
        if self.stretch:
            out["stretch"] = True
        if self.cut and self.method != Method.FULL_CUT:
            out["cut"] = True
        if self.baseline is not None:
            out["baseline"] = self.baseline
        if self.steps is not None:
            out["steps"] = self.steps
        out["epochs"] = self.epochs
        if self.target is not None:
            out["target"] = self.target
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Arm":
        return cls(name=data["name"], setting=data["setting"], method=data["method"], seed=data["seed"],
                   analysis=data["analysis"], fraction=data["fraction"],
                   cluster_sampling=dict(data["cluster_sampling"]), epochs=data["epochs"],
                   match=Match.from_json(data["match"]) if data.get("match") else None,
                   cut=bool(data.get("cut")), stretch=bool(data.get("stretch")), baseline=data.get("baseline"),
                   steps=data.get("steps"), target=data.get("target"))


@dataclass(frozen=True)
class Analysis:
    """One analysis arms read: labels prepare_data wrote (a path only), one feature model's features of the
    training data (`source`, `model`), a k-means clustering of such features (`features`, `cluster_sampling`), or
    a near-duplicate subset (`near_duplicates`, `seed`)."""

    path: str
    # features: "own" (the trained model), "small" or "smollm2" (a feature model), "lora" (own with adapters)
    source: Optional[str] = None
    model: Optional[str] = None  # features: the checkpoint they are computed with
    feature_max_length: Optional[int] = None  # features of a feature model: its tokens per sample
    cluster_sampling: Optional[Mapping[str, Any]] = None  # the block's feature (or clustering) settings
    features: Optional[str] = None  # clustering: the feature analysis it clusters
    keep_features: bool = False  # clustering: a selection that reads features uses it
    near_duplicates: Optional[str] = None  # near-duplicate subset: the groups' folder
    seed: Optional[int] = None  # near-duplicate subset: the seed of its pick
    target: Optional[str] = None  # clustering: a target file whose examples' features the analysis holds too
    leave_out: Optional[tuple] = None  # clustering: task groups out of the pool (a transfer target's)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"path": self.path}
        for key in ("source", "model", "feature_max_length", "cluster_sampling", "features"):
            if getattr(self, key) is not None:
                out[key] = dict(self.cluster_sampling) if key == "cluster_sampling" else getattr(self, key)
        if self.keep_features:
            out["keep_features"] = True
        for key in ("near_duplicates", "seed", "target"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.leave_out:
            out["leave_out"] = list(self.leave_out)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Analysis":
        return cls(**{key: (tuple(data[key]) if key == "leave_out" else data[key]) for key in data})
