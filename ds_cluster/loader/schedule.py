"""What a rank's loader trains on, block by block: the `Schedule` interface and the static schedule.

A schedule hands the loader one `Block` at a time: this rank's micro-batches of a stretch of the run, the loss
weight of every sample while it trains, and what the stretch tells the rest of the run (the distinct samples
drawn so far, the sampling shares, how the run ends). The static schedule's block is an epoch of the plan (fixed
before step 0); the adaptive schedule's (`loader.adaptive.AdaptiveSchedule`) is a window of `adapt_every`
optimizer steps drawn from the losses of the window before. The loader (`loader.sampler.ClusterDataLoader`) keeps
the position, the per-cluster tally of the training losses, the resumable state and the Trainers' protocol, the
same for both; nothing outside the loader asks which schedule it has.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import numpy as np

from ds_cluster.planning.plan import Plan
from ds_cluster.planning.tally import ClusterTally

# The key of a schedule's part of the loader's state, and the key 0.6.0 wrote it under (adaptive schedules only).
SCHEDULE_STATE = "schedule"
SCHEDULE_STATE_0_6 = "adaptive"


@dataclass(frozen=True)
class RunEnd:
    """How a run that its schedule may end itself ends (the automatic budget): a cool-down over `fraction` of the
    steps taken, at `steps` (first step, end step) once the schedule has announced it."""

    fraction: float
    steps: Optional[tuple[int, int]] = None


@dataclass(frozen=True)
class Block:
    """A stretch of the run drawn at once: an epoch of the static plan, or a window of the adaptive schedule."""

    index: int
    micro_batches: np.ndarray  # int64 (micro-batches, micro_batch_size): this rank's sample indices, in order
    weights: np.ndarray  # float32 (N,): every sample's loss weight while the block trains
    consumed: np.ndarray  # int64 (K,): distinct samples of each cluster drawn once this block is trained
    shares: Optional[tuple[float, ...]] = None  # each cluster's sampling share in it; None: the plan's, fixed
    run_end: Optional[RunEnd] = None  # None: the run ends at its step cap


class Schedule(ABC):
    """How a rank's run is cut into blocks, and what each block holds."""

    kind: ClassVar[str]
    # Whether a block can be built before the training loop reaches it (so DataLoader workers may read ahead).
    opens_ahead: ClassVar[bool]

    def __init__(self, plan: Plan, rank: int) -> None:
        if not 0 <= rank < plan.world_size:
            raise ValueError(f"rank {rank} is outside the plan's world size {plan.world_size}")
        self.plan = plan
        self.rank = rank

    @abstractmethod
    def locate(self, micro_batch: int) -> tuple[int, int]:
        """(block, micro-batch inside it) of the run's `micro_batch`-th micro-batch (0-based, over every epoch)."""

    @abstractmethod
    def open(self, index: int, tally: ClusterTally) -> Optional[Block]:
        """Block `index` (the one after the block open now, or a resumed run's first), given the loader's per-cluster
        tally of the training losses (what an adaptive schedule learns from); None once the run has ended. May be
        collective: every rank opens the same blocks at the same point."""

    @abstractmethod
    def trainable(self) -> np.ndarray:
        """Every sample a block may hold, sorted (what the "token" reduction counts the tokens of)."""

    def state_dict(self, tally: ClusterTally) -> dict[str, Any]:
        """The schedule's part of the loader's state (plain JSON; the position is the loader's). May be collective."""
        return {"kind": self.kind}

    def load_state_dict(self, state: dict[str, Any], tally: ClusterTally) -> None:
        """Restore `state_dict`'s part; a state of another kind of schedule is an error."""
        if state.get("kind") != self.kind:
            raise ValueError(f"the checkpoint's sampler state is a {state.get('kind')} schedule's, and this run's "
                             f"schedule is {self.kind}: resume with the same cluster_sampling block")


class StaticSchedule(Schedule):
    """The plan: a block is an epoch, `Plan.rank_layout(epoch, rank)`, at the plan's weights."""

    kind = "static"
    opens_ahead = True

    def __init__(self, plan: Plan, rank: int) -> None:
        super().__init__(plan, rank)
        self.weights = np.asarray(plan.weights, dtype=np.float32)
        self.micro_batches_per_epoch = plan.steps_per_epoch * plan.gradient_accumulation_steps

    def locate(self, micro_batch: int) -> tuple[int, int]:
        return divmod(micro_batch, self.micro_batches_per_epoch)

    def open(self, index: int, tally: ClusterTally) -> Block:
        layout = self.plan.rank_layout(index, self.rank).reshape(-1, self.plan.micro_batch_size)
        return Block(index, layout, self.weights, np.asarray(self.plan.kept_sizes, dtype=np.int64))

    def trainable(self) -> np.ndarray:
        return np.asarray(self.plan.selected)
