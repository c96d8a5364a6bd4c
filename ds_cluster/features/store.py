"""A resumable on-disk store of per-sample features.

Layout (one directory, on a filesystem every rank can see)::

    manifest.json                what was computed: kind, dim, seed, fingerprints, N, shard layout
    shards/shard-00000.npy       rows [start, stop) as float32, written atomically
    shards/shard-00000.done.json completion marker: shape, sha256 of the rows, empty rows, who computed it

A shard counts as finished only when its marker exists and the rows match
it (shape, dtype, checksum); anything else is recomputed. The marker is
written after the rows, both through a temp file and os.replace, so a crash
leaves either a finished shard or no marker.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from ds_cluster.collectives import Collectives
from ds_cluster.fileio import write_json_atomic, write_npy_atomic

logger = logging.getLogger(__name__)

STORE_FORMAT_VERSION = 1
DEFAULT_SHARD_SIZE = 512
# How a shard's samples are batched: in order of length, each batch padded to its longest row (0.4.0 on), or in
# index order at the dataset's full width (before; a store without the field). Rows differ in the last bits.
BATCHING_BY_LENGTH = "by_length_padded_to_longest"
BATCHING_FULL_WIDTH = "full_width"
# How the lora kind projects each adapter's gradient: count sketches (after 0.6.0), or Gaussian matrices (0.6.0 and
# before; a store without the field, and every store of the other kinds, which have no adapters).
ADAPTER_SKETCH = "sign_sketch"
ADAPTER_GAUSSIAN = "gaussian"


@dataclass(frozen=True)
class StoreManifest:
    """Everything that determines the stored rows; a store is reused only when all fields match."""

    kind: str
    dim: int
    seed: int
    normalize: bool
    model_fingerprint: str
    dataset_fingerprint: str
    num_samples: int
    shard_size: int
    batching: str = BATCHING_FULL_WIDTH
    adapter_projection: str = ADAPTER_GAUSSIAN
    format_version: int = STORE_FORMAT_VERSION

    @property
    def num_shards(self) -> int:
        return (self.num_samples + self.shard_size - 1) // self.shard_size

    def shard_bounds(self, shard: int) -> tuple[int, int]:
        start = shard * self.shard_size
        return start, min(self.num_samples, start + self.shard_size)

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["num_shards"] = self.num_shards
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "StoreManifest":
        names = {field.name for field in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in names})


@dataclass(frozen=True)
class ShardMarker:
    shard: int
    start: int
    stop: int
    dim: int
    sha256: str
    empty: list[int]  # dataset indices of samples without response tokens (zero rows)
    rank: int
    run_id: str
    seconds: float


def _rows_digest(rows: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(rows).tobytes()).hexdigest()


class FeatureStore:
    """A directory of feature shards described by a StoreManifest."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)

    @property
    def manifest_path(self) -> Path:
        return self.root / "manifest.json"

    def _shard_path(self, shard: int) -> Path:
        return self.root / "shards" / f"shard-{shard:05d}.npy"

    def _marker_path(self, shard: int) -> Path:
        return self.root / "shards" / f"shard-{shard:05d}.done.json"

    # ------------------------------------------------------------ manifest
    def read_manifest(self) -> Optional[StoreManifest]:
        if not self.manifest_path.exists():
            return None
        with open(self.manifest_path, encoding="utf-8") as handle:
            return StoreManifest.from_json(json.load(handle))

    def prepare(self, manifest: StoreManifest, overwrite: bool = False) -> None:
        """Create the store, or check an existing one matches (call on one rank only).

        A mismatch raises ValueError naming the differing fields, unless
        `overwrite`, which deletes the old shards and starts over.
        """
        existing = self.read_manifest()
        if existing is not None and existing != manifest:
            if not overwrite:
                raise ValueError(self._mismatch_message(existing, manifest))
            logger.warning("feature store %s: manifest changed, recomputing (%s)", self.root,
                           ", ".join(_differing_fields(existing, manifest)))
            shutil.rmtree(self.root / "shards", ignore_errors=True)
        elif existing is not None and overwrite:
            shutil.rmtree(self.root / "shards", ignore_errors=True)
        (self.root / "shards").mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.manifest_path, manifest.to_json())

    def check(self, manifest: StoreManifest) -> None:
        """Raise ValueError if the store on disk was not prepared for `manifest` (any rank)."""
        existing = self.read_manifest()
        if existing is None:
            raise ValueError(f"feature store {self.root}: no manifest.json (the store was not prepared)")
        if existing != manifest:
            raise ValueError(self._mismatch_message(existing, manifest))

    def _mismatch_message(self, existing: StoreManifest, wanted: StoreManifest) -> str:
        fields = _differing_fields(existing, wanted)
        detail = "; ".join(f"{name}: stored {getattr(existing, name)!r}, requested {getattr(wanted, name)!r}"
                           for name in fields)
        return (f"feature store {self.root} was computed with different settings ({', '.join(fields)}): {detail}. "
                "Use another store directory, or recompute (overwrite=True / --recompute).")

    # -------------------------------------------------------------- shards
    def write_shard(self, manifest: StoreManifest, shard: int, rows: np.ndarray, empty: Sequence[int],
                    rank: int, run_id: str, seconds: float) -> ShardMarker:
        start, stop = manifest.shard_bounds(shard)
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        if rows.shape != (stop - start, manifest.dim):
            raise ValueError(f"shard {shard}: rows have shape {rows.shape}, expected {(stop - start, manifest.dim)}")
        write_npy_atomic(self._shard_path(shard), rows)
        marker = ShardMarker(shard=shard, start=start, stop=stop, dim=manifest.dim, sha256=_rows_digest(rows),
                             empty=[int(index) for index in empty], rank=rank, run_id=run_id, seconds=seconds)
        write_json_atomic(self._marker_path(shard), dataclasses.asdict(marker))
        return marker

    def read_marker(self, shard: int) -> Optional[ShardMarker]:
        path = self._marker_path(shard)
        if not path.exists():
            return None
        try:
            with open(path, encoding="utf-8") as handle:
                return ShardMarker(**json.load(handle))
        except (OSError, ValueError, TypeError) as err:
            logger.warning("feature store %s: unreadable marker for shard %d (%s); it will be recomputed",
                           self.root, shard, err)
            return None

    def read_shard(self, manifest: StoreManifest, shard: int) -> tuple[np.ndarray, ShardMarker]:
        """The rows of a finished shard, validated against its marker; ValueError if it is not valid."""
        marker = self.read_marker(shard)
        if marker is None:
            raise ValueError(f"feature store {self.root}: shard {shard} is not finished (no valid marker)")
        start, stop = manifest.shard_bounds(shard)
        path = self._shard_path(shard)
        try:
            rows = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as err:
            raise ValueError(f"feature store {self.root}: shard {shard} unreadable ({err})") from None
        problems = []
        if (marker.start, marker.stop, marker.dim) != (start, stop, manifest.dim):
            problems.append(f"marker covers [{marker.start}, {marker.stop}) x {marker.dim}, "
                            f"expected [{start}, {stop}) x {manifest.dim}")
        if rows.dtype != np.float32:
            problems.append(f"dtype {rows.dtype}, expected float32")
        if rows.shape != (stop - start, manifest.dim):
            problems.append(f"shape {rows.shape}, expected {(stop - start, manifest.dim)}")
        elif _rows_digest(rows) != marker.sha256:
            problems.append("checksum does not match its marker")
        if problems:
            raise ValueError(f"feature store {self.root}: shard {shard} is corrupt: {'; '.join(problems)}")
        return rows, marker

    def finished_shards(self, manifest: StoreManifest) -> list[int]:
        """Shards whose rows exist and validate; a corrupt shard is logged and left to be recomputed."""
        finished = []
        for shard in range(manifest.num_shards):
            if not self._marker_path(shard).exists():
                continue
            try:
                self.read_shard(manifest, shard)
            except ValueError as err:
                logger.warning("%s; it will be recomputed", err)
                continue
            finished.append(shard)
        return finished

    def assemble(self, manifest: StoreManifest,
                 shards: Optional[Iterable[int]] = None) -> tuple[np.ndarray, np.ndarray]:
        """(features N x d float32, empty_mask N bool) from all shards; ValueError if one is missing or corrupt."""
        features = np.zeros((manifest.num_samples, manifest.dim), dtype=np.float32)
        empty_mask = np.zeros(manifest.num_samples, dtype=bool)
        for shard in range(manifest.num_shards) if shards is None else shards:
            rows, marker = self.read_shard(manifest, shard)
            features[marker.start:marker.stop] = rows
            empty_mask[marker.empty] = True
        return features, empty_mask


