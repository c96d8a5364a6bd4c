"""The analysis stage: features from a DeepSpeed engine, clusters, and an analysis folder.

`analyze(engine, dataset, out_dir, settings)` runs on every rank: the ranks
share feature extraction (through a resumable feature store), rank 0
clusters and writes the folder (`write_analysis`, the one writer of an
analysis from features), and every rank returns the result (the summary and
the timings). `ds-cluster analyze` calls it with an engine built for forward
passes only; a training job calls it with its own engine when its analysis
does not exist yet.
"""
from __future__ import annotations

import dataclasses
import gc
import logging
import os
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np

from ds_cluster.analysis.folder import AnalysedTarget, AnalysisDir, AnalysisTimings
from ds_cluster.analysis.target import extract_target
from ds_cluster.clustering.kmeans import ClusterResult, category_counts, cluster_with, purity, spread_to_all
from ds_cluster.collectives import LOCAL, Collectives
from ds_cluster.data.dataset import dataset_fingerprint, records_source
from ds_cluster.data.target import TargetExamples
from ds_cluster.features.extract import ExtractionOptions, ExtractionResult, extract
from ds_cluster.features.store import DEFAULT_SHARD_SIZE
from ds_cluster.phases import phase, release_freed_memory
from ds_cluster.settings import ClusteringSettings, stages_of

logger = logging.getLogger(__name__)



@dataclass(frozen=True)
class AnalysedData:
    """The training data an analysis is of, when the features read a re-encoding of it (a feature model's tokens):
    the manifest records its fingerprint and where its records can be read again."""

    records: Sequence[Any]
    fingerprint: Optional[str] = None  # computed from `records` when not given


@dataclass(frozen=True)
class AnalysisOptions:
    """How an analysis runs, not what it computes (that is the stages' settings): the micro batch of the features
    pass, the feature store (default `out_dir/.feature_store`; `recompute` discards it) and its shard size, the
    progress bar (rank 0), what the manifest records beside the settings (`provenance`: model, data paths...),
    the training data when `dataset` is its re-encoding (`of_data`), target examples (`target`), and whether
    k-means runs in a child process (`kmeans_in_child`: a training job's, so that its rank keeps none of
    scikit-learn's imports)."""

    batch_size: int = 8
    store_dir: Union[None, str, os.PathLike] = None
    recompute: bool = False
    shard_size: int = DEFAULT_SHARD_SIZE
    show_progress: bool = True
    provenance: Mapping[str, Any] = field(default_factory=dict)
    of_data: Optional[AnalysedData] = None
    # Target examples (as the features read them) whose features the analysis records too (docs/targeted.md).
    target: Optional[TargetExamples] = None
    kmeans_in_child: bool = False


@dataclass(frozen=True)
class AnalysisResult:
    """What an analysis wrote: its summary (summary.json, as written) and its parts' timings."""

    path: Path
    summary: dict[str, Any]
    timings: AnalysisTimings


