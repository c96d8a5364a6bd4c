"""Target examples' features: the same extraction, engine and kind as an analysis's records (docs/targeted.md).

`extract_target(engine, examples, settings, collectives)` computes them (on every rank: collective under ZeRO-3; no
feature store, they are few). `retarget(engine, folder, examples, collectives)` gives an existing analysis another
target set: the examples' features computed with the feature settings the analysis records, by the model it records
(its fingerprint is checked), while the records' features, the clusters and the feature store stay as they are.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Union

from ds_cluster.analysis.folder import AnalysedTarget, AnalysisDir
from ds_cluster.collectives import LOCAL, Collectives
from ds_cluster.data.target import TargetExamples
from ds_cluster.features.extract import ExtractionOptions, extract
from ds_cluster.features.model_info import model_fingerprint
from ds_cluster.settings import FeatureSettings, stages_of

logger = logging.getLogger(__name__)


def extract_target(engine: Any, examples: TargetExamples, settings: Any, collectives: Collectives = LOCAL,
                   batch_size: int = 8) -> AnalysedTarget:
    """The target examples' features with `engine` and the features stage's settings (`settings`: FeatureSettings,
    the block or its StageSettings), as an analysis's records get theirs. Collective: every rank, the same
    arguments; `examples.dataset` must be what the engine reads (a feature model's re-encoding:
    `TargetExamples.encoded_with(FeatureSource.encode)`)."""
    features = settings if isinstance(settings, FeatureSettings) else stages_of(settings).features
    # The target's few rows stay in memory on every rank, whatever the pool's store does.
    result = extract(engine, examples.dataset, dataclasses.replace(features, sharded=False),
                     ExtractionOptions(batch_size=batch_size, show_progress=False), collectives)
    if result.empty_mask.any():  # read_target refuses examples without an answer: only a re-encoding can get here
        raise ValueError(f"target examples {result.empty_mask.nonzero()[0].tolist()} have no answer tokens as the "
                         "features read them: shorten their prompts, or raise the feature model's max length")
    return AnalysedTarget(features=result.features, groups=examples.groups, group_names=examples.group_names,
                          fingerprint=examples.fingerprint, source=examples.source, prompts=examples.prompts)


def recorded_feature_settings(folder: AnalysisDir) -> FeatureSettings:
    """The feature settings an analysis records (its manifest); ValueError for an analysis that records none."""
    manifest = folder.manifest() or {}
    missing = [key for key in ("kind", "dim", "seed", "normalize") if key not in manifest]
    if missing:
        raise ValueError(f"{folder.path} does not record how its features were computed (no {', '.join(missing)} in "
                         "its manifest: a hand-made analysis?), so a target's features cannot be made comparable "
                         "with them: rerun `ds-cluster analyze --target`, or let the job compute the analysis")
    return FeatureSettings(kind=manifest["kind"], dim=manifest["dim"], seed=manifest["seed"],
                           normalize=manifest["normalize"])


def retarget(engine: Any, folder: Union[AnalysisDir, str, os.PathLike], examples: TargetExamples,
             collectives: Collectives = LOCAL, batch_size: int = 8) -> AnalysedTarget:
    """Give the analysis `folder` the target set `examples`: their features with the analysis's feature settings and
    `engine` (which must be the model the analysis was made with), written into it by rank 0 (its records' features
    and clusters kept, the folder swapped whole). Collective; returns the target written."""
    folder = folder if isinstance(folder, AnalysisDir) else AnalysisDir(folder)
    settings = collectives.run_agreed("reading the analysis's feature settings",
                                      lambda: recorded_feature_settings(folder))
    recorded = (folder.manifest() or {}).get("model_fingerprint")
    if recorded is not None:
        computing = model_fingerprint(engine, collectives)  # collective under ZeRO-3

        def same_model() -> None:
            if computing != recorded:
                raise ValueError(f"{folder.path} was made with another model (fingerprint {recorded[:16]}, this one "
                                 f"{computing[:16]}): the target's features would not be comparable with its records'. "
                                 "Compute the analysis again with the target (remove the folder, or `ds-cluster "
                                 "analyze --target` with the model the job starts from)")

        collectives.run_agreed("checking the analysis's model", same_model)
    target = extract_target(engine, examples, settings, collectives, batch_size)
    collectives.run_agreed("writing the target into the analysis", lambda: folder.replace_target(target),
                           only_rank=0, errors=(ValueError, OSError))
    logger.info("%s: target features of %d examples (%s) computed and recorded; the records' features were kept",
                folder.path, len(examples.records), ", ".join(examples.group_names))
    return target