def _differing_fields(a: StoreManifest, b: StoreManifest) -> list[str]:
    return [field.name for field in dataclasses.fields(StoreManifest)
            if getattr(a, field.name) != getattr(b, field.name)]


# --------------------------------------------------------------------------- the store across ranks
def prepare_store(store: FeatureStore, manifest: StoreManifest, overwrite: bool, ranks: Collectives) -> list[int]:
    """Rank 0 creates or checks the store, every rank then checks it; returns the shards left to compute."""
    ranks.run_agreed("preparing the feature store", lambda: store.prepare(manifest, overwrite=overwrite), only_rank=0)

    def open_store() -> list[int]:
        store.check(manifest)
        return sorted(set(range(manifest.num_shards)) - set(store.finished_shards(manifest)))

    pending = ranks.run_agreed("opening the feature store", open_store) or []
    ranks.check_agreement(pending,
                          "feature-store shards left to compute (is the store on a filesystem every rank sees?)")
    return pending


def own_shards(manifest: StoreManifest, store: FeatureStore, collectives: Collectives
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """This rank's shards (s mod W = rank) read back from the store, their global rows, and the whole empty mask."""
    rank, world_size = collectives.rank, collectives.world_size
    mine = list(range(rank, manifest.num_shards, world_size))
    parts = [store.read_shard(manifest, shard) for shard in mine]
    features = (np.concatenate([rows for rows, _ in parts]) if parts
                else np.zeros((0, manifest.dim), dtype=np.float32))
    rows = np.concatenate([np.arange(*manifest.shard_bounds(s)) for s in mine]) if mine else np.zeros(0, np.int64)
    empty = [index for part in collectives.gather([m.empty for _, m in parts]) for markers in part for index in markers]
    empty_mask = np.zeros(manifest.num_samples, dtype=bool)
    empty_mask[np.asarray(empty, dtype=np.int64)] = True
    return features, rows.astype(np.int64), empty_mask


def assemble_rows(manifest: StoreManifest, feature_store: Optional[FeatureStore],
              computed: dict[int, tuple[np.ndarray, list[int]]], collectives: Collectives
              ) -> tuple[np.ndarray, np.ndarray]:
    """Every rank's shards as one (N, d) array and empty mask (collective)."""
    if feature_store is not None:
        # Every rank wrote its shards before this gather: read them all back, validated.
        collectives.barrier()
        return feature_store.assemble(manifest)
    features = np.zeros((manifest.num_samples, manifest.dim), dtype=np.float32)
    empty_mask = np.zeros(manifest.num_samples, dtype=bool)
    for part in collectives.gather(computed):
        for shard, (rows_np, empty_idx) in part.items():
            start, stop = manifest.shard_bounds(shard)
            features[start:stop] = rows_np
            empty_mask[empty_idx] = True
    return features, empty_mask
