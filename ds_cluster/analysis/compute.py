"""The analysis stage: features from a DeepSpeed engine, clusters, and an analysis folder.

`analyze(engine, dataset, out_dir, settings)` runs on every rank: the ranks
share feature extraction (through a resumable feature store), rank 0
clusters and writes the folder (`AnalysisDir`), and every rank returns the
summary. `ds-cluster analyze` calls it with an engine built for forward
passes only; a training job calls it with its own engine when its analysis
does not exist yet.
"""
from __future__ import annotations

import gc
import logging
import os
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np

from ds_cluster.analysis.folder import AnalysisDir
from ds_cluster.clustering.kmeans import ClusterResult, category_counts, cluster_with, purity, spread_to_all
from ds_cluster.collectives import LOCAL, Collectives
from ds_cluster.data.dataset import dataset_fingerprint, records_source
from ds_cluster.features.extract import ExtractionResult, run_extraction
from ds_cluster.features.kinds import feature_kind
from ds_cluster.features.store import DEFAULT_SHARD_SIZE
from ds_cluster.phases import phase
from ds_cluster.settings import ClusteringSettings, FeatureSettings, stages_of

logger = logging.getLogger(__name__)


def analyze(engine: Any, dataset: Sequence[Any], out_dir: Union[str, os.PathLike], settings: Any,
            *, kind: Optional[str] = None, dim: Optional[int] = None, batch_size: int = 8,
            store_dir: Union[None, str, os.PathLike] = None, recompute: bool = False,
            shard_size: int = DEFAULT_SHARD_SIZE, show_progress: bool = True,
            provenance: Optional[Mapping[str, Any]] = None, collectives: Collectives = LOCAL,
            analysis_of: Optional[Sequence[Any]] = None,
            analysis_of_fingerprint: Optional[str] = None) -> dict[str, Any]:
    """Extract features with `engine`, cluster them, and write the analysis folder `out_dir`.

    Collective: call on every rank with the same arguments. `settings`: the
    `cluster_sampling` block (a ClusterSamplingConfig) or its `StageSettings`:
    the features and clustering stages' settings are read. `kind`/`dim`
    default to the features' kind and dimension; K is the clustering's
    ``resolved_num_clusters(world_size)``. `recompute` discards the
    feature store (default ``out_dir/.feature_store``). `provenance` (model,
    data paths...) goes into manifest.json. `collectives`: this rank among the
    ranks sharing the work (`ds_cluster.distributed.collectives()` in a job).
    `analysis_of`: the training data the analysis is for, when `dataset` is its
    re-encoding for a separate feature model (the manifest records its fingerprint).
    `analysis_of_fingerprint`: that data's fingerprint when the caller has it already.
    Returns the summary on every rank.
    """
    started = time.perf_counter()
    stages = stages_of(settings)
    features, clustering = stages.features, stages.clustering
    world_size = collectives.world_size
    folder = AnalysisDir(out_dir)
    kind = kind or features.kind
    dim = dim if dim is not None else (features.dim if feature_kind(kind).projected else None)
    store_path = Path(store_dir) if store_dir is not None else folder.store_path()
    target = dataset if analysis_of is None else analysis_of
    target_fingerprint = analysis_of_fingerprint or dataset_fingerprint(target)
    with phase(f"features {kind}"):
        extraction = run_extraction(engine, dataset, kind=kind, dim=dim, batch_size=batch_size, store=store_path,
                                    seed=features.seed, normalize=features.normalize,
                                    show_progress=show_progress, shard_size=shard_size, overwrite=recompute,
                                    sharded=features.sharded, collectives=collectives,
                                    fingerprint=target_fingerprint if target is dataset else None)
    extracted = time.perf_counter()
    gc.collect()
    with phase("k-means"):  # and rank 0 writing the folder
        clusters = _sharded_clusters(extraction, clustering, collectives) if clustering.sharded else None
        # The training config's stage when the caller names it (a forward-only engine runs 1 and 2 as 0).
        stage = engine.zero_optimization_stage() if hasattr(engine, "zero_optimization_stage") else None
        # Rank 0's forward and feature seconds beside the whole extraction's.
        timings = {"extract": extracted - started,
                   **{f"extract_{part}": s for part, s in extraction.timings.items()}}
        # Rank 0 clusters and writes; the agreement is also the barrier: the folder is written when it completes.
        collectives.run_agreed(
            "clustering and writing the analysis",
            lambda: _cluster_and_write(folder, extraction, target, target_fingerprint, features, clustering,
                                       world_size, store_path, timings=timings, started=started,
                                       provenance={"zero_stage": stage, **(provenance or {})}, clusters=clusters),
            only_rank=0, errors=(ValueError, OSError, RuntimeError))
    summary = folder.summary()
    assert summary is not None
    return summary


