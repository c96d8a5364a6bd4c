"""Stage 5d, the placement: the kept samples laid out over optimizer steps x ranks x micro-steps.

Pure numpy. Each allocation rule is an object with one interface
(`Allocation`) in `ALLOCATIONS` (the `allocation` key):

- "stratified": every global batch (B = world x micro x gas samples) holds
  each cluster c within one of B * s_c / S, spread over ranks and
  micro-steps; floor(S / B) full batches per epoch, the rest of that epoch's
  order dropped.
- "cluster_per_rank" (the paper, K = world size): rank r trains cluster r
  only; every cluster keeps the same count, so every rank runs the same
  number of micro-steps.

Clusters are shuffled inside themselves every epoch from (seed, epoch).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
import warnings
from typing import Any, ClassVar, Optional

import numpy as np

from ds_cluster.batching import BatchShape
from ds_cluster.planning.selection import stable_label_order
from ds_cluster.registry import Registry


class Allocation(ABC):
    """How one epoch's kept samples are laid out as (steps, world, accumulation, micro) indices."""

    name: ClassVar[str]

    @abstractmethod
    def check(self, kept_sizes: np.ndarray, shape: BatchShape) -> None:
        """Raise ValueError (saying what to change) when the rule cannot lay these clusters out."""

    @abstractmethod
    def quotas(self, kept_sizes: np.ndarray, shape: BatchShape) -> np.ndarray:
        """Samples of each cluster in each global batch: int64 (steps, K); the same every epoch."""

    @abstractmethod
    def layout(self, members: list[np.ndarray], quotas: np.ndarray, shape: BatchShape) -> np.ndarray:
        """One epoch from each cluster's (shuffled) kept indices: int64 (steps, world, accumulation, micro)."""

    @abstractmethod
    def rank_layout(self, members: list[np.ndarray], quotas: np.ndarray, shape: BatchShape, rank: int) -> np.ndarray:
        """One rank's part of `layout` (steps, accumulation, micro), built without the other ranks' parts."""

    @abstractmethod
    def too_small(self, kept_sizes: np.ndarray, shape: BatchShape) -> str:
        """Why not even one optimizer step fits (for the error when steps per epoch is 0)."""

    def steps_per_epoch(self, kept_sizes: np.ndarray, shape: BatchShape) -> int:
        return int(self.quotas(kept_sizes, shape).shape[0])


