"""What each item and batch of the loader carries besides the user's fields: the sample's index, its loss weight
and the "token" reduction's normaliser; the collate that stacks them; the reader of given samples as one batch;
and the per-sample numbers the loader reads back (losses, response-token counts)."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate

from ds_cluster.data.dataset import IGNORE_INDEX, trim_padding
from ds_cluster.loader.loss import LOSS_NORMALIZER

SAMPLE_INDEX = "sample_index"
SAMPLE_WEIGHT = "sample_weight"


def loss_arrays(sample_index: Any, losses: Any) -> tuple[np.ndarray, np.ndarray]:
    """A micro-batch's sample indices (int64) and per-sample losses (float64) as flat numpy arrays."""
    indices = np.asarray(torch.as_tensor(sample_index).detach().cpu(), dtype=np.int64).reshape(-1)
    values = np.asarray(torch.as_tensor(losses).detach().float().cpu(), dtype=np.float64).reshape(-1)
    return indices, values


class WeightedDataset(Dataset):
    """The user's dataset, each item with its index and its plan weight beside the user's fields.

    Dict items gain `sample_index` (int64) and `sample_weight` (float32), and
    `loss_normalizer` (float32) under the "token" loss reduction; tuple/list
    items gain the first two as their last two elements.
    """

    def __init__(self, dataset: Dataset, weights: np.ndarray):
        self.dataset = dataset
        self.weights = np.asarray(weights, dtype=np.float32)
        self.normalizers: Optional[np.ndarray] = None  # (N,) float32, set per epoch by the loader

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        item = self.dataset[index]
        sample_index = torch.tensor(index, dtype=torch.int64)
        sample_weight = torch.tensor(self.weights[index], dtype=torch.float32)
        if isinstance(item, dict):
            extra = {} if self.normalizers is None else {
                LOSS_NORMALIZER: torch.tensor(self.normalizers[index], dtype=torch.float32)}
            return {**item, SAMPLE_INDEX: sample_index, SAMPLE_WEIGHT: sample_weight, **extra}
        if self.normalizers is not None:
            raise TypeError("loss_reduction 'token' needs dataset items that are dicts (with 'labels')")
        if isinstance(item, (tuple, list)):
            return (*item, sample_index, sample_weight)
        raise TypeError(f"dataset items must be dicts or tuples to carry sample weights, got {type(item).__name__}")


def weighted_collate(collate_fn: Optional[Callable] = None) -> Callable:
    """Collate with the user's function, then add the stacked index and weight tensors.

    Without one: torch's `default_collate`, and a dict batch is then cut to its longest attended row
    (`trim_padding`: no compute spent on padding).
    """
    def default(items: list) -> Any:
        batch = default_collate(items)
        return trim_padding(batch) if isinstance(batch, dict) else batch

    user_collate = collate_fn or default

    def collate(items: list) -> Any:
        if isinstance(items[0], dict):
            ours = [key for key in (SAMPLE_INDEX, SAMPLE_WEIGHT, LOSS_NORMALIZER) if key in items[0]]
            stacked = {key: torch.stack([item[key] for item in items]) for key in ours}
            batch = user_collate([{k: v for k, v in item.items() if k not in ours} for item in items])
            batch.update(stacked)
            return batch
        indices = torch.stack([item[-2] for item in items])
        weights = torch.stack([item[-1] for item in items])
        batch = user_collate([tuple(item[:-2]) for item in items])
        return (*batch, indices, weights) if isinstance(batch, (tuple, list)) else (batch, indices, weights)

    return collate


def batch_reader(dataset: Any, collate_fn: Optional[Callable] = None) -> Callable[[Sequence[int]], Any]:
    """What reads given samples of `dataset` as one batch, collated as the loader collates them (without the
    loader's index and weight fields): the adaptive schedule's probe set is read this way."""
    collate = weighted_collate(collate_fn)

    def read(indices: Sequence[int]) -> Any:
        return collate([dataset[int(index)] for index in indices])

    return read


def response_token_counts(dataset: Any, indices: np.ndarray, num_samples: int) -> np.ndarray:
    """Labelled (response) tokens after the one-token shift of the samples `indices`: int64 (N,), 0 elsewhere."""
    counts = np.zeros(num_samples, dtype=np.int64)
    labels = getattr(dataset, "labels", None)
    if isinstance(labels, torch.Tensor) and labels.dim() == 2 and labels.shape[0] == num_samples:
        counts[indices] = (labels[torch.as_tensor(indices), 1:] != IGNORE_INDEX).sum(dim=1).numpy()
        return counts
    for index in np.asarray(indices).tolist():
        item = dataset[index]
        if not isinstance(item, dict) or "labels" not in item:
            raise TypeError("loss_reduction 'token' needs dataset items that are dicts with 'labels'")
        counts[index] = int((torch.as_tensor(item["labels"])[1:] != IGNORE_INDEX).sum())
    return counts
