"""Stage 6: one rank's data loader over a Plan, with a state that resumes exactly.

The loader hands out this rank's micro-batches from `Plan.schedule(epoch)`
and counts what the training loop has actually taken (not what a prefetching
DataLoader has read ahead), so the state saved with a checkpoint is the
position of the next micro-batch to train on.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from ds_cluster.data.dataset import IGNORE_INDEX, trim_padding
from ds_cluster.loader.figures import ClusterFigures
from ds_cluster.loader.loss import LOSS_NORMALIZER
from ds_cluster.planning.plan import Plan

logger = logging.getLogger(__name__)

SAMPLE_INDEX = "sample_index"
SAMPLE_WEIGHT = "sample_weight"
# 2 adds the optimizer step the state was saved at; a version 1 state (without it) still loads.
STATE_VERSION = 2
READABLE_STATE_VERSIONS = (1, 2)


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


class ClusterDataLoader:
    """Iterates this rank's micro-batches of one epoch at a time; `state_dict` says where it is.

    `for batch in loader` gives the rest of the current epoch (all of it on a
    fresh start); when an epoch is used up the next iteration starts the
    next epoch. `len(loader)` is the number of micro-batches in an epoch.
    """

    def __init__(self, dataset: Dataset, plan: Plan, rank: int, *, collate_fn: Optional[Callable] = None,
                 num_workers: int = 0, pin_memory: bool = False,
                 sum_over_ranks: Optional[Callable[[np.ndarray], np.ndarray]] = None):
        """`sum_over_ranks` sums an int64 array over the data-parallel ranks (collective); needed for
        the "token" loss reduction with more than one rank."""
        if not 0 <= rank < plan.world_size:
            raise ValueError(f"rank {rank} is outside the plan's world size {plan.world_size}")
        self.plan = plan
        self.rank = rank
        self.dataset = WeightedDataset(dataset, plan.weights)
        self.collate_fn = weighted_collate(collate_fn)
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.epoch = 0
        self.position = 0  # micro-batches of this epoch already handed to the training loop
        self._schedule_epoch: Optional[int] = None
        self._schedule: Optional[np.ndarray] = None
        self.loss_reduction = str(plan.settings.get("loss_reduction", "sample"))
        self.figures = ClusterFigures(plan.labels, plan.num_clusters)  # what a monitor shows per cluster
        self._sum_over_ranks = sum_over_ranks
        self._token_counts: Optional[np.ndarray] = None
        self._normalizers_epoch: Optional[int] = None
        if self.loss_reduction == "token" and plan.world_size > 1 and sum_over_ranks is None:
            raise ValueError("loss_reduction 'token' with several ranks needs sum_over_ranks (the hook and "
                             "ClusterTrainer pass it)")

    # ------------------------------------------------------------ iteration
    @property
    def micro_batches_per_epoch(self) -> int:
        return self.plan.steps_per_epoch * self.plan.gradient_accumulation_steps

    def __len__(self) -> int:
        return self.micro_batches_per_epoch

    @property
    def completed_epochs(self) -> int:
        """Epochs fully handed out so far (the current one counts once its last micro-batch is taken)."""
        return self.epoch + (1 if self.position >= self.micro_batches_per_epoch else 0)

    def rank_schedule(self, epoch: int) -> np.ndarray:
        """This rank's indices for an epoch: (micro-batches, micro_batch_size), in training order."""
        if self._schedule_epoch != epoch:
            self._schedule = self.plan.rank_schedule(epoch, self.rank).reshape(-1, self.plan.micro_batch_size)
            self._schedule_epoch = epoch
        assert self._schedule is not None
        return self._schedule

    def prepare_epoch(self, epoch: int) -> np.ndarray:
        """This rank's schedule of an epoch, with the loss normalisers of the "token" reduction set.

        Collective under "token" with several ranks (one sum of a per-step vector
        per epoch): call it on every rank at the same point.
        """
        schedule = self.rank_schedule(epoch)
        if self.loss_reduction == "token" and self._normalizers_epoch != epoch:
            self.dataset.normalizers = self._token_normalizers(schedule)
            self._normalizers_epoch = epoch
        return schedule

    def _token_normalizers(self, schedule: np.ndarray) -> np.ndarray:
        """Per sample, (response tokens of its global batch) / (world x accumulation steps).

        DeepSpeed divides each micro-batch's loss by the accumulation steps and
        averages over ranks, so this makes the step's update the weighted token
        losses of the whole global batch over its number of response tokens.
        """
        if self._token_counts is None:
            self._token_counts = response_token_counts(self.dataset.dataset, self.plan.selected,
                                                       self.plan.num_samples)
        accumulation = self.plan.gradient_accumulation_steps
        per_step = schedule.reshape(-1, accumulation * self.plan.micro_batch_size)
        local = self._token_counts[per_step].sum(axis=1).astype(np.int64)
        total = self._sum_over_ranks(local) if self._sum_over_ranks is not None else local
        normalizers = np.ones(self.plan.num_samples, dtype=np.float32)
        per_step_value = np.maximum(total, 1) / (self.plan.world_size * accumulation)
        normalizers[per_step] = per_step_value[:, None].astype(np.float32)
        return normalizers

    def resume_point(self, global_step: int) -> tuple[int, int]:
        """(epoch, micro-batches of it trained) after `global_step` optimizer steps on this plan."""
        epoch, steps_in_epoch = divmod(int(global_step), self.plan.steps_per_epoch)
        return epoch, steps_in_epoch * self.plan.gradient_accumulation_steps

    # The Hugging Face Trainer's side (its batch sampler, `integrations/hf.PlanBatchSampler`): Trainer skips a
    # resumed epoch's first micro-batches itself, so an epoch is always handed over from its start.
    def start_epoch(self, epoch: int) -> None:
        """Trainer starts an epoch (its sampler's set_epoch), a resumed one included."""
        self.epoch, self.position = int(epoch), 0

    def trainer_resumes(self) -> None:
        """Trainer resumes inside the current epoch and skips its first micro-batches itself."""
        self.position = 0

    def trainer_batches(self) -> Iterator[list[int]]:
        """The sample indices of this rank's micro-batches of the current epoch, all of them."""
        yield from self.prepare_epoch(self.epoch).tolist()

    def record_losses(self, sample_index: Any, losses: Any) -> None:
        """Hand over the per-sample losses of one micro-batch (each sample's mean response-token loss). The static
        plan does not change with them; the per-cluster figures a monitor shows (`figures`) count them, and the
        adaptive schedule learns from them. `weighted_causal_lm_loss` does it through the hook and the Trainers;
        a training loop with its own loss calls this once per micro-batch."""
        self.figures.add(*loss_arrays(sample_index, losses))

    def current_shares(self) -> Optional[list[float]]:
        """Each cluster's sampling share now: None for the static plan (its shares never change)."""
        return None

    def set_epoch(self, epoch: int) -> None:
        """Start the given epoch from its beginning (DistributedSampler's convention)."""
        if epoch != self.epoch:
            self.epoch, self.position = int(epoch), 0

    def __iter__(self) -> Iterator[Any]:
        if self.position >= self.micro_batches_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        batches = self.prepare_epoch(self.epoch)[self.position:].tolist()
        loader = DataLoader(self.dataset, batch_sampler=batches, collate_fn=self.collate_fn,
                            num_workers=self.num_workers, pin_memory=self.pin_memory)
        for batch in loader:
            self.position += 1
            yield batch

    # ---------------------------------------------------------------- state
    def state_dict(self, global_step: Optional[int] = None) -> dict[str, Any]:
        """Where the loader is: the next micro-batch (epoch, position) of the plan, and the optimizer step."""
        # A used-up epoch is the start of the next: the same point, written one way.
        epoch, position = ((self.epoch + 1, 0) if self.position >= self.micro_batches_per_epoch
                           else (self.epoch, self.position))
        return {"version": STATE_VERSION, "epoch": epoch, "position": position,
                "seed": self.plan.seed, "plan_fingerprint": self.plan.fingerprint(),
                "micro_batches_per_epoch": self.micro_batches_per_epoch,
                "global_step": None if global_step is None else int(global_step)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") not in READABLE_STATE_VERSIONS:
            raise ValueError(f"sampler state version {state.get('version')} is not one of {READABLE_STATE_VERSIONS}")
        if state["plan_fingerprint"] != self.plan.fingerprint():
            raise ValueError(
                f"the checkpoint was trained on plan {state['plan_fingerprint']}, but this run built plan "
                f"{self.plan.fingerprint()}: resume with the same data, analysis, config and world size"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        logger.info("cluster sampler resumed at epoch %d, micro-batch %d", self.epoch, self.position)


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