def analyze(engine: Any, dataset: Sequence[Any], out_dir: Union[str, os.PathLike], settings: Any,
            options: Optional[AnalysisOptions] = None, collectives: Collectives = LOCAL) -> AnalysisResult:
    """Extract features with `engine`, cluster them, and write the analysis folder `out_dir`.

    Collective: call on every rank with the same arguments. `settings`: the `cluster_sampling` block (a
    ClusterSamplingConfig) or its `StageSettings`: the features and clustering stages' settings are read (K is the
    clustering's `resolved_num_clusters(world_size)`). `collectives`: this rank among the ranks sharing the work
    (`ds_cluster.distributed.collectives()` in a job). Returns the same result on every rank.
    """
    started = time.perf_counter()
    options = options or AnalysisOptions()
    stages = stages_of(settings)
    features, clustering = stages.features, stages.clustering
    folder = AnalysisDir(out_dir)
    store_path = Path(options.store_dir) if options.store_dir is not None else folder.store_path()
    target = options.of_data.records if options.of_data is not None else dataset
    target_fingerprint = ((options.of_data.fingerprint if options.of_data is not None else None)
                          or dataset_fingerprint(target))
    # The features pass starts from what the job holds, not from what loading the model freed and glibc kept (0.3 GB
    # on one rank of a 1.7B ZeRO-3 job); later phases start where the one before released.
    release_freed_memory()
    with phase(f"features {features.kind}"):
        extraction = extract(engine, dataset, features,
                             ExtractionOptions(batch_size=options.batch_size, store=store_path,
                                               show_progress=options.show_progress, shard_size=options.shard_size,
                                               overwrite=options.recompute,
                                               fingerprint=target_fingerprint if target is dataset else None),
                             collectives)
        target_examples = (extract_target(engine, options.target, features, collectives, options.batch_size)
                           if options.target is not None else None)
    extracted = time.perf_counter()
    gc.collect()
    with phase("k-means"):  # and rank 0 writing the folder
        clusters = _sharded_clusters(extraction, clustering, collectives) if clustering.sharded else None
        # The training config's stage when the caller names it (a forward-only engine runs 1 and 2 as 0).
        stage = engine.zero_optimization_stage() if hasattr(engine, "zero_optimization_stage") else None
        timings = AnalysisTimings(extract=extracted - started, extract_forward=extraction.timings.get("forward", 0.0),
                                  extract_features=extraction.timings.get("features", 0.0))
        written = AnalysedFeatures(extraction.features, extraction.empty_mask, extraction.kind, extraction.dim,
                                   rows=extraction.rows, shards=(extraction.computed_shards, extraction.reused_shards),
                                   model_fingerprint=extraction.manifest.model_fingerprint if extraction.manifest
                                   else None, store=store_path)
        # Rank 0 clusters and writes; the agreement is also the barrier: the folder is written when it completes.
        collectives.run_agreed(
            "clustering and writing the analysis",
            lambda: write_analysis(folder, written, stages, AnalysedData(target, target_fingerprint),
                                   collectives.world_size, timings=timings,
                                   provenance={"zero_stage": stage, **options.provenance}, clusters=clusters,
                                   target=target_examples, kmeans_in_child=options.kmeans_in_child),
            only_rank=0, errors=(ValueError, OSError, RuntimeError))
    summary = folder.summary()
    assert summary is not None
    return AnalysisResult(folder.path, summary, AnalysisTimings.from_json(summary["timings_s"]))


def _summary(features: AnalysedFeatures, data: AnalysedData, labels: np.ndarray, clusters: ClusterResult,
             num_clusters: int, world_size: int, timings: AnalysisTimings, zero_stage: Any) -> dict[str, Any]:
    """summary.json of an analysis (its total time is added last)."""
    num_samples = len(data.records)
    summary: dict[str, Any] = {
        "num_samples": num_samples, "num_empty": int(features.empty_mask.sum()), "kind": features.kind,
        "dim": features.dim, "num_clusters": num_clusters,
        "cluster_sizes": np.bincount(clusters.labels, minlength=num_clusters).tolist(),
        "world_size": world_size, "zero_stage": zero_stage,
        "computed_shards": features.shards[0], "reused_shards": features.shards[1],
        "timings_s": {name: round(value, 3) for name, value in timings.to_json().items() if name != "total"},
        "extract_samples_per_s": round(num_samples / max(timings.extract, 1e-9), 2),
    }
    # A category per sample (a task family, say) when the dataset carries them: for the purity in the summary.
    categories = getattr(data.records, "categories", None)
    if categories is not None and any(categories):
        names, counts = category_counts(labels, categories, num_clusters)
        summary.update(purity=purity(counts), cluster_categories=[
            {name: int(count) for name, count in zip(names, row) if count} for row in counts])
    return summary


def _sharded_clusters(extraction: ExtractionResult, clustering: ClusteringSettings, collectives: Collectives
                      ) -> ClusterResult:
    """k-means over every rank's own rows together (collective); the result for the samples with response tokens."""
    from ds_cluster.clustering.sharded import cluster_sharded

    has_response = ~np.asarray(extraction.empty_mask, dtype=bool)
    assert extraction.rows is not None
    own_with_response = has_response[extraction.rows]
    result = cluster_sharded(extraction.rows[own_with_response], extraction.features[own_with_response],
                             int(extraction.empty_mask.size), clustering, collectives)
    # all_rows are exactly the samples with response tokens, ascending: the order rank 0 writes them in.
    return ClusterResult(result.all_labels, result.centroids, result.all_distances)


