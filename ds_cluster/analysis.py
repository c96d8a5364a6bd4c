"""The analysis stage: features from the DeepSpeed engine, clusters, and an analysis directory.

``run_analysis`` is run on every rank (under the deepspeed launcher or mpirun).
The ranks share feature extraction; rank 0 clusters and writes the directory::

    features.npy     (N, d) float32, rows L2-normalised unless configured otherwise
    labels.npy       (N,) int64 cluster of every sample, -1 for samples without response tokens
    centroids.npy    (K, d) float32
    distances.npy    (N,) distance of every sample to its centroid
    empty_mask.npy   (N,) bool, samples without response tokens (zero feature rows)
    manifest.json    what produced it: model, data, fingerprints, feature and clustering settings
    summary.json     N, num_empty, cluster sizes, kind, dim, timings, family purity

The directory is written under a temporary name next to it and renamed into
place, so a failed run leaves the previous analysis intact. The feature store
(``out_dir/.feature_store`` unless another path is given) is carried over.
"""
from __future__ import annotations

import errno
import gc
import json
import logging
import os
import shutil
import time
import uuid
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import numpy as np

from ds_cluster.config import ClusterSamplingConfig, load_ds_config
from ds_cluster.distributed import agree_on_error, get_rank, get_world_size, init_distributed
from ds_cluster.features.store import DEFAULT_SHARD_SIZE, write_json_atomic

logger = logging.getLogger(__name__)

ANALYSIS_FORMAT_VERSION = 1
STORE_DIRNAME = ".feature_store"
# Parts of a training config a forward-only engine must not build (optimizer states,
# a scheduler, the data-efficiency sampler that ds_cluster itself provides).
_TRAINING_ONLY_KEYS = ("optimizer", "scheduler", "data_efficiency")


def forward_only_config(ds_config: dict) -> dict:
    """A copy of the DeepSpeed config for an engine that only runs forward passes.

    ZeRO stages 1 and 2 shard optimizer states and gradients, not parameters,
    and DeepSpeed refuses them without an optimizer: their forward is stage 0's.
    Stage 3 (sharded parameters) is kept.
    """
    config = {key: value for key, value in ds_config.items() if key not in _TRAINING_ONLY_KEYS}
    zero = dict(config.get("zero_optimization", {}))
    if int(zero.get("stage", 0)) in (1, 2):
        config["zero_optimization"] = {**zero, "stage": 0}
    return config


def family_purity(labels: np.ndarray, families: Sequence[str], num_clusters: int) -> dict[str, Any]:
    """Purity of the clusters against the records' families, and each cluster's family counts.

    Purity = (1/N) sum_c max_f |c and f|: 1.0 when every cluster holds one family.
    """
    per_cluster = [Counter() for _ in range(num_clusters)]
    for label, family in zip(labels.tolist(), families):
        per_cluster[label][family] += 1
    majority = sum(max(counts.values(), default=0) for counts in per_cluster)
    return {
        "purity": majority / max(len(labels), 1),
        "cluster_families": [dict(sorted(counts.items())) for counts in per_cluster],
    }


def _zero_stage(ds_config: dict) -> int:
    return int(ds_config.get("zero_optimization", {}).get("stage", 0))


def _write_error(err: OSError, out_dir: Path, staging: Path, arrays: dict[str, np.ndarray]) -> OSError:
    """The write error with what it means: numpy reports a full disk only as "N requested and M written"."""
    needed = sum(int(array.nbytes) for array in arrays.values())
    written = sum(path.stat().st_size for path in staging.iterdir() if path.is_file())
    free = shutil.disk_usage(staging).free
    full = err.errno == errno.ENOSPC or free < needed - written
    if full:
        cause = (f"No space left on device: {free} bytes free in {out_dir.parent}, the new analysis needs about "
                 f"{needed} (and the previous one stays until it is replaced); free space or choose another --out")
    else:
        cause = f"{err.strerror or err}; choose another --out"
    code = errno.ENOSPC if full else (err.errno or errno.EIO)
    return OSError(code, f"cannot write the analysis {out_dir}: {cause}. The previous analysis there, if any, is unchanged")


