"""How the features pass batches a dataset and shares the batches over the ranks: samples of similar length together,
each batch cut to its longest row, fixed in advance so a resumed feature store matches an uninterrupted one; the
batches dealt evenly over the ranks whatever the number of samples and store shards."""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np
import torch

from ds_cluster.collectives import Collectives
from ds_cluster.data.dataset import trim_padding


def _collate(dataset: Sequence[dict], indices: Sequence[int], trim: bool = True) -> dict[str, torch.Tensor]:
    """A batch of the samples `indices`, cut to its longest row (`trim_padding`) when `trim`.

    Under causal attention no real position sees the padding on its right, so a row's features do not
    depend on the width but in the last bits of float rounding; a sample's batch is fixed in advance
    (`_batches_of`), so a resumed store matches an uninterrupted one exactly.
    """
    items = [dataset[int(index)] for index in indices]
    batch = {key: torch.stack([torch.as_tensor(item[key]) for item in items])
             for key in ("input_ids", "attention_mask", "labels")}
    return trim_padding(batch) if trim else batch


def sample_lengths(dataset: Sequence[dict]) -> np.ndarray:
    """Each sample's width up to its last attended position: int64 (N,). Read from the dataset's own
    `attention_mask` tensor when it has one (InstructionDataset), else item by item."""
    mask = getattr(dataset, "attention_mask", None)
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[0] == len(dataset):
        positions = torch.arange(1, mask.shape[1] + 1)
        return (mask.bool() * positions).max(dim=1).values.numpy().astype(np.int64)
    lengths = np.zeros(len(dataset), dtype=np.int64)
    for index in range(len(dataset)):
        attended = torch.as_tensor(dataset[index]["attention_mask"]).nonzero()
        lengths[index] = int(attended.max()) + 1 if attended.numel() else 0
    return lengths


# One batch of the features pass: (its store shard, its sample indices).
Batch = tuple[int, np.ndarray]


def _batches_of(shards: Sequence[int], bounds: Callable[[int], tuple[int, int]], batch_size: int,
                lengths: Optional[np.ndarray]) -> list[Batch]:
    """(shard, sample indices) batches, fixed in advance: a shard's samples in order of length (ties by index),
    cut every `batch_size`, so samples of similar length share a batch and little is padded. Batches never
    cross a shard, so a shard is done after its batches. `lengths` None: index order (full-width batches)."""
    batches = []
    for shard in shards:
        start, stop = bounds(shard)
        members = np.arange(start, stop, dtype=np.int64)
        if lengths is not None:
            members = members[np.argsort(lengths[start:stop], kind="stable")]
        batches += [(shard, members[first:first + batch_size]) for first in range(0, members.size, batch_size)]
    return batches


def deal_batches(batches: Sequence[Batch], world_size: int) -> list[list[Batch]]:
    """Each rank's share of `batches`: dealt round-robin in order of size (largest first, ties in the given order),
    so every rank has as many batches as any other give or take one, and as many samples give or take one batch's
    (a shard's last batch may be short). Each rank computes its share in the given order (shard by shard), so the
    shards finish one after another and a killed pass keeps what it finished. Deterministic: every rank deals the
    same shares without talking to the others."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    by_size = sorted(range(len(batches)), key=lambda index: -len(batches[index][1]))  # stable: ties keep their order
    dealt: list[list[int]] = [[] for _ in range(world_size)]
    for position, index in enumerate(by_size):
        dealt[position % world_size].append(index)
    return [[batches[index] for index in sorted(share)] for share in dealt]


def shard_completion_steps(shares: Sequence[Sequence[Batch]]) -> dict[int, list[int]]:
    """{step: the shards whose last batch, on whichever rank holds it, is computed at that step}, from the ranks'
    shares (`deal_batches`), step t being every rank's t-th batch. After that step the shard's rows are all there."""
    last_step: dict[int, int] = {}
    for share in shares:
        for step, (shard, _) in enumerate(share):
            last_step[int(shard)] = max(step, last_step.get(int(shard), step))
    completing: dict[int, list[int]] = {}
    for shard, step in sorted(last_step.items()):
        completing.setdefault(step, []).append(shard)
    return completing


def work_per_rank(shares: list[list[Batch]]) -> dict[str, list[int]]:
    """The samples and batches each rank computed, for the result."""
    return {"samples_per_rank": [sum(len(indices) for _, indices in share) for share in shares],
            "batches_per_rank": [len(share) for share in shares]}


# This rank's rows of one batch: (sample indices, rows (n, d) float32, empty flags (n,)).
Piece = tuple[np.ndarray, np.ndarray, np.ndarray]


def join_finished(shards: list[int], pieces: dict[int, list[Piece]], collectives: Collectives
                   ) -> dict[int, tuple[np.ndarray, list[int]]]:
    """Collective: every rank's pieces of the `shards` just finished; returns, of those shards, the ones this rank
    writes (shard mod W), joined in index order. The pieces leave `pieces`."""
    everyone = collectives.gather({shard: pieces.pop(shard, []) for shard in shards})
    return {shard: _join([piece for part in everyone for piece in part[shard]]) for shard in shards
            if shard % collectives.world_size == collectives.rank}


def _join(parts: list[Piece]) -> tuple[np.ndarray, list[int]]:
    """A shard's rows in index order from its batches (which come in order of length, from any rank), and its
    empty samples."""
    indices = np.concatenate([part[0] for part in parts])
    rows = np.concatenate([part[1] for part in parts]).astype(np.float32, copy=False)[np.argsort(indices)]
    empty = sorted(int(index) for indices_, _, flags in parts for index, flag in zip(indices_, flags.tolist())
                   if flag)
    return rows, empty
