"""The analysis folder: the one owner of its format, with its write, read and check.

An analysis is what the plan is built from::

    features.npy     (N, d) float32 per-sample features (rows L2-normalised unless configured otherwise)
    labels.npy       (N,) int64 cluster (or category) of every sample, -1 for samples left out
    centroids.npy    (K, d) float32
    distances.npy    (N,) distance of every sample to its centroid
    empty_mask.npy   (N,) bool, the samples left out: no response tokens, so no gradient (zero feature rows)
    manifest.json    what produced it: model, data, fingerprints, feature and clustering settings
    summary.json     N, num_empty, cluster sizes, kind, dim, timings, category purity

and, when it was made with target examples (docs/targeted.md)::

    target_features.npy  (T, d) float32 the target examples' features (same extraction, engine and kind)
    target.json          each example's target, the targets' names, the examples' fingerprint, source and prompts

(the manifest's `target_fingerprint` names the target set it was made with).

`ds-cluster analyze` (and a training job that finds no analysis) writes all of
it; a hand-made analysis may hold just `features.npy` and/or `labels.npy`.
`empty_mask.npy` is the one record of the samples left out, and the plan reads
it as its `exclude`; a hand-made analysis without it leaves out its all-zero
feature rows (a sample without a gradient) and its labels of -1.
The folder is built under a hidden name next to it and swapped in, so a failed
write leaves the previous analysis intact.
"""
from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np

from ds_cluster.clustering.samples import PlanInputs
from ds_cluster.fileio import replace_dir, staging_dir, write_json_atomic, write_npy_atomic

ANALYSIS_FORMAT_VERSION = 1
STORE_DIRNAME = ".feature_store"
MANIFEST = "manifest.json"
SUMMARY = "summary.json"
TARGET_FEATURES = "target_features.npy"
TARGET = "target.json"


@dataclass(frozen=True)
class AnalysedTarget:
    """The target examples of an analysis: their feature rows (T, d), each one's target (T,) as an index into
    `group_names`, the fingerprint of the examples (`data.target.target_fingerprint`), where they were read, and
    their prompts (for the report)."""

    features: np.ndarray
    groups: np.ndarray
    group_names: tuple[str, ...]
    fingerprint: str
    source: Optional[str] = None
    prompts: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """target.json: everything but the rows."""
        return {"fingerprint": self.fingerprint, "group_names": list(self.group_names),
                "groups": [int(group) for group in self.groups], "source": self.source, "prompts": list(self.prompts)}

    def counts(self) -> dict[str, int]:
        """How many examples each target has."""
        return {name: int((np.asarray(self.groups) == index).sum()) for index, name in enumerate(self.group_names)}


@dataclass(frozen=True)
class AnalysisTimings:
    """Wall seconds of an analysis's parts (its summary.json's `timings_s`): the features pass over every rank, rank
    0's seconds in the engine's forwards and in the features computed from them, k-means, and the whole."""

    extract: float = 0.0
    extract_forward: float = 0.0
    extract_features: float = 0.0
    cluster: float = 0.0
    total: float = 0.0

    @classmethod
    def from_json(cls, timings: Mapping[str, float]) -> "AnalysisTimings":
        return cls(**{item.name: float(timings.get(item.name, 0.0)) for item in dataclasses.fields(cls)})

    def to_json(self) -> dict[str, float]:
        return {item.name: getattr(self, item.name) for item in dataclasses.fields(self)}


@dataclass(frozen=True)
class InJobAnalysis:
    """An analysis a training job computed before its first step: its parts' timings, and the wall and CPU seconds
    the set-up spent on it (engine start included). What `ClusterDataLoader.analysis` holds (None: read)."""

    timings: AnalysisTimings
    wall: float
    cpu: float

    def to_json(self) -> dict[str, float]:
        """As a training summary writes it (`analysis_timings`)."""
        return {**self.timings.to_json(), "wall": self.wall, "cpu": self.cpu}


