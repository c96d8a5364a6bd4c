"""The pure middle: clusters -> budget -> selection -> weights -> allocation, as one Plan.

`build_plan` composes these stages over the clusters the clustering stage made (`clustering.samples`); a Plan
holds plain arrays, builds each epoch's layout on demand, fingerprints itself, and saves to a folder. No torch,
no process group: every rank builds the same Plan and compares fingerprints.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np

from ds_cluster.batching import BatchShape
from ds_cluster.clustering.samples import Clusters, PlanInputs, cluster_samples
from ds_cluster.fileio import replace_dir, staging_dir, write_json_atomic, write_npy_atomic
from ds_cluster.planning.allocation import ALLOCATIONS, Allocation, cluster_members, epoch_layout
from ds_cluster.planning.budget import BUDGETS, budget_total, cluster_budgets, cluster_spreads
from ds_cluster.planning.selection import (SELECTIONS, UNIFORM, SelectionInputs, TargetedInputs,
                                           select_in_clusters)
from ds_cluster.planning.targeted import TargetRows
from ds_cluster.planning.weights import WEIGHTINGS, sample_weights
from ds_cluster.settings import StageSettings, stages_of


logger = logging.getLogger(__name__)

PLAN_FORMAT = 1
_ARRAYS = ("labels", "centroids", "distances", "selected", "weights", "cluster_sizes", "kept_sizes")


@dataclass
class Plan:
    """What to train on, with which weight, where and when.

    labels: cluster of every sample (N,), -1 for samples left out (no features);
    selected: sorted indices kept; weights: (N,) float64, 0 where not kept.
    """

    labels: np.ndarray
    centroids: np.ndarray
    distances: np.ndarray
    selected: np.ndarray
    weights: np.ndarray
    cluster_sizes: np.ndarray
    kept_sizes: np.ndarray
    world_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    allocation: str
    seed: int
    settings: dict[str, Any] = field(default_factory=dict)
    _quotas: Optional[np.ndarray] = field(default=None, repr=False, compare=False)
    _members: Optional[list] = field(default=None, repr=False, compare=False)
    _fingerprint: Optional[str] = field(default=None, repr=False, compare=False)

    # ----------------------------------------------------------------- shape
    @property
    def num_samples(self) -> int:
        return int(self.labels.shape[0])

    @property
    def num_clusters(self) -> int:
        return int(self.cluster_sizes.shape[0])

    @property
    def num_kept(self) -> int:
        return int(self.selected.shape[0])

    @property
    def batch_shape(self) -> BatchShape:
        return BatchShape(self.world_size, self.micro_batch_size, self.gradient_accumulation_steps)

    @property
    def allocation_rule(self) -> Allocation:
        """The rule `allocation` names: how the kept samples are laid out over steps, ranks and micro-steps."""
        return ALLOCATIONS.get_rule(self.allocation)

    @property
    def global_batch_size(self) -> int:
        return self.batch_shape.global_batch_size

    @property
    def steps_per_epoch(self) -> int:
        return self.allocation_rule.steps_per_epoch(self.kept_sizes, self.batch_shape)

    @property
    def selected_labels(self) -> np.ndarray:
        return self.labels[self.selected]

    # -------------------------------------------------------------- schedule
    def quotas(self) -> np.ndarray:
        """Per global batch, how many samples of each cluster (steps, K); the same every epoch."""
        if self._quotas is None:
            self._quotas = self.allocation_rule.quotas(self.kept_sizes, self.batch_shape)
        return self._quotas

    def epoch_layout(self, epoch: int) -> np.ndarray:
        """Sample indices of one epoch: int64 (steps, world_size, gradient_accumulation_steps, micro_batch_size)."""
        return epoch_layout(self._cluster_members(), self.allocation_rule, self.batch_shape, seed=self.seed,
                            epoch=epoch, quotas=self.quotas())

    def rank_layout(self, epoch: int, rank: int) -> np.ndarray:
        """One rank's part of `epoch_layout(epoch)`: int64 (steps, accumulation, micro), built alone (O(N / W))."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the plan's world size {self.world_size}")
        return epoch_layout(self._cluster_members(), self.allocation_rule, self.batch_shape, seed=self.seed,
                            epoch=epoch, quotas=self.quotas(), rank=rank)

    def schedule(self, epoch: int) -> np.ndarray:
        """0.5.0's name of `epoch_layout`."""
        warnings.warn("Plan.schedule(epoch) is Plan.epoch_layout(epoch) since 0.6.0", DeprecationWarning,
                      stacklevel=2)
        return self.epoch_layout(epoch)

    def rank_schedule(self, epoch: int, rank: int) -> np.ndarray:
        """0.5.0's name of `rank_layout`."""
        warnings.warn("Plan.rank_schedule(epoch, rank) is Plan.rank_layout(epoch, rank) since 0.6.0",
                      DeprecationWarning, stacklevel=2)
        return self.rank_layout(epoch, rank)

    def _cluster_members(self) -> list:
        if self._members is None:
            self._members = cluster_members(self.selected, self.selected_labels, self.num_clusters)
        return self._members

    # ---------------------------------------------------------- fingerprint
    def fingerprint(self) -> str:
        """Short hash of everything that determines the plan (arrays, batch shape, settings)."""
        if self._fingerprint is None:
            self._fingerprint = self._compute_fingerprint()
        return self._fingerprint

    def _compute_fingerprint(self) -> str:
        digest = hashlib.sha256()
        for name in ("labels", "selected", "weights", "cluster_sizes", "kept_sizes"):
            array = np.ascontiguousarray(getattr(self, name))
            digest.update(name.encode())
            digest.update(str(array.dtype).encode())
            digest.update(array)  # the buffer itself: tobytes() copied N-sized arrays (0.1 s, 80 MB at N = 10M)
        digest.update(json.dumps(self._scalars(), sort_keys=True, default=str).encode())
        return digest.hexdigest()[:16]

    def _scalars(self) -> dict[str, Any]:
        """The non-array fields: what plan.json holds beside the arrays, and what the fingerprint hashes."""
        return {
            "world_size": self.world_size,
            "micro_batch_size": self.micro_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "allocation": self.allocation,
            "seed": self.seed,
            "settings": self.settings,
        }

    # ------------------------------------------------------------ save/load
    def save(self, directory: Union[str, os.PathLike]) -> Path:
        """Write the plan to a folder atomically: built in a hidden sibling, then swapped in."""
        target = Path(directory)
        staging = staging_dir(target)
        try:
            for name in _ARRAYS:
                write_npy_atomic(staging / f"{name}.npy", getattr(self, name))
            write_json_atomic(staging / "plan.json", {"format": PLAN_FORMAT, **self._scalars(),
                                                      "fingerprint": self.fingerprint()})
            replace_dir(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)  # gone already when the swap succeeded
        return target

    @classmethod
    def load(cls, directory: Union[str, os.PathLike]) -> "Plan":
        """Read a saved plan and check it against its recorded fingerprint."""
        source = Path(directory)
        meta_path = source / "plan.json"
        if not meta_path.exists():
            raise FileNotFoundError(f"no plan at {source}: {meta_path} is missing")
        try:
            meta = json.loads(meta_path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{meta_path}: not valid JSON ({err.msg})") from None
        if meta.get("format") != PLAN_FORMAT:
            raise ValueError(f"{meta_path}: plan format {meta.get('format')} is not {PLAN_FORMAT}")
        missing = [key for key in ("world_size", "micro_batch_size", "gradient_accumulation_steps", "allocation",
                                   "seed", "settings", "fingerprint") if key not in meta]
        if missing:
            raise ValueError(f"{meta_path}: missing {', '.join(missing)} (not written by Plan.save, or corrupt)")
        arrays = {}
        for name in _ARRAYS:
            path = source / f"{name}.npy"
            try:
                arrays[name] = np.load(path, allow_pickle=False)
            except (OSError, ValueError) as err:
                raise ValueError(f"{path}: unreadable or truncated ({err})") from None
        plan = cls(**arrays, world_size=meta["world_size"], micro_batch_size=meta["micro_batch_size"],
                   gradient_accumulation_steps=meta["gradient_accumulation_steps"],
                   allocation=meta["allocation"], seed=meta["seed"], settings=meta["settings"])
        if plan._compute_fingerprint() != meta["fingerprint"]:
            raise ValueError(f"{source}: the plan's arrays do not match its recorded fingerprint (corrupt files?)")
        return plan

    # -------------------------------------------------------------- summary
    def summary(self) -> dict[str, Any]:
        """Plain numbers a person wants to see before training on the plan."""
        kept_weights = self.weights[self.selected]
        effective = float(kept_weights.sum() ** 2 / max((kept_weights ** 2).sum(), 1e-300))
        quotas = self.quotas()
        return {
            "num_samples": self.num_samples,
            "num_excluded": int((self.labels < 0).sum()),
            "num_clusters": self.num_clusters,
            "cluster_sizes": self.cluster_sizes.tolist(),
            "kept_sizes": self.kept_sizes.tolist(),
            "num_kept": self.num_kept,
            "kept_fraction": self.num_kept / max(self.num_samples, 1),
            "weight_min": float(kept_weights.min()),
            "weight_max": float(kept_weights.max()),
            "effective_sample_size": effective,
            "world_size": self.world_size,
            "micro_batch_size": self.micro_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "global_batch_size": self.global_batch_size,
            "steps_per_epoch": self.steps_per_epoch,
            "samples_per_epoch": self.steps_per_epoch * self.global_batch_size,
            "allocation": self.allocation,
            "clusters_per_step_min": int((quotas > 0).sum(axis=1).min()) if quotas.size else 0,
            "fingerprint": self.fingerprint(),
        }


def build_plan(clusters: Any, settings: Any, shape: Optional[BatchShape] = None, target: Optional[TargetRows] = None,
               **old_call: Any) -> Plan:
    """Select a balanced subset of the clusters, weight it, and lay it out for the batch shape.

    `clusters`: every sample's cluster (`clustering.samples.cluster_samples`: k-means of an analysis's features, or
    its labels). `settings`: the `cluster_sampling` block (a ClusterSamplingConfig) or its `StageSettings`; the plan
    reads the selection settings and records every stage's (`StageSettings.plan_record`). `shape`: the data-parallel
    ranks, micro batch and accumulation steps. `target`: the target examples' feature rows and targets (an analysis's
    `AnalysisDir.load_target()`), which a targeted selection ("round_robin", "clusters") reads; it chooses the whole
    subset, and the clusters' kept counts follow from it; the plan then records the target's fingerprint.

    0.6.0's call, `build_plan(features, config, world_size=, micro_batch_size=, gradient_accumulation_steps=,
    labels=, exclude=, distances=, centroids=)`, still works (with a DeprecationWarning): it clusters first.
    """
    if not isinstance(clusters, Clusters):
        warnings.warn("build_plan(features, config, world_size=..., ...) is build_plan(cluster_samples(PlanInputs("
                      "...), settings.clustering, world_size), settings, BatchShape(...)) since 0.7.0",
                      DeprecationWarning, stacklevel=2)
        clusters, shape = _clusters_of_0_6_call(clusters, settings, shape, old_call)
    elif old_call or shape is None:
        raise TypeError("build_plan(clusters, settings, shape): give the batch shape as a BatchShape")
    stages: StageSettings = stages_of(settings)
    chosen = stages.selection
    allocation = ALLOCATIONS.get_rule(chosen.allocation)
    selection = SELECTIONS.get_rule(chosen.selection)
    num_clusters, num_samples = clusters.num_clusters, clusters.num_samples
    cluster_sizes = np.bincount(clusters.taking_part(clusters.labels), minlength=num_clusters).astype(np.int64)
    record = stages.plan_record()
    if selection.targeted:
        selected, kept_sizes = _targeted_selection(clusters, chosen, selection, cluster_sizes, target)
        record["target"] = {**record["target"], "fingerprint": getattr(target, "fingerprint", None)}
        allocation.check(kept_sizes, shape)
    else:
        kept_sizes = _cluster_budgets(clusters, chosen, selection, cluster_sizes)
        allocation.check(kept_sizes, shape)
        selected = _select_in_clusters(clusters, chosen, selection, cluster_sizes, kept_sizes)
    weights = sample_weights(clusters.labels, selected, cluster_sizes, kept_sizes, chosen.weighting,
                             temperature=chosen.weight_temperature)

    plan = Plan(labels=clusters.labels, centroids=clusters.centroids, distances=clusters.distances, selected=selected,
                weights=weights, cluster_sizes=cluster_sizes, kept_sizes=kept_sizes, world_size=shape.world_size,
                micro_batch_size=shape.micro_batch_size, gradient_accumulation_steps=shape.gradient_accumulation_steps,
                allocation=chosen.allocation, seed=chosen.seed, settings=record)
    if plan.steps_per_epoch < 1:
        raise ValueError(
            f"the kept subset ({plan.num_kept} samples, smallest cluster keeps {int(kept_sizes.min())}) is smaller "
            f"than {allocation.too_small(kept_sizes, shape)}; raise budget_ratio or lower the batch size"
        )
    logger.info("plan %s: %d clusters, kept %d of %d, %d steps per epoch", plan.fingerprint(), num_clusters,
                plan.num_kept, num_samples, plan.steps_per_epoch)
    return plan


def _cluster_budgets(clusters: Clusters, chosen: Any, selection: Any, cluster_sizes: np.ndarray) -> np.ndarray:
    """The budget rule's kept count per cluster."""
    budget = BUDGETS.get_rule(chosen.budget_mode)
    if selection.reads_features and clusters.features is None and clusters.has_geometry:
        raise ValueError(f"selection '{selection.name}' needs the features themselves, and there are none "
                         "(no features.npy in the analysis); use 'peripheral', 'spread' or 'random'")
    taking_part = clusters.taking_part(clusters.labels)
    return cluster_budgets(
        cluster_sizes, budget, chosen.planned_ratio, chosen.budget_samples,
        # Only a rule that reads them gets the spreads (0.1 to 0.3 s at N = 10M).
        cluster_spreads(clusters.taking_part(clusters.distances), taking_part, clusters.num_clusters)
        if clusters.has_geometry and budget.needs_spreads else None,
    )


def _select_in_clusters(clusters: Clusters, chosen: Any, selection: Any, cluster_sizes: np.ndarray,
                        kept_sizes: np.ndarray) -> np.ndarray:
    """The selection rule's kept samples of each cluster, kept_sizes[c] of cluster c."""
    points, has_geometry = clusters.features, clusters.has_geometry
    needs_choice = bool((kept_sizes < cluster_sizes).any())
    selection = selection if (has_geometry or needs_choice) else UNIFORM
    norms = None
    if has_geometry and selection.reads_norms:
        assert points is not None
        norms = np.full(clusters.num_samples, np.nan)
        norms[clusters.rows] = _row_norms(clusters.taking_part(points))
    return select_in_clusters(clusters.labels, kept_sizes, selection, SelectionInputs(
        distances=clusters.distances if has_geometry else None, norms=norms,
        features=points if selection.reads_rows else None, seed=chosen.seed,
        dedup_similarity=chosen.dedup_similarity, dedup_centre=chosen.dedup_centre))


def _targeted_selection(clusters: Clusters, chosen: Any, selection: Any, cluster_sizes: np.ndarray,
                        target: Optional[TargetRows]) -> tuple[np.ndarray, np.ndarray]:
    """A targeted rule's subset of budget S (budget_samples, else round(r x N)) and the kept count per cluster."""
    if chosen.target is None:
        raise ValueError(f"selection '{selection.name}' reads target examples: set cluster_sampling.target")
    if target is None:
        raise ValueError(f"selection '{selection.name}' reads the target examples' features, and there are none: "
                         "make the analysis with the target (`ds-cluster analyze --target`, or let the training job "
                         "compute it with cluster_sampling.target set)")
    if clusters.features is None:
        raise ValueError(f"selection '{selection.name}' compares the records' features with the target's, and the "
                         "analysis holds none (no features.npy): rerun `ds-cluster analyze`")
    if np.asarray(target.features).ndim != 2 or np.asarray(target.features).shape[1] != clusters.features.shape[1]:
        raise ValueError(f"the target's features have shape {np.asarray(target.features).shape} but the records' "
                         f"have dimension {clusters.features.shape[1]}: they were not computed together; rerun the "
                         "analysis with the target")
    if WEIGHTINGS.get_rule(chosen.weighting).rebalances and chosen.weight_temperature > 0:
        logger.warning("selection '%s' with weighting '%s': the loss weights give every cluster back its share of "
                       "the whole data, against the target's choice; \"weighting\": \"none\" trains the subset as "
                       "it is (docs/targeted.md)", selection.name, chosen.weighting)
    total = budget_total(cluster_sizes, chosen.planned_ratio, chosen.budget_samples)
    selected = selection.select_toward(TargetedInputs(
        features=clusters.features, labels=clusters.labels, centroids=clusters.centroids, target=target,
        total=total, floor=chosen.target.cluster_floor, dedup_similarity=chosen.dedup_similarity,
        dedup_centre=chosen.dedup_centre))
    kept_sizes = np.bincount(clusters.labels[selected], minlength=clusters.num_clusters).astype(np.int64)
    return selected, kept_sizes


def _clusters_of_0_6_call(features: Optional[np.ndarray], settings: Any, shape: Optional[BatchShape],
                          old_call: dict[str, Any]) -> tuple[Clusters, BatchShape]:
    """The clusters and batch shape of 0.6.0's `build_plan(features, config, world_size=..., ...)`."""
    shape_keys = ("world_size", "micro_batch_size", "gradient_accumulation_steps")
    input_keys = ("labels", "exclude", "distances", "centroids")
    unknown = set(old_call) - set(shape_keys) - set(input_keys)
    if shape is not None or unknown or any(key not in old_call for key in shape_keys):
        raise TypeError("build_plan(clusters, settings, shape): clusters from clustering.samples.cluster_samples, "
                        "shape a BatchShape")
    shape = BatchShape(*(int(old_call[key]) for key in shape_keys))
    inputs = PlanInputs(features, **{key: old_call.get(key) for key in input_keys})
    return cluster_samples(inputs, stages_of(settings).clustering, shape.world_size), shape


def _row_norms(points: np.ndarray, chunk: int = 65536) -> np.ndarray:
    norms = np.empty(points.shape[0], dtype=np.float64)
    for start in range(0, points.shape[0], chunk):
        block = points[start:start + chunk].astype(np.float64)
        norms[start:start + chunk] = np.sqrt(np.einsum("ij,ij->i", block, block))
    return norms
