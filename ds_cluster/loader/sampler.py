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
from typing import Any, Callable, Iterable, Iterator, Optional

import numpy as np
from torch.utils.data import DataLoader, Dataset

from ds_cluster.analysis.folder import InJobAnalysis
from ds_cluster.collectives import LOCAL, Collectives
from ds_cluster.loader.figures import ClusterFigures
from ds_cluster.loader.items import (SAMPLE_INDEX, SAMPLE_WEIGHT, WeightedDataset, batch_reader,  # noqa: F401
                                     loss_arrays, response_token_counts, weighted_collate)
from ds_cluster.loader.schedule import (SCHEDULE_STATE, SCHEDULE_STATE_0_6, Block, RunEnd, Schedule,
                                       StaticSchedule)
from ds_cluster.planning.plan import Plan
from ds_cluster.planning.tally import ClusterTally
from ds_cluster.settings import LossSettings

logger = logging.getLogger(__name__)

# 2 added the optimizer step the state was saved at; 3 keeps one position (the run's next micro-batch) and every
# schedule's part under one key. States of versions 1 and 2 still load.
STATE_VERSION = 3
READABLE_STATE_VERSIONS = (1, 2, 3)


class ClusterDataLoader:
    """Iterates this rank's micro-batches of one epoch at a time; `state_dict` says where it is.

    `for batch in loader` gives the rest of the current epoch (all of it on a fresh start); when an epoch is used
    up the next iteration starts the next epoch. `len(loader)` is the number of micro-batches in an epoch (the
    plan's steps per epoch x accumulation; an adaptive run's epochs are that many micro-batches too).

    `schedule`: what the run trains on (default: the plan, `StaticSchedule`). `loss`: the weighted loss's
    reduction (default: the one the plan records). `collectives`: this rank among the data-parallel ranks; the
    "token" reduction sums token counts over them, and an adaptive schedule its figures. `analysis`: how this run's
    analysis came about (computed in the job, with its timings; None: read from its folder). `sum_over_ranks`
    (0.5.0): a sum alone, when there are no collectives to give.
    """

    # The one position: micro-batches of the whole run handed to the training loop (not what a prefetching
    # DataLoader read ahead); the epoch and the place in it follow from it.
    micro_batch: int = 0
    # How this run's analysis came about: computed in the job (its timings), or None when it was read.
    analysis: Optional[InJobAnalysis] = None
    finished: bool = False  # the schedule has ended the run before its step cap (the adaptive auto budget)

    # 0.5.0's names, and what to use instead.
    _MOVED = {"rank_schedule": "loader.plan.rank_layout(epoch, loader.rank)",
              "prepare_epoch": "loader.prepare_iteration()", "epoch_batches": "loader.trainer_batches()",
              "settings": "loader.schedule.settings", "probe": "loader.schedule.probe",
              "pools": "loader.schedule.pools", "analysis_timings": "loader.analysis (an InJobAnalysis, or None)"}

    def __init__(self, dataset: Dataset, plan: Plan, rank: int, *, schedule: Optional[Schedule] = None,
                 loss: Optional[LossSettings] = None, collectives: Optional[Collectives] = None,
                 collate_fn: Optional[Callable] = None, num_workers: int = 0, pin_memory: bool = False,
                 analysis: Optional[InJobAnalysis] = None,
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
        self.analysis = analysis
        self.dataset = WeightedDataset(dataset, np.zeros(plan.num_samples, dtype=np.float32))
        self.collate_fn = weighted_collate(collate_fn)
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        if num_workers and not self.schedule.opens_ahead:
            raise ValueError(f"the {self.schedule.kind} schedule draws each block from the losses of the one before, "
                             "in the training process: set num_workers=0")
        if self.loss.reduction == "token" and plan.world_size > 1 and collectives.world_size != plan.world_size:
            raise ValueError("loss_reduction 'token' with several ranks needs the data-parallel collectives (the "
                             "hook and ClusterTrainer pass them)")
        self.micro_batch = 0
        self.finished = False
        self.tally = ClusterTally(plan.labels, plan.num_clusters)  # the training losses, per cluster
        self.figures = ClusterFigures(self.tally)  # what a monitor shows per cluster
        self._block: Optional[Block] = None
        self._placeholders = 0  # micro-batches the Trainer skips itself on resume (never read)
        self._token_counts: Optional[np.ndarray] = None

    def __getattr__(self, name: str) -> Any:
        if name in ClusterDataLoader._MOVED:
            raise AttributeError(f"ClusterDataLoader.{name} is gone since 0.7.0: use {ClusterDataLoader._MOVED[name]}"
                                 if name == "analysis_timings" else
                                 f"ClusterDataLoader.{name} is gone since 0.6.0: use {ClusterDataLoader._MOVED[name]}")
        raise AttributeError(f"'ClusterDataLoader' object has no attribute {name!r}")

    # ------------------------------------------------------------ iteration
    @property
    def micro_batches_per_epoch(self) -> int:
        return self.plan.steps_per_epoch * self.plan.gradient_accumulation_steps

    def __len__(self) -> int:
        return self.micro_batches_per_epoch

    @property
    def epoch(self) -> int:
        """The epoch of the next micro-batch."""
        return self.micro_batch // self.micro_batches_per_epoch

    @property
    def position(self) -> int:
        """Micro-batches of the current epoch handed out; an epoch just used up counts as the next one's start."""
        return self.micro_batch % self.micro_batches_per_epoch

    @property
    def loss_reduction(self) -> str:
        return self.loss.reduction

    @property
    def completed_epochs(self) -> int:
        """Epochs fully handed out so far; every epoch counts as done once the schedule has ended the run."""
        return sys.maxsize if self.finished else self.epoch

    def resume_point(self, global_step: int) -> tuple[int, int]:
        """(epoch, micro-batches of it trained) after `global_step` optimizer steps on this plan."""
        epoch, steps_in_epoch = divmod(int(global_step), self.plan.steps_per_epoch)
        return epoch, steps_in_epoch * self.plan.gradient_accumulation_steps

    def set_epoch(self, epoch: int) -> None:
        """Start the given epoch from its beginning (DistributedSampler's convention), unless the loader is already
        inside it (a resumed run)."""
        if epoch != self.epoch:
            self.micro_batch = int(epoch) * self.micro_batches_per_epoch

    def __iter__(self) -> Iterator[Any]:
        indices = self._indices()
        # A schedule that opens its blocks ahead gives the whole rest of the epoch at once (workers may read
        # ahead); the adaptive one one micro-batch at a time, after the loop has trained the one before.
        batches: Iterable[list[int]] = list(indices) if self.schedule.opens_ahead else _OneAtATime(indices)
        loader = DataLoader(self.dataset, batch_sampler=batches, collate_fn=self.collate_fn,
                            num_workers=self.num_workers, pin_memory=self.pin_memory)
        for batch in loader:
            self.micro_batch += 1
            yield batch

    def _indices(self) -> Iterator[list[int]]:
        """This rank's sample indices of the micro-batches from the next one to the end of its epoch, block by
        block: a block opens when the first of its micro-batches is asked for (collective for an adaptive
        schedule, and for the "token" reduction's normalisers)."""
        start = self.micro_batch
        for micro_batch in range(start, (self.epoch + 1) * self.micro_batches_per_epoch):
            index, inside = self.schedule.locate(micro_batch)
            if self._block is None or self._block.index != index:
                block = None if self.finished else self.schedule.open(index, self.tally)
                if block is None:
                    self.finished = True
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
        if self.schedule.opens_ahead and not self.finished:
            index, _ = self.schedule.locate(self.micro_batch)
            if self._block is None or self._block.index != index:
                block = self.schedule.open(index, self.tally)
                assert block is not None, "a schedule that opens its blocks ahead never ends the run itself"
                self._use(block)

    def trainer_batches(self) -> Iterator[list[int]]:
        """The sample indices of this rank's micro-batches for the rest of the current epoch, placeholders first
        for those the Trainer skips itself (collective where a block opens: call on every rank in step)."""
        while self._placeholders:
            self._placeholders -= 1
            yield [0] * self.plan.micro_batch_size
        for indices in self._indices():
            self.micro_batch += 1
            yield indices

    # ------------------------------------------------------------ what the loop hands back
    def record_losses(self, sample_index: Any, losses: Any) -> None:
        """Hand over the per-sample losses of one micro-batch (each sample's mean response-token loss): the tally
        the monitors show per cluster and the adaptive schedule learns from. `weighted_causal_lm_loss` does it
        through the hook and the Trainers; a training loop with its own loss calls this once per micro-batch."""
        self.tally.add(*loss_arrays(sample_index, losses))

    def current_shares(self) -> Optional[list[float]]:
        """Each cluster's sampling share in the block being trained: None for the static plan (its shares never
        change)."""
        return None if self._block is None or self._block.shares is None else list(self._block.shares)

    def run_end(self) -> Optional[RunEnd]:
        """How the run ends when its schedule may end it itself (the auto budget's cool-down: its fraction of the
        steps, and its steps once announced), else None: what `lr_schedules.run_lr_schedule` reads."""
        return None if self._block is None else self._block.run_end

    def consumed(self) -> np.ndarray:
        """Distinct samples of each cluster trained on: the plan's kept counts, or what an adaptive run drew."""
        if self._block is None:
            return np.zeros(self.plan.num_clusters, dtype=np.int64)
        return self._block.consumed

    # ---------------------------------------------------------------- state
    def state_dict(self, global_step: Optional[int] = None) -> dict[str, Any]:
        """Where the loader is: the next micro-batch of the run with its epoch and place in it, the optimizer step,
        and the schedule's part (an adaptive one's: collective, call on every rank). A schedule that opens its blocks
        ahead is a function of the step alone, so with `global_step` its position is the step's (a Trainer's
        DataLoader workers may have read ahead of it); an adaptive schedule never reads ahead."""
        micro_batch = (int(global_step) * self.plan.gradient_accumulation_steps
                       if global_step is not None and self.schedule.opens_ahead else self.micro_batch)
        epoch, position = divmod(micro_batch, self.micro_batches_per_epoch)
        return {"version": STATE_VERSION, "micro_batch": micro_batch, "epoch": epoch, "position": position,
                "seed": self.plan.seed, "plan_fingerprint": self.plan.fingerprint(),
                "micro_batches_per_epoch": self.micro_batches_per_epoch,
                "global_step": None if global_step is None else int(global_step),
                SCHEDULE_STATE: self.schedule.state_dict(self.tally)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict`'s state, or one of 0.5.0 or 0.6.0 (versions 1 and 2)."""
        if state.get("version") not in READABLE_STATE_VERSIONS:
            raise ValueError(f"sampler state version {state.get('version')} is not one of {READABLE_STATE_VERSIONS}")
        if state["plan_fingerprint"] != self.plan.fingerprint():
            raise ValueError(
                f"the checkpoint was trained on plan {state['plan_fingerprint']}, but this run built plan "
                f"{self.plan.fingerprint()}: resume with the same data, analysis, config and world size"
            )
        if state["version"] >= 3:
            own, micro_batch = state[SCHEDULE_STATE], int(state["micro_batch"])
        else:  # 0.6.0 kept an adaptive schedule's part (with the run's micro-batch) under its own key, a static none
            old = state.get(SCHEDULE_STATE_0_6)
            own = ({"kind": "static"} if old is None else
                   {"kind": "adaptive", **{key: value for key, value in old.items() if key != "run_micro"}})
            micro_batch = (int(old["run_micro"]) if old is not None
                           else int(state["epoch"]) * self.micro_batches_per_epoch + int(state["position"]))
        self.schedule.load_state_dict(own, self.tally)
        self.micro_batch = micro_batch
        self.finished = False  # the schedule says so again at the next block it is asked for
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