def _sharded_clusters(extraction: ExtractionResult, clustering: ClusteringSettings, collectives: Collectives
                      ) -> ClusterResult:
    """k-means over every rank's own rows together (collective); the result for the samples with response tokens."""
    from ds_cluster.clustering.sharded import cluster_sharded

    has_response = ~np.asarray(extraction.empty_mask, dtype=bool)
    assert extraction.rows is not None
    own_with_response = has_response[extraction.rows]
    result = cluster_sharded(extraction.rows[own_with_response], extraction.features[own_with_response],
                             num_samples=int(extraction.empty_mask.size), collectives=collectives,
                             **clustering.kmeans_arguments(collectives.world_size))
    # all_rows are exactly the samples with response tokens, ascending: the order rank 0 writes them in.
    return ClusterResult(result.all_labels, result.centroids, result.all_distances)


def _cluster_and_write(folder: AnalysisDir, extraction: ExtractionResult, dataset: Sequence[Any], fingerprint: str,
                       features: FeatureSettings, clustering: ClusteringSettings, world_size: int, store_path: Path,
                       timings: dict[str, float], started: float, provenance: Mapping[str, Any],
                       clusters: Optional[ClusterResult] = None) -> None:
    """Rank 0's part: k-means over the samples with response tokens (unless the ranks did it together),
    then the folder."""
    clustering_started = time.perf_counter()
    num_clusters = clustering.resolved_num_clusters(world_size)
    # Samples without response tokens have no gradient: they stay out of k-means (label -1).
    has_response = ~np.asarray(extraction.empty_mask, dtype=bool)
    if clusters is None:
        clusters = cluster_with(extraction.features[has_response], clustering, world_size)
    num_samples = len(dataset)
    labels, distances = spread_to_all(clusters, np.flatnonzero(has_response), num_samples)
    timings = {**timings, "cluster": time.perf_counter() - clustering_started}
    summary: dict[str, Any] = {
        "num_samples": num_samples, "num_empty": extraction.num_empty, "kind": extraction.kind,
        "dim": extraction.dim, "num_clusters": num_clusters,
        "cluster_sizes": np.bincount(clusters.labels, minlength=num_clusters).tolist(),
        "world_size": world_size, "zero_stage": provenance.get("zero_stage"),
        "computed_shards": extraction.computed_shards,
        "reused_shards": extraction.reused_shards,
        "timings_s": {name: round(value, 3) for name, value in timings.items()},
        "extract_samples_per_s": round(num_samples / max(timings["extract"], 1e-9), 2),
    }
    # A category per sample (a task family, say) when the dataset carries them: for the purity in the summary.
    categories = getattr(dataset, "categories", None)
    if categories is not None and any(categories):
        names, counts = category_counts(labels, categories, num_clusters)
        summary.update(purity=purity(counts), cluster_categories=[
            {name: int(count) for name, count in zip(names, row) if count} for row in counts])
    manifest = {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **provenance,
        "model_fingerprint": extraction.manifest.model_fingerprint if extraction.manifest else None,
        "dataset_fingerprint": fingerprint,
        "feature_store": os.fspath(store_path), "kind": extraction.kind, "dim": extraction.dim,
        # Where the analysed records can be read again (ds-cluster report reads them from there), when known.
        "data_source": records_source(dataset),
        "seed": features.seed, "normalize": features.normalize, "num_clusters": num_clusters,
        "world_size": world_size, "cluster_sampling": {**features.block_values(), **clustering.block_values()},
    }
    summary["timings_s"]["total"] = round(time.perf_counter() - started, 3)
    arrays = {} if extraction.rows is not None else {"features.npy": extraction.features.astype(np.float32, copy=False)}
    folder.write({
        **arrays,
        "labels.npy": labels,
        "centroids.npy": np.asarray(clusters.centroids, dtype=np.float32),
        "distances.npy": distances,
        "empty_mask.npy": extraction.empty_mask,
    }, manifest, summary, store=store_path)
    logger.info("analysis of %d samples (%s, d=%d, K=%d) written to %s", num_samples, extraction.kind,
                extraction.dim, num_clusters, folder.path)
