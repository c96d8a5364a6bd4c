"""The selection as data: the kept records, each unchanged plus its `cluster` and `weight`, as JSONL or a Hugging
Face `datasets` folder, with a manifest beside it; optionally what was left out, for audit. For training with
any tool (axolotl, LLaMA-Factory, torchtune, a plain Trainer) instead of ds_cluster's own loader. Plain data in:
a plan and the records it was built from.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np

from ds_cluster.fileio import write_jsonl_atomic, write_text_atomic
from ds_cluster.planning.plan import Plan
from ds_cluster.planning.targeted import target_scores

logger = logging.getLogger(__name__)

EXPORT_FORMATS = ("jsonl", "datasets")
# The fields each exported record gains; a record that already has one is refused, never overwritten.
CLUSTER_FIELD, WEIGHT_FIELD = "cluster", "weight"
# With target examples: each record's similarity to the target, and the target of the example it is most like.
SCORE_FIELD, TARGET_FIELD = "target_score", "target_group"
MANIFEST_SUFFIX = ".manifest.json"


@dataclass(frozen=True)
class RecordScores:
    """Every record's score against an analysis's target examples: its largest cosine similarity to one of them, and
    that example's target (`record_scores`)."""

    score: np.ndarray
    target: Sequence[str]


def record_scores(features: np.ndarray, target: Any) -> RecordScores:
    """`RecordScores` of every row of `features` against `target` (an analysis's `AnalysedTarget`), in blocks."""
    scores, nearest = target_scores(features, np.arange(features.shape[0]), target)
    names = list(target.group_names)
    return RecordScores(scores, [names[int(group)] for group in nearest])


def manifest_path(out: Union[str, os.PathLike]) -> Path:
    """Where the manifest of an export at `out` lies: beside it, `<out>.manifest.json`."""
    out = Path(out)
    return out.with_name(out.name + MANIFEST_SUFFIX)


def export_subset(plan: Plan, records: Sequence[Mapping[str, Any]], out: Union[str, os.PathLike], *,
                  export_format: str = "jsonl", excluded: Optional[Union[str, os.PathLike]] = None,
                  sources: Optional[Mapping[str, Any]] = None, scores: Optional[RecordScores] = None
                  ) -> dict[str, Any]:
    """Write the plan's kept records to `out` (in their original order) and a manifest beside it; returns it.

    Each record is written unchanged with two fields added: `cluster` (its k-means cluster) and `weight` (its
    loss weight: the plan's per-sample weight, whose mean over the kept records is what the plan's weighting
    gives; multiply each record's loss by it to keep the full data's mix). `excluded`, when given, receives
    the records left out in the same form (weight 0; cluster -1 for records with no response token), always
    as JSONL. `sources` (the analysis, the config, the data) go into the manifest as they are. `scores` (an analysis
    made with target examples): each record also gains `target_score` (its largest cosine similarity to a target
    example) and `target_group` (that example's target).
    """
    if export_format not in EXPORT_FORMATS:
        raise ValueError(f"export format {export_format!r}: expected one of {', '.join(EXPORT_FORMATS)}")
    if len(records) != plan.num_samples:
        raise ValueError(f"the data has {len(records)} records but the plan {plan.num_samples} samples: "
                         "export the data the analysis was computed on")
    kept = np.zeros(plan.num_samples, dtype=bool)
    kept[plan.selected] = True
    def row(index: int, weight: float) -> dict[str, Any]:
        added = {CLUSTER_FIELD: int(plan.labels[index]), WEIGHT_FIELD: weight}
        if scores is not None:
            added.update({SCORE_FIELD: float(scores.score[index]), TARGET_FIELD: scores.target[index]})
        return _with_fields(records[index], index, added)

    kept_rows = [row(i, float(plan.weights[i])) for i in np.flatnonzero(kept)]
    out = Path(out)
    if export_format == "jsonl":
        write_jsonl_atomic(out, kept_rows)
    else:
        _save_dataset(kept_rows, out)
    if excluded is not None:
        write_jsonl_atomic(excluded, [row(i, 0.0) for i in np.flatnonzero(~kept)])
    summary = plan.summary()
    manifest = {
        "format": export_format,
        "path": str(out),
        "excluded_path": None if excluded is None else str(excluded),
        "plan_fingerprint": plan.fingerprint(),
        "num_records": plan.num_samples,
        "num_kept": int(kept.sum()),
        "num_excluded": int((~kept).sum()),
        "kept_fraction": summary["kept_fraction"],
        "clusters": [{"cluster": c, "size": int(plan.cluster_sizes[c]), "kept": int(plan.kept_sizes[c])}
                     for c in range(plan.num_clusters)],
        "fields_added": {CLUSTER_FIELD: "the record's k-means cluster (-1: no response token, never kept)",
                         WEIGHT_FIELD: "the record's loss weight (0 where not kept)",
                         **({SCORE_FIELD: "the record's largest cosine similarity to a target example",
                             TARGET_FIELD: "the target of that example"} if scores is not None else {})},
        "settings": plan.settings,
        "batch_shape": {key: summary[key] for key in ("world_size", "micro_batch_size",
                                                      "gradient_accumulation_steps")},
        "sources": dict(sources or {}),
    }
    write_text_atomic(manifest_path(out), json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    logger.info("exported %d of %d records to %s (%s), manifest %s", manifest["num_kept"], plan.num_samples, out,
                export_format, manifest_path(out))
    return manifest


def _with_fields(record: Mapping[str, Any], index: int, added: Mapping[str, Any]) -> dict[str, Any]:
    clashing = [name for name in added if name in record]
    if clashing:
        raise ValueError(f"record {index} already has a field named {clashing[0]!r}: the export adds "
                         f"{', '.join(repr(name) for name in added)}; rename that field in the data first")
    return {**record, **added}


def _save_dataset(rows: list[dict[str, Any]], out: Path) -> None:
    import datasets  # a dependency of the package; imported here so the JSONL export does not load it

    datasets.Dataset.from_list(rows).save_to_disk(str(out))