def _publish(out_dir: Path, arrays: dict[str, np.ndarray], documents: dict[str, Any], store_dir: Path) -> None:
    """Write the analysis into a temp directory next to out_dir, then swap it in."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    staging = out_dir.parent / f".{out_dir.name}.tmp-{tag}"
    staging.mkdir()
    try:
        try:
            for name, array in arrays.items():
                np.save(staging / name, array, allow_pickle=False)
            for name, document in documents.items():
                write_json_atomic(staging / name, document)
        except OSError as err:
            raise _write_error(err, out_dir, staging, arrays) from err
        carried = store_dir.parent.resolve() == out_dir.resolve() and store_dir.exists()
        if carried:
            # The store lives inside the directory being replaced: move it to the new one.
            os.rename(store_dir, staging / store_dir.name)
        try:
            if out_dir.exists():
                backup = out_dir.parent / f".{out_dir.name}.old-{tag}"
                os.rename(out_dir, backup)
                os.rename(staging, out_dir)
                shutil.rmtree(backup, ignore_errors=True)
            else:
                os.rename(staging, out_dir)
        except BaseException:
            if carried and not store_dir.exists():
                os.rename(staging / store_dir.name, store_dir)
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def run_analysis(
    ds_config_path: Union[str, os.PathLike],
    model: str,
    data: Union[str, os.PathLike],
    out_dir: Union[str, os.PathLike],
    *,
    kind: Optional[str] = None,
    dim: Optional[int] = None,
    batch_size: int = 8,
    max_length: Optional[int] = None,
    store_dir: Union[None, str, os.PathLike] = None,
    recompute: bool = False,
    shard_size: int = DEFAULT_SHARD_SIZE,
    model_seed: int = 0,
    show_progress: bool = True,
) -> dict[str, Any]:
    """Extract features with a DeepSpeed engine, cluster them, and write the analysis directory.

    Collective: call on every rank. `kind`/`dim` default to the config's
    ``feature_kind``/``feature_dim``; K is ``resolved_num_clusters(world_size)``.
    `recompute` discards the feature store. Returns the summary (also in
    ``out_dir/summary.json``) on every rank.
    """
    import deepspeed

    from ds_cluster.clustering import cluster_features
    from ds_cluster.data.instructions import DEFAULT_MAX_LENGTH, dataset_fingerprint, load_instruction_dataset
    from ds_cluster.features.extract import run_extraction
    from ds_cluster.models import load_model_and_tokenizer

    started = time.perf_counter()
    init_distributed()
    rank, world_size = get_rank(), get_world_size()
    ds_config, config_source = load_ds_config(ds_config_path)
    settings = ClusterSamplingConfig.from_ds_config(ds_config)
    kind = kind or settings.feature_kind
    dim = dim if dim is not None else (settings.feature_dim if kind != "proxy" else None)
    num_clusters = settings.resolved_num_clusters(world_size)
    max_length = max_length or DEFAULT_MAX_LENGTH
    out_dir = Path(out_dir)
    store_path = Path(store_dir) if store_dir is not None else out_dir / STORE_DIRNAME
    engine_config = forward_only_config(ds_config)

    hf_model, tokenizer = load_model_and_tokenizer(model, ds_config=engine_config, seed=model_seed)
    dataset = load_instruction_dataset(data, tokenizer, max_length=max_length)
    engine, *_ = deepspeed.initialize(model=hf_model, config=engine_config)
    loaded = time.perf_counter()

    extraction = run_extraction(engine, dataset, kind=kind, dim=dim, batch_size=batch_size, store=store_path,
                                seed=settings.seed, normalize=settings.normalize_features,
                                show_progress=show_progress, shard_size=shard_size, overwrite=recompute)
    extracted = time.perf_counter()
    # The engine holds the (possibly gathered) parameters; clustering needs none of it.
    del engine, hf_model
    gc.collect()

    error: Optional[BaseException] = None
    if rank == 0:
        try:
            # Samples without response tokens have no gradient: they stay out of k-means (label -1).
            has_response = ~np.asarray(extraction.empty_mask, dtype=bool)
            clusters = cluster_features(extraction.features[has_response], num_clusters=num_clusters,
                                        n_init=settings.kmeans_n_init, max_iter=settings.kmeans_max_iter,
                                        capacity_factor=settings.capacity_factor,
                                        capacity_neighbors=settings.capacity_neighbors, backend=settings.backend,
                                        seed=settings.seed)
            clustered = time.perf_counter()
            num_samples = len(dataset)
            labels = np.full(num_samples, -1, dtype=np.int64)
            labels[has_response] = clusters.labels
            distances = np.zeros(num_samples, dtype=np.float64)
            distances[has_response] = clusters.distances
            sizes = np.bincount(clusters.labels, minlength=num_clusters)
            summary: dict[str, Any] = {
                "num_samples": num_samples,
                "num_empty": extraction.num_empty,
                "kind": kind,
                "dim": extraction.dim,
                "num_clusters": num_clusters,
                "cluster_sizes": sizes.tolist(),
                "world_size": world_size,
                "zero_stage": _zero_stage(ds_config),
                "computed_shards": extraction.computed_shards,
                "reused_shards": extraction.reused_shards,
                "timings_s": {
                    "load": round(loaded - started, 3),
                    "extract": round(extracted - loaded, 3),
                    "cluster": round(clustered - extracted, 3),
                },
                "extract_samples_per_s": round(num_samples / max(extracted - loaded, 1e-9), 2),
            }
            families = [str(record.get("family", "")) for record in getattr(dataset, "records", [])]
            if any(families):
                summary.update(family_purity(clusters.labels, [f for f, keep in zip(families, has_response) if keep],
                                             num_clusters))
            manifest = {
                "format_version": ANALYSIS_FORMAT_VERSION,
                "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "model": model,
                "model_seed": model_seed,
                "data": os.fspath(data),
                "max_length": max_length,
                "ds_config": config_source,
                "model_fingerprint": extraction.manifest.model_fingerprint if extraction.manifest else None,
                "dataset_fingerprint": dataset_fingerprint(dataset),
                "feature_store": os.fspath(store_path),
                "kind": kind,
                "dim": extraction.dim,
                "seed": settings.seed,
                "normalize": settings.normalize_features,
                "num_clusters": num_clusters,
                "world_size": world_size,
                "cluster_sampling": settings.model_dump(),
            }
            summary["timings_s"]["total"] = round(time.perf_counter() - started, 3)
            _publish(out_dir, {
                "features.npy": extraction.features.astype(np.float32, copy=False),
                "labels.npy": labels,
                "centroids.npy": np.asarray(clusters.centroids, dtype=np.float32),
                "distances.npy": distances,
                "empty_mask.npy": extraction.empty_mask,
            }, {"manifest.json": manifest, "summary.json": summary}, store_path)
            logger.info("analysis of %d samples (%s, d=%d, K=%d) written to %s", num_samples, kind,
                        extraction.dim, num_clusters, out_dir)
        except (ValueError, OSError, RuntimeError) as err:
            error = err
    # Also the barrier: rank 0 has finished writing the directory when this gather completes.
    agree_on_error(error, "clustering and writing the analysis")
    with open(out_dir / "summary.json", encoding="utf-8") as handle:
        return json.load(handle)