class Stratified(Allocation):
    """Every global batch holds each cluster in proportion to its kept size, dealt round-robin over ranks."""

    name = "stratified"

    def check(self, kept_sizes: np.ndarray, shape: BatchShape) -> None:
        return None

    def quotas(self, kept_sizes: np.ndarray, shape: BatchShape) -> np.ndarray:
        return batch_quotas(kept_sizes, shape.global_batch_size)

    def steps_per_epoch(self, kept_sizes: np.ndarray, shape: BatchShape) -> int:
        return int(np.asarray(kept_sizes).sum()) // shape.global_batch_size

    def layout(self, members: list[np.ndarray], quotas: np.ndarray, shape: BatchShape) -> np.ndarray:
        steps, global_batch = quotas.shape[0], shape.global_batch_size
        batches = np.empty((steps, global_batch), dtype=np.int64)
        # Inside a batch the clusters sit one after another; offset of cluster c in batch b:
        offset_in_batch = np.cumsum(quotas, axis=1) - quotas
        for cluster, group in enumerate(members):
            counts = quotas[:, cluster]
            used = int(counts.sum())
            batch_of = np.repeat(np.arange(steps), counts)
            start_of_batch = np.cumsum(counts) - counts
            position = np.arange(used) - np.repeat(start_of_batch, counts) + offset_in_batch[batch_of, cluster]
            batches[batch_of, position] = group[:used]
        # Deal each batch out round-robin: slot p goes to rank p % W, so every rank
        # and micro-step gets a near-even share of every cluster.
        return np.ascontiguousarray(
            batches.reshape(steps, shape.micro_batch_size, shape.gradient_accumulation_steps, shape.world_size)
            .transpose(0, 3, 2, 1))

    def rank_layout(self, members: list[np.ndarray], quotas: np.ndarray, shape: BatchShape, rank: int) -> np.ndarray:
        # Slot p of a global batch goes to rank p % W (see layout): this rank's slots, micro-major.
        steps = quotas.shape[0]
        micro, accumulation, world = shape.micro_batch_size, shape.gradient_accumulation_steps, shape.world_size
        slots = (np.arange(micro)[None, :] * accumulation * world + np.arange(accumulation)[:, None] * world
                 + rank).ravel()  # (accumulation * micro,), in (accumulation, micro) order
        ends = np.cumsum(quotas, axis=1)  # where each cluster's segment ends inside a batch
        # The cluster of every slot of every step, with one search over all steps' segment ends.
        batch_size = shape.global_batch_size
        flat_ends = (ends + (np.arange(steps, dtype=np.int64) * batch_size)[:, None]).ravel()
        wanted = (np.arange(steps, dtype=np.int64) * batch_size)[:, None] + slots[None, :]
        cluster = np.searchsorted(flat_ends, wanted, side="right") - (np.arange(steps) * quotas.shape[1])[:, None]
        offset = np.take_along_axis(ends - quotas, cluster, axis=1)
        # Where each cluster's stream is at the start of each step, and where it sits in one flat array.
        taken_before = np.take_along_axis(np.cumsum(quotas, axis=0) - quotas, cluster, axis=1)
        sizes = np.array([group.size for group in members], dtype=np.int64)
        flat = np.concatenate(members) if members else np.zeros(0, dtype=np.int64)
        position = (np.cumsum(sizes) - sizes)[cluster] + taken_before + (slots[None, :] - offset)
        return flat[position].reshape(steps, accumulation, micro)

    def too_small(self, kept_sizes: np.ndarray, shape: BatchShape) -> str:
        return (f"one global batch ({shape.global_batch_size} samples = world {shape.world_size} x micro "
                f"{shape.micro_batch_size} x gas {shape.gradient_accumulation_steps})")


class ClusterPerRank(Allocation):
    """The paper's layout: rank r trains cluster r only, every cluster keeping the same count."""

    name = "cluster_per_rank"

    def check(self, kept_sizes: np.ndarray, shape: BatchShape) -> None:
        if len(kept_sizes) != shape.world_size:
            raise ValueError(
                f"allocation 'cluster_per_rank' trains cluster r on rank r, so num_clusters must equal the world "
                f"size: K={len(kept_sizes)}, W={shape.world_size}; set num_clusters 'auto' or allocation 'stratified'")
        if len(set(np.asarray(kept_sizes).tolist())) != 1:
            raise ValueError(
                f"allocation 'cluster_per_rank' needs the same kept count in every cluster, got "
                f"{np.asarray(kept_sizes).tolist()}; use budget_mode 'min' (the paper's) or allocation 'stratified'")

    def quotas(self, kept_sizes: np.ndarray, shape: BatchShape) -> np.ndarray:
        steps = int(np.asarray(kept_sizes).min()) // shape.per_rank
        return np.full((steps, len(kept_sizes)), shape.per_rank, dtype=np.int64)

    def layout(self, members: list[np.ndarray], quotas: np.ndarray, shape: BatchShape) -> np.ndarray:
        steps = quotas.shape[0]
        by_rank = np.stack([group[:steps * shape.per_rank] for group in members])  # (W, steps * per_rank)
        return np.ascontiguousarray(
            by_rank.reshape(shape.world_size, steps, shape.gradient_accumulation_steps, shape.micro_batch_size)
            .transpose(1, 0, 2, 3))

    def rank_layout(self, members: list[np.ndarray], quotas: np.ndarray, shape: BatchShape, rank: int) -> np.ndarray:
        steps = quotas.shape[0]
        return members[rank][:steps * shape.per_rank].reshape(steps, shape.gradient_accumulation_steps,
                                                              shape.micro_batch_size)

    def too_small(self, kept_sizes: np.ndarray, shape: BatchShape) -> str:
        return (f"one global batch per rank (cluster_per_rank: {shape.per_rank} samples = micro "
                f"{shape.micro_batch_size} x gas {shape.gradient_accumulation_steps} on each of the "
                f"{shape.world_size} ranks)")


