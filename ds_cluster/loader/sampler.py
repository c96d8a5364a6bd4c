"""The loader: one rank's micro-batches of the run, block by block from its schedule, with a state that resumes
exactly.

`ClusterDataLoader` is the one loader of every trainer and both schedules (`loader.schedule`: the static plan,
`loader.adaptive`: windows that follow the losses). It counts what the training loop has actually taken (not
what a prefetching DataLoader has read ahead), so the state saved with a checkpoint is the position of the next
micro-batch to train on; it keeps the one per-cluster tally of the training losses (`record_losses`) that the
monitors and the adaptive schedule read; and it speaks one protocol to the Hugging Face Trainers
(`start_epoch`, `trainer_resumes`, `trainer_batches`, `prepare_iteration`).
"""
from __future__ import annotations

import logging
import sys
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from ds_cluster.collectives import LOCAL, Collectives
from ds_cluster.data.dataset import IGNORE_INDEX, trim_padding
from ds_cluster.loader.figures import ClusterFigures
from ds_cluster.loader.loss import LOSS_NORMALIZER
from ds_cluster.loader.schedule import Block, Schedule, StaticSchedule
from ds_cluster.planning.plan import Plan
from ds_cluster.planning.tally import ClusterTally
from ds_cluster.settings import LossSettings

logger = logging.getLogger(__name__)

