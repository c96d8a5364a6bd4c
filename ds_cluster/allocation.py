"""Stage 4: place the kept samples over optimizer steps x ranks x micro-steps.

Pure numpy. Two modes:
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

from typing import Literal

import numpy as np

from ds_cluster.selection import stable_label_order

AllocationMode = Literal["stratified", "cluster_per_rank"]


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


def epoch_schedule(
    selected: np.ndarray,
    selected_labels: np.ndarray,
    num_clusters: int,
    *,
    world_size: int,
    micro_batch_size: int,
    gradient_accumulation_steps: int,
    mode: AllocationMode,
    seed: int,
    epoch: int,
    quotas: np.ndarray | None = None,
    members: list[np.ndarray] | None = None,
) -> np.ndarray:
    """Sample indices for one epoch: int64 (steps, world, gas, micro).

    `members` (each cluster's kept indices, from `cluster_members`) may be
    passed in to save a sort per epoch.
    """
    check_batch_shape(world_size, micro_batch_size, gradient_accumulation_steps)
    if members is None:
        members = cluster_members(selected, selected_labels, num_clusters)
    rng = np.random.default_rng([seed, epoch, 0xA110C])
    members = [group[rng.permutation(group.size)] for group in members]  # this epoch's order
    per_rank = micro_batch_size * gradient_accumulation_steps
    if mode == "cluster_per_rank":
        if num_clusters != world_size:
            raise ValueError(
                f"allocation 'cluster_per_rank' needs num_clusters == world size, got K={num_clusters}, "
                f"W={world_size}; use num_clusters 'auto' or allocation 'stratified'"
            )
        steps = min(len(m) for m in members) // per_rank
        by_rank = np.stack([m[:steps * per_rank] for m in members])  # (W, steps*per_rank)
        return np.ascontiguousarray(
            by_rank.reshape(world_size, steps, gradient_accumulation_steps, micro_batch_size).transpose(1, 0, 2, 3)
        )
    if mode != "stratified":
        raise ValueError(f"allocation must be 'stratified' or 'cluster_per_rank', got {mode!r}")
    global_batch = world_size * per_rank
    kept_sizes = np.array([len(m) for m in members], dtype=np.int64)
    if quotas is None:
        quotas = batch_quotas(kept_sizes, global_batch)
    steps = quotas.shape[0]
    batches = np.empty((steps, global_batch), dtype=np.int64)
    # Inside a batch the clusters sit one after another; offset of cluster c in batch b:
    offset_in_batch = np.cumsum(quotas, axis=1) - quotas
    for cluster in range(num_clusters):
        counts = quotas[:, cluster]
        used = int(counts.sum())
        batch_of = np.repeat(np.arange(steps), counts)
        start_of_batch = np.cumsum(counts) - counts
        position = np.arange(used) - np.repeat(start_of_batch, counts) + offset_in_batch[batch_of, cluster]
        batches[batch_of, position] = members[cluster][:used]
    # Deal each batch out round-robin: slot p goes to rank p % W, so every rank
    # and micro-step gets a near-even share of every cluster.
    return np.ascontiguousarray(
        batches.reshape(steps, micro_batch_size, gradient_accumulation_steps, world_size).transpose(0, 3, 2, 1)
    )


def cluster_members(selected: np.ndarray, selected_labels: np.ndarray, num_clusters: int) -> list[np.ndarray]:
    """The kept indices of each cluster, in index order."""
    selected = np.asarray(selected, dtype=np.int64)
    order = stable_label_order(selected_labels)
    bounds = np.searchsorted(np.asarray(selected_labels)[order], np.arange(num_clusters + 1))
    return [selected[order[bounds[c]:bounds[c + 1]]] for c in range(num_clusters)]


def check_batch_shape(world_size: int, micro_batch_size: int, gradient_accumulation_steps: int) -> None:
    for name, value in (("world_size", world_size), ("micro_batch_size", micro_batch_size),
                        ("gradient_accumulation_steps", gradient_accumulation_steps)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
