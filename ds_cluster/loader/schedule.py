"""What a rank's loader trains on, block by block: the `Schedule` interface and the static schedule.

A schedule hands the loader one `Block` at a time: this rank's micro-batches of a stretch of the run and the
loss weight of every sample while it trains. The static schedule's block is an epoch of the plan (fixed before
step 0); the adaptive schedule's (`loader.adaptive.AdaptiveSchedule`) is a window of `adapt_every` optimizer
steps drawn from the losses of the window before. The loader (`loader.sampler.ClusterDataLoader`) keeps the
position, the per-cluster tally of the training losses, the resumable state and the Trainers' protocol, the
same for both; nothing outside the loader asks which schedule it has.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional, Sequence

import numpy as np

from ds_cluster.planning.plan import Plan
from ds_cluster.planning.tally import ClusterTally


@dataclass(frozen=True)
class Block:
    """A stretch of the run drawn at once: an epoch of the static plan, or a window of the adaptive schedule."""

    index: int
    micro_batches: np.ndarray  # int64 (micro-batches, micro_batch_size): this rank's sample indices, in order
    weights: np.ndarray  # float32 (N,): every sample's loss weight while the block trains


class Schedule(ABC):
    """How a rank's run is cut into blocks, and what each block holds. `tally` is the loader's per-cluster count
    of the training losses (what an adaptive schedule learns from); a static schedule ignores it."""

    kind: ClassVar[str]
    # Whether a block can be built before the training loop reaches it (so DataLoader workers may read ahead).
    opens_ahead: ClassVar[bool]

    def __init__(self, plan: Plan, rank: int) -> None:
        if not 0 <= rank < plan.world_size:
            raise ValueError(f"rank {rank} is outside the plan's world size {plan.world_size}")
        self.plan = plan
        self.rank = rank
        self.finished = False  # the run has ended before its step cap (the adaptive schedule's auto budget)

    def bind(self, read_batch: Callable[[Sequence[int]], Any]) -> None:
        """How the loader collates samples into a batch, for a schedule that runs forwards of its own (the adaptive
        schedule's probe set); the static schedule needs none."""

    @abstractmethod
    def locate(self, epoch: int, position: int, run_micro: int) -> tuple[int, int]:
        """(block, micro-batch inside it) of the run's next micro-batch: the `position`-th of epoch `epoch`, the
        `run_micro`-th of the run."""

    @abstractmethod
    def open(self, index: int, tally: ClusterTally) -> Optional[Block]:
        """Block `index` (the one after the block open now, or a resumed run's first): None once the run has
        ended. May be collective: every rank opens the same blocks at the same point."""

    def initial_weights(self) -> np.ndarray:
        """The samples' loss weights before the first block opens: none trained yet."""
        return np.zeros(self.plan.num_samples, dtype=np.float32)

    @abstractmethod
    def trainable(self) -> np.ndarray:
        """Every sample a block may hold, sorted (what the "token" reduction counts the tokens of)."""

    def shares(self) -> Optional[list[float]]:
        """Each cluster's sampling share in the block being drawn; None when the shares never change."""
        return None

    def cooldown_steps(self) -> Optional[tuple[int, int]]:
        """(first step, end step) of a cool-down the schedule has announced (the auto budget's), else None."""
        return None

    @property
    def cooldown_fraction(self) -> Optional[float]:
        """When the schedule may end the run itself with a cool-down, the fraction of its steps the cool-down takes
        (the auto budget's `auto_cooldown`); else None (the run ends at its step cap)."""
        return None

    @abstractmethod
    def consumed(self) -> np.ndarray:
        """Distinct samples of each cluster the run has drawn so far, or will in every epoch: int64 (K,)."""

    def state_dict(self, tally: ClusterTally) -> Optional[dict[str, Any]]:
        """The schedule's own part of the loader's state (plain JSON); None when the position says it all. May be
        collective."""
        return None

    def load_state_dict(self, state: Optional[dict[str, Any]], tally: ClusterTally) -> None:
        if state is not None:
            raise ValueError(f"the checkpoint's sampler state is an adaptive schedule's, and this run's schedule is "
                             f"{self.kind}: resume with the same cluster_sampling block")


class StaticSchedule(Schedule):
    """The plan: a block is an epoch, `Plan.rank_layout(epoch, rank)`, at the plan's weights."""

    kind = "static"
    opens_ahead = True

    def __init__(self, plan: Plan, rank: int) -> None:
        super().__init__(plan, rank)
        self.weights = np.asarray(plan.weights, dtype=np.float32)

    def initial_weights(self) -> np.ndarray:
        return self.weights

    def locate(self, epoch: int, position: int, run_micro: int) -> tuple[int, int]:
        return epoch, position

    def open(self, index: int, tally: ClusterTally) -> Block:
        layout = self.plan.rank_layout(index, self.rank).reshape(-1, self.plan.micro_batch_size)
        return Block(index, layout, self.weights)

    def trainable(self) -> np.ndarray:
        return np.asarray(self.plan.selected)

    def consumed(self) -> np.ndarray:
        return np.asarray(self.plan.kept_sizes, dtype=np.int64)