@dataclass(frozen=True)
class AnalysedFeatures:
    """Features of every sample, ready to be clustered and written: the rows (this rank's own with `rows`, sharded),
    the samples without response tokens, the kind and dimension, what computed them (shards computed and reused,
    the model's fingerprint, the feature store) when known, and whether the folder keeps the rows themselves
    (`features.npy`: what a selection that reads features needs; never for sharded rows)."""

    features: np.ndarray
    empty_mask: np.ndarray
    kind: str
    dim: int
    rows: Optional[np.ndarray] = None
    shards: tuple[list, list] = ([], [])
    model_fingerprint: Optional[str] = None
    store: Optional[Path] = None
    keep_features: bool = True


def write_analysis(folder: Union[AnalysisDir, str, os.PathLike], features: AnalysedFeatures, settings: Any,
                   data: AnalysedData, world_size: int, *, timings: Optional[AnalysisTimings] = None,
                   provenance: Optional[Mapping[str, Any]] = None,
                   clusters: Optional[ClusterResult] = None, target: Optional[AnalysedTarget] = None,
                   kmeans_in_child: bool = False) -> dict[str, Any]:
    """The one writer of an analysis folder from features: k-means of the samples with response tokens with the
    clustering settings (unless the ranks did it together: `clusters`), then the folder (arrays, manifest, summary).
    `settings`: the block or its `StageSettings`; `data`: the training data the features are of (its categories,
    when it has them, give the purity). `timings`: of what came before (the features pass); the summary's total
    adds the clustering and the writing. `target`: the target examples' features (`analysis.target.extract_target`,
    with the same engine and feature settings as `features`), recorded with their fingerprint. `kmeans_in_child`:
    `cluster_with`'s `in_child`. Returns the summary written. A caller with the pool's features already (the
    benchmark: once per feature model, for many targets) writes an analysis per target this way."""
    folder = folder if isinstance(folder, AnalysisDir) else AnalysisDir(folder)
    stages = stages_of(settings)
    timings = timings or AnalysisTimings()
    provenance = provenance or {}
    clustering_started = time.perf_counter()
    num_clusters = stages.clustering.resolved_num_clusters(world_size)
    # Samples without response tokens have no gradient: they stay out of k-means (label -1).
    has_response = ~np.asarray(features.empty_mask, dtype=bool)
    if clusters is None:
        clusters = cluster_with(features.features[has_response], stages.clustering, world_size,
                                in_child=kmeans_in_child)
    num_samples = len(data.records)
    labels, distances = spread_to_all(clusters, np.flatnonzero(has_response), num_samples)
    timings = dataclasses.replace(timings, cluster=time.perf_counter() - clustering_started)
    summary = _summary(features, data, labels, clusters, num_clusters, world_size, timings,
                       provenance.get("zero_stage"))
    manifest = {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **provenance,
        "model_fingerprint": features.model_fingerprint,
        "dataset_fingerprint": data.fingerprint or dataset_fingerprint(data.records),
        "feature_store": os.fspath(features.store) if features.store is not None else None,
        "kind": features.kind, "dim": features.dim,
        # Where the analysed records can be read again (ds-cluster report reads them from there), when known.
        "data_source": records_source(data.records),
        "seed": stages.features.seed, "normalize": stages.features.normalize, "num_clusters": num_clusters,
        "world_size": world_size,
        "cluster_sampling": {**stages.features.block_values(), **stages.clustering.block_values()},
    }
    if target is not None:
        if np.asarray(target.features).shape[1:] != (features.dim,):
            raise ValueError(f"the target's features have shape {np.asarray(target.features).shape}, the records' "
                             f"dimension is {features.dim}: extract both with the same kind and settings")
        summary["target"] = {"num_examples": int(np.asarray(target.groups).size), "examples": target.counts()}
    summary["timings_s"]["total"] = round(timings.extract + time.perf_counter() - clustering_started, 3)
    arrays = ({"features.npy": features.features.astype(np.float32, copy=False)}
              if features.rows is None and features.keep_features else {})
    folder.write({
        **arrays,
        "labels.npy": labels,
        "centroids.npy": np.asarray(clusters.centroids, dtype=np.float32),
        "distances.npy": distances,
        "empty_mask.npy": features.empty_mask,
    }, manifest, summary, store=features.store, target=target)
    logger.info("analysis of %d samples (%s, d=%d, K=%d) written to %s", num_samples, features.kind,
                features.dim, num_clusters, folder.path)
    return summary