SAMPLE_INDEX = "sample_index"
SAMPLE_WEIGHT = "sample_weight"
# 2 adds the optimizer step the state was saved at; a version 1 state (without it) still loads.
STATE_VERSION = 2
READABLE_STATE_VERSIONS = (1, 2)
# The key of a schedule's own part of the state (the adaptive schedule's window; named when it was the only one).
SCHEDULE_STATE = "adaptive"


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

    `for batch in loader` gives the rest of the current epoch (all of it on a fresh start); when an epoch is used
    up the next iteration starts the next epoch. `len(loader)` is the number of micro-batches in an epoch (the
    plan's steps per epoch x accumulation; an adaptive run's epochs are that many micro-batches too).

    `schedule`: what the run trains on (default: the plan, `StaticSchedule`). `loss`: the weighted loss's
    reduction (default: the one the plan records). `collectives`: this rank among the data-parallel ranks; the
    "token" reduction sums token counts over them, and an adaptive schedule its figures. `sum_over_ranks` (0.5.0):
    a sum alone, when there are no collectives to give.
    """

    # 0.5.0's names, and what to use instead.
    _MOVED = {"rank_schedule": "loader.plan.rank_layout(epoch, loader.rank)",
              "prepare_epoch": "loader.prepare_iteration()", "epoch_batches": "loader.trainer_batches()",
              "settings": "loader.schedule.settings", "probe": "loader.schedule.probe",
              "pools": "loader.schedule.pools"}

    def __init__(self, dataset: Dataset, plan: Plan, rank: int, *, schedule: Optional[Schedule] = None,
                 loss: Optional[LossSettings] = None, collectives: Optional[Collectives] = None,
                 collate_fn: Optional[Callable] = None, num_workers: int = 0, pin_memory: bool = False,
                 sum_over_ranks: Optional[Callable[[np.ndarray], np.ndarray]] = None):
        if not 0 <= rank < plan.world_size:
            raise ValueError(f"rank {rank} is outside the plan's world size {plan.world_size}")
        if collectives is None:
            collectives = LOCAL if sum_over_ranks is None else Collectives(rank, plan.world_size, sum=sum_over_ranks)
        self.plan = plan
        self.rank = rank
        self.schedule = schedule if schedule is not None else StaticSchedule(plan, rank)
        self.loss = loss if loss is not None else LossSettings.recorded_in(plan.settings)
        self.collectives = collectives
        self.dataset = WeightedDataset(dataset, self.schedule.initial_weights())
        self.collate_fn = weighted_collate(collate_fn)
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        if num_workers and not self.schedule.opens_ahead:
            raise ValueError(f"the {self.schedule.kind} schedule draws each block from the losses of the one before, "
                             "in the training process: set num_workers=0")
        if self.loss.reduction == "token" and plan.world_size > 1 and collectives.world_size != plan.world_size:
            raise ValueError("loss_reduction 'token' with several ranks needs the data-parallel collectives (the "
                             "hook and ClusterTrainer pass them)")
        self.epoch = 0
        self.position = 0  # micro-batches of this epoch already handed to the training loop
        self.run_micro = 0  # micro-batches of the whole run handed out
        self.tally = ClusterTally(plan.labels, plan.num_clusters)  # the training losses, per cluster
        self.figures = ClusterFigures(self.tally)  # what a monitor shows per cluster
        self.analysis_timings: dict[str, float] = {}
        self._block: Optional[Block] = None
        self._placeholders = 0  # micro-batches the Trainer skips itself on resume (never read)
        self._token_counts: Optional[np.ndarray] = None
        self.schedule.bind(self._read_batch)

    def __getattr__(self, name: str) -> Any:
        if name in ClusterDataLoader._MOVED:
            raise AttributeError(f"ClusterDataLoader.{name} is gone since 0.6.0: use {ClusterDataLoader._MOVED[name]}")
        raise AttributeError(f"'ClusterDataLoader' object has no attribute {name!r}")

    # ------------------------------------------------------------ iteration
    @property
    def micro_batches_per_epoch(self) -> int:
        return self.plan.steps_per_epoch * self.plan.gradient_accumulation_steps

    def __len__(self) -> int:
        return self.micro_batches_per_epoch

    @property
    def loss_reduction(self) -> str:
        return self.loss.reduction

    @property
    def finished(self) -> bool:
        """Whether the run has ended before its step cap (the adaptive schedule's automatic budget)."""
        return self.schedule.finished

    @property
    def completed_epochs(self) -> int:
        """Epochs fully handed out so far (the current one counts once its last micro-batch is taken); every epoch
        counts as done once the schedule has ended the run."""
        if self.schedule.finished:
            return sys.maxsize
        return self.epoch + (1 if self.position >= self.micro_batches_per_epoch else 0)

    def resume_point(self, global_step: int) -> tuple[int, int]:
        """(epoch, micro-batches of it trained) after `global_step` optimizer steps on this plan."""
        epoch, steps_in_epoch = divmod(int(global_step), self.plan.steps_per_epoch)
        return epoch, steps_in_epoch * self.plan.gradient_accumulation_steps

    def set_epoch(self, epoch: int) -> None:
        """Start the given epoch from its beginning (DistributedSampler's convention)."""
        if epoch != self.epoch:
            self.epoch, self.position = int(epoch), 0

    def __iter__(self) -> Iterator[Any]:
        self._next_epoch_if_done()
        indices = self._indices(self.epoch, self.position, self.run_micro)
        # A schedule that opens its blocks ahead gives the whole rest of the epoch at once (workers may read
        # ahead); the adaptive one one micro-batch at a time, after the loop has trained the one before.
        batches: Iterable[list[int]] = list(indices) if self.schedule.opens_ahead else _OneAtATime(indices)
        loader = DataLoader(self.dataset, batch_sampler=batches, collate_fn=self.collate_fn,
                            num_workers=self.num_workers, pin_memory=self.pin_memory)
        for batch in loader:
            self.position += 1
            self.run_micro += 1
            yield batch

    def _next_epoch_if_done(self) -> None:
        if self.position >= self.micro_batches_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0

    def _indices(self, epoch: int, position: int, run_micro: int) -> Iterator[list[int]]:
        """This rank's sample indices of the micro-batches from (epoch, position) to the end of the epoch, block by
        block: a block opens when the first of its micro-batches is asked for (collective for an adaptive
        schedule, and for the "token" reduction's normalisers)."""
        for offset in range(self.micro_batches_per_epoch - position):
            if self.schedule.finished:
                return
            index, inside = self.schedule.locate(epoch, position + offset, run_micro + offset)
            if self._block is None or self._block.index != index:
                block = self.schedule.open(index, self.tally)
                if block is None:
                    return
                self._use(block)
            assert self._block is not None
            yield self._block.micro_batches[inside].tolist()

    def _use(self, block: Block) -> None:
        """Make `block` the one the dataset's items carry the weights (and loss normalisers) of."""
        self._block = block
        self.dataset.weights = block.weights
        if self.loss.reduction == "token":
            self.dataset.normalizers = self._token_normalizers(block.micro_batches)

    def _token_normalizers(self, micro_batches: np.ndarray) -> np.ndarray:
        """Per sample, (response tokens of its global batch) / (world x accumulation steps).

        DeepSpeed divides each micro-batch's loss by the accumulation steps and
        averages over ranks, so this makes the step's update the weighted token
        losses of the whole global batch over its number of response tokens.
        Collective with several ranks (one sum of a per-step vector per block).
        """
        if self._token_counts is None:
            self._token_counts = response_token_counts(self.dataset.dataset, self.schedule.trainable(),
                                                       self.plan.num_samples)
        accumulation = self.plan.gradient_accumulation_steps
        per_step = micro_batches.reshape(-1, accumulation * self.plan.micro_batch_size)
        local = self._token_counts[per_step].sum(axis=1).astype(np.int64)
        total = self.collectives.sum(local) if self.plan.world_size > 1 else local
        normalizers = np.ones(self.plan.num_samples, dtype=np.float32)
        per_step_value = np.maximum(total, 1) / (self.plan.world_size * accumulation)
        normalizers[per_step] = per_step_value[:, None].astype(np.float32)
        return normalizers

    def _read_batch(self, indices: Sequence[int]) -> Any:
        """The collated batch of these samples (an adaptive schedule's probe set reads it)."""
        return self.collate_fn([self.dataset[int(index)] for index in indices])

    # The Hugging Face Trainer's side (its batch sampler, `integrations/hf.PlanBatchSampler`): Trainer skips a
    # resumed epoch's first micro-batches itself, so it is handed placeholders for them first.
    def start_epoch(self, epoch: int) -> None:
        """Trainer starts an epoch (its sampler's set_epoch): the next one, or the resumed one again."""
        if self._placeholders and epoch == self.epoch:
            return
        self.set_epoch(epoch)

    def trainer_resumes(self) -> None:
        """Trainer resumes inside the current epoch and skips its first micro-batches itself."""
        self._placeholders = self.position

    def prepare_iteration(self) -> None:
        """Before the Trainer's DataLoader starts its workers: open the current epoch's block when the schedule
        can, so the workers' copies of the dataset carry its weights and loss normalisers. Collective under the
        "token" reduction with several ranks."""
        if self.schedule.opens_ahead:
            epoch, position = ((self.epoch + 1, 0) if self.position >= self.micro_batches_per_epoch
                               else (self.epoch, self.position))
            index, _ = self.schedule.locate(epoch, position, self.run_micro)
            if self._block is None or self._block.index != index:
                self._use(self.schedule.open(index, self.tally))

    def trainer_batches(self) -> Iterator[list[int]]:
        """The sample indices of this rank's micro-batches for the rest of the current epoch, placeholders first
        for those the Trainer skips itself (collective where a block opens: call on every rank in step)."""
        self._next_epoch_if_done()
        while self._placeholders:
            self._placeholders -= 1
            yield [0] * self.plan.micro_batch_size
        for indices in self._indices(self.epoch, self.position, self.run_micro):
            self.position += 1
            self.run_micro += 1
            yield indices

    # ------------------------------------------------------------ what the loop hands back
    def record_losses(self, sample_index: Any, losses: Any) -> None:
        """Hand over the per-sample losses of one micro-batch (each sample's mean response-token loss): the tally
        the monitors show per cluster and the adaptive schedule learns from. `weighted_causal_lm_loss` does it
        through the hook and the Trainers; a training loop with its own loss calls this once per micro-batch."""
        self.tally.add(*loss_arrays(sample_index, losses))

    def current_shares(self) -> Optional[list[float]]:
        """Each cluster's sampling share now: None for the static plan (its shares never change)."""
        return self.schedule.shares()

    def cooldown_steps(self) -> Optional[tuple[int, int]]:
        """(first step, end step) of the auto budget's cool-down once announced, else None: what
        `lr_schedules.warmup_stable_decay` reads to take the learning rate to 0 at the run's end."""
        return self.schedule.cooldown_steps()

    @property
    def cooldown_fraction(self) -> Optional[float]:
        """The fraction of its steps the run cools down for when its schedule ends it (the auto budget's
        `auto_cooldown`), else None: what `lr_schedules.run_lr_schedule` chooses the learning-rate schedule by."""
        return self.schedule.cooldown_fraction

    def consumed(self) -> np.ndarray:
        """Distinct samples of each cluster trained on: the plan's kept counts, or what an adaptive run drew."""
        return self.schedule.consumed()

    # ---------------------------------------------------------------- state
    def state_dict(self, global_step: Optional[int] = None) -> dict[str, Any]:
        """Where the loader is: the next micro-batch (epoch, position) of the plan, the optimizer step, and the
        schedule's own part (an adaptive one's: collective, call on every rank)."""
        # A used-up epoch is the start of the next: the same point, written one way.
        epoch, position = ((self.epoch + 1, 0) if self.position >= self.micro_batches_per_epoch
                           else (self.epoch, self.position))
        state = {"version": STATE_VERSION, "epoch": epoch, "position": position,
                 "seed": self.plan.seed, "plan_fingerprint": self.plan.fingerprint(),
                 "micro_batches_per_epoch": self.micro_batches_per_epoch,
                 "global_step": None if global_step is None else int(global_step)}
        own = self.schedule.state_dict(self.tally)
        if own is not None:
            state[SCHEDULE_STATE] = {"run_micro": self.run_micro, **own}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") not in READABLE_STATE_VERSIONS:
            raise ValueError(f"sampler state version {state.get('version')} is not one of {READABLE_STATE_VERSIONS}")
        if state["plan_fingerprint"] != self.plan.fingerprint():
            raise ValueError(
                f"the checkpoint was trained on plan {state['plan_fingerprint']}, but this run built plan "
                f"{self.plan.fingerprint()}: resume with the same data, analysis, config and world size"
            )
        own = state.get(SCHEDULE_STATE)
        self.schedule.load_state_dict(None if own is None else {k: v for k, v in own.items() if k != "run_micro"},
                                      self.tally)
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.run_micro = (int(own["run_micro"]) if own is not None
                          else self.epoch * self.micro_batches_per_epoch + self.position)
        self._block = None  # reopened at the next micro-batch (not here: that may be collective)
        logger.info("cluster sampler resumed at epoch %d, micro-batch %d", self.epoch, self.position)


def cluster_loader(loader: Any) -> Optional[ClusterDataLoader]:
    """The loader `deepspeed.initialize` returned as ds_cluster's `ClusterDataLoader` (its plan, its figures, what it
    consumed), or None when it is DeepSpeed's own (the block disabled or absent): the one way a training script asks
    which it has."""
    return loader if isinstance(loader, ClusterDataLoader) else None


class _OneAtATime:
    """A batch sampler that hands a DataLoader one index list at a time, computed when asked for."""

    def __init__(self, indices: Iterator[list[int]]) -> None:
        self.indices = indices

    def __iter__(self) -> Iterator[list[int]]:
        return self.indices


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