class AnalysisDir:
    """An analysis folder on disk (see the module docstring for its files)."""

    def __init__(self, path: Union[str, os.PathLike]) -> None:
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"AnalysisDir({os.fspath(self.path)!r})"

    # ------------------------------------------------------------------ what is there
    def exists(self) -> bool:
        """True when the folder holds features.npy or labels.npy (something a plan can be built from)."""
        return (self.path / "features.npy").is_file() or (self.path / "labels.npy").is_file()

    def manifest(self) -> Optional[dict[str, Any]]:
        """manifest.json, or None for a hand-made analysis; ValueError when it is unreadable."""
        return self._json(MANIFEST)

    def summary(self) -> Optional[dict[str, Any]]:
        return self._json(SUMMARY)

    def store_path(self) -> Path:
        """Where `ds-cluster analyze` keeps its resumable feature store by default."""
        return self.path / STORE_DIRNAME

    def num_samples(self) -> int:
        """N, from the first rows of features.npy or labels.npy (nothing else is read)."""
        self._require_folder()
        for name in ("features.npy", "labels.npy"):
            if (self.path / name).exists():
                return int(self._array(name, ndim=2 if name == "features.npy" else 1).shape[0])
        raise FileNotFoundError(f"{self.path} holds neither features.npy nor labels.npy; run `ds-cluster analyze` "
                                "first")

    def target_fingerprint(self) -> Optional[str]:
        """The fingerprint of the target set the analysis was made with (its manifest's), None without one."""
        return (self.manifest() or {}).get("target_fingerprint")

    def load_target(self) -> Optional[AnalysedTarget]:
        """The analysis's target examples (features, targets, fingerprint), None when it was made without; ValueError
        when its target files are missing, unreadable or disagree with each other or with the manifest."""
        recorded = self.target_fingerprint()
        document = self._json(TARGET)
        if recorded is None and document is None:
            return None
        features = self._array(TARGET_FEATURES, ndim=2)
        if document is None or features is None or document.get("fingerprint") != recorded:
            raise ValueError(f"{self.path}: its target files ({TARGET_FEATURES}, {TARGET}) are missing or do not "
                             f"match its manifest's target_fingerprint {recorded}; rerun `ds-cluster analyze --target`")
        groups = np.asarray(document["groups"], dtype=np.int64)
        names = tuple(document["group_names"])
        if groups.shape != (features.shape[0],) or (groups.size and not 0 <= groups.min() <= groups.max() < len(names)):
            raise ValueError(f"{self.path / TARGET}: its groups do not fit {features.shape[0]} target examples of "
                             f"{len(names)} targets; rerun `ds-cluster analyze --target`")
        if not np.isfinite(features).all():
            raise ValueError(f"{self.path / TARGET_FEATURES} has NaN or inf; rerun `ds-cluster analyze --target`")
        return AnalysedTarget(features=features.astype(np.float32, copy=False), groups=groups, group_names=names,
                              fingerprint=str(recorded), source=document.get("source"),
                              prompts=tuple(document.get("prompts") or ()))

    # ------------------------------------------------------------------ read and check
    def load_inputs(self, dataset_size: int, dataset_fingerprint: Optional[str] = None) -> PlanInputs:
        """features/labels for `clustering.samples.cluster_samples`, checked against the dataset about to be trained on.

        The arrays must have one row per sample; when manifest.json records a
        dataset fingerprint, it must be `dataset_fingerprint` (an analysis of
        other data with the same length is refused too).
        """
        self._require_folder()
        features = self._array("features.npy", ndim=2)
        labels = self._array("labels.npy", ndim=1)
        if features is None and labels is None:
            raise FileNotFoundError(f"{self.path} holds neither features.npy nor labels.npy")
        for name, array in (("features.npy", features), ("labels.npy", labels)):
            if array is not None and array.shape[0] != dataset_size:
                raise ValueError(
                    f"{self.path / name} has {array.shape[0]} rows but the training dataset has {dataset_size} "
                    "samples: the analysis was made for different data; rerun `ds-cluster analyze` on this dataset")
        self.check_dataset(dataset_fingerprint)
        if features is not None and not np.isfinite(features).all():
            bad_rows = np.flatnonzero(~np.isfinite(features).all(axis=1))
            raise ValueError(f"{self.path / 'features.npy'} has NaN or inf in {bad_rows.size} rows (first: row "
                             f"{int(bad_rows[0])}); rerun `ds-cluster analyze` (in fp32) to recompute the features")
        exclude = self._excluded(features, dataset_size)
        if labels is not None and not np.issubdtype(labels.dtype, np.integer):
            raise ValueError(f"{self.path / 'labels.npy'} must hold integers, got {labels.dtype}")
        # The clustering's own geometry, when the analysis recorded it next to its labels.
        distances = self._array("distances.npy", ndim=1) if labels is not None else None
        centroids = self._array("centroids.npy", ndim=2) if distances is not None else None
        if distances is not None and distances.shape[0] != dataset_size:
            raise ValueError(f"{self.path / 'distances.npy'} has {distances.shape[0]} rows, not {dataset_size}")
        if labels is not None and exclude is not None:
            labels = np.where(exclude, -1, labels)
        return PlanInputs(features, labels, exclude, distances, centroids)

    def _excluded(self, features: Optional[np.ndarray], dataset_size: int) -> Optional[np.ndarray]:
        """The samples left out (None when none): empty_mask.npy, or a hand-made analysis's all-zero rows."""
        recorded = self._array("empty_mask.npy", ndim=1)
        if recorded is not None:
            if recorded.shape[0] != dataset_size or recorded.dtype != np.bool_:
                raise ValueError(f"{self.path / 'empty_mask.npy'} must be {dataset_size} booleans, got "
                                 f"{recorded.shape[0]} of {recorded.dtype}; rerun `ds-cluster analyze`")
            exclude = recorded
        elif features is not None:
            # A sample without response tokens has no gradient: an all-zero row, and no cluster.
            exclude = ~np.any(features != 0, axis=1)
        else:
            return None
        return exclude if exclude.any() else None

    def check_dataset(self, dataset_fingerprint: Optional[str]) -> None:
        """Refuse an analysis whose manifest records another dataset than `dataset_fingerprint`."""
        manifest = self.manifest()
        recorded = manifest.get("dataset_fingerprint") if manifest else None
        if recorded and dataset_fingerprint and recorded != dataset_fingerprint:
            raise ValueError(
                f"{self.path} is an analysis of another dataset: its {MANIFEST} records dataset_fingerprint "
                f"{recorded} (data {manifest.get('data')!r}, max_length {manifest.get('max_length')}), the "
                f"training data has {dataset_fingerprint}. Rerun `ds-cluster analyze` on the training data with "
                "the same --max-length, or point analysis_path at its analysis")

    def _require_folder(self) -> None:
        if not self.path.is_dir():
            raise FileNotFoundError(
                f"analysis directory {self.path} does not exist (or is not visible to this rank; it must be on a "
                "filesystem every rank can read); run `ds-cluster analyze` first, or let the training job compute "
                "it (cluster_sampling.analysis_path pointing at a folder that does not exist yet)")

    def _array(self, name: str, ndim: int) -> Optional[np.ndarray]:
        path = self.path / name
        if not path.exists():
            return None
        try:
            array = np.load(path, allow_pickle=False, mmap_mode="r")
        except (OSError, ValueError) as err:
            raise ValueError(f"{path}: unreadable or truncated .npy file ({err}); rerun `ds-cluster analyze`") from None
        if array.ndim != ndim:
            raise ValueError(f"{path}: expected a {ndim}-D array, got shape {array.shape}")
        return np.asarray(array)

    def _json(self, name: str) -> Optional[dict[str, Any]]:
        path = self.path / name
        if not path.exists():
            return None
        try:
            document = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise ValueError(f"{path}: unreadable or not valid JSON ({err}); rerun `ds-cluster analyze`") from None
        if not isinstance(document, dict):
            raise ValueError(f"{path}: expected a JSON object; rerun `ds-cluster analyze`")
        return document

    # ------------------------------------------------------------------ write
    def write(self, arrays: dict[str, np.ndarray], manifest: dict[str, Any], summary: dict[str, Any],
              store: Optional[Path] = None, target: Optional[AnalysedTarget] = None,
              kept: Sequence[str] = ()) -> None:
        """Write a whole analysis and swap it in for the folder's current content.

        A feature store kept inside the folder (`store`) is moved into the new one; `target`: its target examples'
        files, and the manifest's `target_fingerprint`; `kept`: files of the current folder that go into the new one
        as they are (linked, not copied).
        """
        manifest = {"format_version": ANALYSIS_FORMAT_VERSION, **manifest}
        if target is not None:
            arrays = {**arrays, TARGET_FEATURES: np.asarray(target.features, dtype=np.float32)}
            manifest["target_fingerprint"] = target.fingerprint
        staging = staging_dir(self.path)
        carried = store is not None and store.exists() and store.parent.resolve() == self.path.resolve()
        try:
            try:
                for name in kept:
                    _link_or_copy(self.path / name, staging / name)
                for name, array in arrays.items():
                    write_npy_atomic(staging / name, array)
                if target is not None:
                    write_json_atomic(staging / TARGET, target.to_json())
                write_json_atomic(staging / MANIFEST, manifest)
                write_json_atomic(staging / SUMMARY, summary)
            except OSError as err:
                raise self._write_error(err, staging, arrays) from err
            if carried:
                os.rename(store, staging / store.name)
            try:
                replace_dir(staging, self.path)
            except BaseException:
                if carried and not store.exists():
                    os.rename(staging / store.name, store)
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def replace_target(self, target: AnalysedTarget) -> None:
        """The same analysis with another target set: its arrays, summary and feature store as they are, the target's
        files and the manifest's `target_fingerprint` new; swapped in whole, so a failure leaves the old one."""
        self._require_folder()
        manifest = self.manifest() or {}
        summary = self.summary() or {}
        manifest.pop("format_version", None)
        summary["target"] = {"num_examples": int(np.asarray(target.groups).size), "examples": target.counts()}
        kept = [path.name for path in self.path.iterdir() if path.is_file()
                and path.name not in (MANIFEST, SUMMARY, TARGET, TARGET_FEATURES)]
        store = self.store_path()
        self.write({}, manifest, summary, store=store if store.is_dir() else None, target=target, kept=kept)

    def _write_error(self, err: OSError, staging: Path, arrays: dict[str, np.ndarray]) -> OSError:
        """The write error with what it means: numpy reports a full disk only as "N requested and M written"."""
        needed = sum(int(array.nbytes) for array in arrays.values())
        written = sum(path.stat().st_size for path in staging.iterdir() if path.is_file())
        free = shutil.disk_usage(staging).free
        full = err.errno == errno.ENOSPC or free < needed - written
        if full:
            cause = (f"No space left on device: {free} bytes free in {self.path.parent}, the new analysis needs "
                     f"about {needed} (and the previous one stays until it is replaced); free space or choose "
                     "another --out")
        else:
            cause = f"{err.strerror or err}; choose another --out"
        code = errno.ENOSPC if full else (err.errno or errno.EIO)
        return OSError(code, f"cannot write the analysis {self.path}: {cause}. The previous analysis there, if any, "
                             "is unchanged")


def _link_or_copy(source: Path, destination: Path) -> None:
    """`source` at `destination` too: a hard link (no copy of a large array), else a copy."""
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)