ALLOCATIONS: Registry[Allocation] = Registry("allocation", (Stratified(), ClusterPerRank()))


def batch_quotas(kept_sizes: np.ndarray, global_batch: int) -> np.ndarray:
    """How many samples of each cluster go in each global batch: int64 (steps, K).

    Each entry is floor or ceil of B * s_c / S, every row sums to B, and a
    cluster's running total stays within one of its proportional share, so
    no cluster is asked for more than it kept. Which clusters get the ceiling
    in a step goes to those furthest behind their share (ties: lower index).
    """
    kept = np.asarray(kept_sizes, dtype=np.int64)
    total = int(kept.sum())
    steps = total // global_batch
    shares = global_batch * kept / total
    floors = np.floor(shares + 1e-12).astype(np.int64)
    fractional = shares - floors
    extra_per_step = global_batch - int(floors.sum())
    quotas = np.empty((steps, kept.size), dtype=np.int64)
    taken = np.zeros(kept.size, dtype=np.int64)
    index = np.arange(kept.size)
    for step in range(steps):
        row = floors.copy()
        if extra_per_step:
            behind = (step + 1) * shares - (taken + floors)
            eligible = (fractional > 1e-12) & (taken + floors + 1 <= kept)
            order = np.lexsort((index, -behind, ~eligible))
            row[order[:extra_per_step]] += 1
        quotas[step] = row
        taken += row
    if (taken > kept).any():  # pragma: no cover - guarded by the eligibility rule above
        raise AssertionError("batch quotas exceed a cluster's kept count")
    return quotas


def cluster_members(selected: np.ndarray, selected_labels: np.ndarray, num_clusters: int) -> list[np.ndarray]:
    """The kept indices of each cluster, in index order."""
    selected = np.asarray(selected, dtype=np.int64)
    order = stable_label_order(selected_labels)
    counts = np.bincount(np.asarray(selected_labels), minlength=num_clusters)
    bounds = np.concatenate([[0], np.cumsum(counts)])
    # When every sample is kept, selected is 0..N-1 and `order` already holds the indices.
    indices = order if selected.size and selected[-1] == selected.size - 1 and selected[0] == 0 else selected[order]
    return [indices[bounds[c]:bounds[c + 1]] for c in range(num_clusters)]


def shuffled_members(members: list[np.ndarray], seed: int, epoch: int) -> list[np.ndarray]:
    """Each cluster's kept indices in this epoch's order (from (seed, epoch) only: the same on every rank)."""
    rng = np.random.default_rng([seed, epoch, 0xA110C])
    return [group[rng.permutation(group.size)] for group in members]


def epoch_layout(members: list[np.ndarray], allocation: Allocation, shape: BatchShape, *, seed: int, epoch: int,
                 quotas: np.ndarray, rank: Optional[int] = None) -> np.ndarray:
    """Sample indices of one epoch: int64 (steps, world, accumulation, micro), or one rank's
    (steps, accumulation, micro) when `rank` is given (only that part is built: O(N / W) memory).

    `members` are each cluster's kept indices (`cluster_members`); they are
    shuffled inside each cluster from (seed, epoch), then laid out.
    """
    shuffled = shuffled_members(members, seed, epoch)
    if rank is None:
        return allocation.layout(shuffled, quotas, shape)
    return allocation.rank_layout(shuffled, quotas, shape, rank)


def epoch_schedule(*args: Any, **kwargs: Any) -> np.ndarray:
    """0.5.0's name of `epoch_layout`."""
    warnings.warn("epoch_schedule is epoch_layout since 0.6.0", DeprecationWarning, stacklevel=2)
    return epoch_layout(*args, **kwargs)
