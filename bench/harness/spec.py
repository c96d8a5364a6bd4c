"""The job's spec: what the parent (`launch.write_spec`) writes to WORK/spec.json and the job reads, typed.

One `JobSpec` holds the instrument, the data files, the DeepSpeed config and recipe, every analysis and arm (the
typed `Arm` and `Analysis`), and the calibration gate: which arms it reads, found by their kind (full data and the
random 30% subset of the first seed), never by their place in the list. Its JSON is exactly what the untyped spec
held, so a work folder's spec.json reads either way.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from bench.harness.arms import Analysis, Arm, Method

# The gate compares full data with a random subset of this fraction (bench/harness/gate.py).
GATE_FRACTION = 0.3


@dataclass(frozen=True)
class GateSpec:
    """The calibration gate: the instrument's kind, the arms it reads, and the smaller half of the families."""

    kind: str
    full: str
    random: str
    small_families: list

    @classmethod
    def of(cls, kind: str, arms: Sequence[Arm], small_families: list, seed: int) -> "GateSpec":
        """The gate of these arms: full data and the random subset of GATE_FRACTION on `seed` (the run's first)."""
        def found(method: Method, fraction: Optional[float]) -> str:
            for arm in arms:
                if (arm.method == method and arm.seed == seed and arm.fraction == fraction and arm.plain
                        and not arm.stretch):
                    return arm.name
            raise ValueError(f"the gate needs a {method} arm (fraction {fraction}, seed {seed}), and there is none")

        return cls(kind, found(Method.FULL, None), found(Method.RANDOM, GATE_FRACTION), list(small_families))

    def after(self, arms: Sequence[Arm]) -> str:
        """The arm after which the gate is checked: the later of its two."""
        names = [arm.name for arm in arms]
        return max((self.full, self.random), key=names.index)


@dataclass(frozen=True)
class JobSpec:
    """Everything the job reads (WORK/spec.json)."""

    instrument: str
    work_dir: str
    base_model: str
    paths: Mapping[str, str]  # "train", "validation", "heldout": the data files
    num_train: int
    exact_match_families: list
    ds_config: Mapping[str, Any]
    learning_rate: float
    warmup_fraction: float
    max_length: int
    precision: str
    copy_probe_records: int
    copy_probe_seed: int
    peft: str
    lora_rank: int
    evaluate_splits: list
    analyses: Mapping[str, Analysis]
    arms: list
    launched_at: float
    skipped: list
    gate: GateSpec
    gate_after: str
    per_record: bool = False  # the targeted instrument: every record's answer loss in each arm's result
    extra: Mapping[str, Any] = field(default_factory=dict)  # keys of a spec written by a later harness

    @property
    def work(self) -> Path:
        return Path(self.work_dir)

    def path(self, split: str) -> str:
        return self.paths[split]

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over the job's two ranks."""
        from bench.harness.instrument import WORLD_SIZE

        return (self.ds_config["train_micro_batch_size_per_gpu"] * WORLD_SIZE
                * self.ds_config.get("gradient_accumulation_steps", 1))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"instrument": self.instrument, "work_dir": self.work_dir, "base_model": self.base_model,
                               **self.paths}
        out.update(num_train=self.num_train, exact_match_families=self.exact_match_families,
                   ds_config=self.ds_config, learning_rate=self.learning_rate, warmup_fraction=self.warmup_fraction,
                   max_length=self.max_length, precision=self.precision, copy_probe_records=self.copy_probe_records,
                   copy_probe_seed=self.copy_probe_seed, peft=self.peft, lora_rank=self.lora_rank,
                   evaluate_splits=self.evaluate_splits,
                   analyses={name: analysis.to_json() for name, analysis in self.analyses.items()},
                   arms=[arm.to_json() for arm in self.arms], launched_at=self.launched_at, skipped=self.skipped,
                   gate={"kind": self.gate.kind, "full": self.gate.full, "random": self.gate.random,
                         "small_families": self.gate.small_families},
                   gate_after=self.gate_after, **self.extra)
        if self.per_record:
            out["per_record"] = True
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "JobSpec":
        known = {"instrument", "work_dir", "base_model", "train", "validation", "heldout", "num_train",
                 "exact_match_families", "ds_config", "learning_rate", "warmup_fraction", "max_length", "precision",
                 "copy_probe_records", "copy_probe_seed", "peft", "lora_rank", "evaluate_splits", "analyses", "arms",
                 "launched_at", "skipped", "gate", "gate_after", "per_record"}
        gate = data["gate"]
        return cls(instrument=data["instrument"], work_dir=data["work_dir"], base_model=data["base_model"],
                   paths={split: data[split] for split in ("train", "validation", "heldout") if split in data},
                   num_train=data["num_train"], exact_match_families=list(data["exact_match_families"]),
                   ds_config=data["ds_config"], learning_rate=data["learning_rate"],
                   warmup_fraction=data["warmup_fraction"], max_length=data["max_length"],
                   precision=data.get("precision", "fp32"), copy_probe_records=data["copy_probe_records"],
                   copy_probe_seed=data["copy_probe_seed"], peft=data.get("peft", "none"),
                   lora_rank=data.get("lora_rank", 0), evaluate_splits=list(data["evaluate_splits"]),
                   analyses={name: Analysis.from_json(entry) for name, entry in data["analyses"].items()},
                   arms=[Arm.from_json(arm) for arm in data["arms"]], launched_at=data["launched_at"],
                   skipped=list(data.get("skipped") or []),
                   gate=GateSpec(gate.get("kind", "synthetic"), gate["full"], gate["random"],
                                 list(gate.get("small_families") or [])),
                   gate_after=data["gate_after"], per_record=bool(data.get("per_record")),
                   extra={k: v for k, v in data.items() if k not in known})

    @classmethod
    def read(cls, path: Path) -> "JobSpec":
        return cls.from_json(json.loads(Path(path).read_text()))

    def write(self, path: Path) -> Path:
        Path(path).write_text(json.dumps(self.to_json(), indent=1, default=str))
        return Path(path)
