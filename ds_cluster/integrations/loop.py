"""The plain DeepSpeed training loop: the one loop of `python -m ds_cluster.train` and of the quality benchmark's
job, over ds_cluster's loader or, with the block disabled or absent, over DeepSpeed's own.

    result = train_loop(engine, loader, epochs=2, hooks=LoopHooks(after_step=save_every_100))

`deepspeed.initialize` (with `ds_cluster.install()`, or `ds_cluster.initialize`) gives the engine and the loader;
each micro-batch is a forward, the loss, `engine.backward` and `engine.step`. On ds_cluster's loader the loss is
`weighted_causal_lm_loss` (and `engine.backward` hands the per-sample losses to the loader); on DeepSpeed's own
loader it is the plain mean over the micro-batch's response tokens (`causal_lm_loss`), so a run with the block
disabled is the plain DeepSpeed run a user compares with. What a caller adds (checkpoints, a trace, validation
at the end of an epoch, a record of the learning rate) goes in `LoopHooks`. The loop also measures what the loader
costs: the time spent waiting for the next batch (the plan lookup, a window's opening, collating).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

from ds_cluster.loader.loss import causal_lm_loss, weighted_causal_lm_loss
from ds_cluster.loader.sampler import ClusterDataLoader, cluster_loader


@dataclass(frozen=True)
class MicroStep:
    """One micro-batch the loop trained: where it sits in the run, the batch as the loader gave it, and its loss."""

    epoch: int
    micro: int  # its place in the epoch (0-based)
    step: int  # the engine's optimizer steps after it
    batch: Any
    loss: float


@dataclass(frozen=True)
class LoopHooks:
    """What a caller does at the loop's three points; each may be None."""

    # After each micro-batch's step.
    after_micro_step: Optional[Callable[[MicroStep], None]] = None
    # After each optimizer step, with the engine's step count; returning True ends the run there.
    after_step: Optional[Callable[[int], Optional[bool]]] = None
    # After an epoch ran to its end when the run goes on (not after the last one), with the step count.
    after_epoch: Optional[Callable[[int], None]] = None


@dataclass
class LoopResult:
    """What the loop did on this rank."""

    losses: list = field(default_factory=list)  # every micro-step's loss
    wall: float = 0.0  # seconds in the loop (the hooks' own time included)
    cpu: float = 0.0  # this process's CPU seconds in the loop (all its threads)
    loader_wall: float = 0.0  # seconds waiting on the loader for the next batch
    steps: int = 0  # the engine's optimizer steps at the end


class _Epochs:
    """Where the loop stands in the loader's epochs: ds_cluster's loader keeps its own position (a resumed run
    finishes the epoch it was in); DeepSpeed's own loader starts an epoch at every `iter()`."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.cluster: Optional[ClusterDataLoader] = cluster_loader(loader)
        self._epoch, self._handed = 0, 0  # DeepSpeed's loader: the epoch, and its micro-batches handed out

    @property
    def completed(self) -> int:
        return self.cluster.completed_epochs if self.cluster is not None else self._epoch

    def last(self) -> tuple[int, int]:
        """(epoch, place in it) of the micro-batch handed out last."""
        if self.cluster is None:
            return self._epoch, self._handed - 1
        return divmod(self.cluster.micro_batch - 1, self.cluster.micro_batches_per_epoch)

    @property
    def ended_epoch(self) -> bool:
        """Whether the last pass ran its epoch to the end (not cut short by the schedule ending the run)."""
        return self.cluster is None or (self.cluster.position == 0 and not self.cluster.finished)

    def batches(self) -> Iterator[Any]:
        if self.cluster is not None:
            yield from self.cluster
            return
        sampler = getattr(self.loader, "data_sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self._epoch)  # DistributedSampler's order of this epoch
        self._handed = 0
        for batch in self.loader:
            self._handed += 1
            yield batch
        self._epoch += 1


def train_loop(engine: Any, loader: Any, *, epochs: int, max_steps: int = 0,
               hooks: Optional[LoopHooks] = None) -> LoopResult:
    """Train `engine` on `loader` for `epochs` epochs (ds_cluster's loader counts its own, so a resumed run finishes
    the one it was in), or until `max_steps` optimizer steps (0: no cap), a hook says stop, or the loader's schedule
    ends the run (the adaptive schedule's automatic budget). `loader`: what `deepspeed.initialize` returned,
    ds_cluster's or DeepSpeed's own. Collective: every rank runs it."""
    hooks = hooks or LoopHooks()
    result = LoopResult()
    epochs_done = _Epochs(loader)
    loss_of = weighted_causal_lm_loss if epochs_done.cluster is not None else causal_lm_loss
    started, cpu_started = time.perf_counter(), time.process_time()
    stop = False
    while not stop and epochs_done.completed < epochs:
        batches = epochs_done.batches()
        while True:
            waiting = time.perf_counter()
            batch = next(batches, None)
            result.loader_wall += time.perf_counter() - waiting
            if batch is None:
                break
            inputs = {key: value.to(engine.device) for key, value in batch.items()}
            outputs = engine(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
            loss = loss_of(outputs, inputs)
            engine.backward(loss)
            steps_before = engine.global_steps
            engine.step()
            result.losses.append(float(loss.detach().float()))
            if hooks.after_micro_step is not None:
                epoch, micro = epochs_done.last()
                hooks.after_micro_step(MicroStep(epoch, micro, engine.global_steps, batch, result.losses[-1]))
            if engine.global_steps == steps_before:
                continue  # inside a gradient-accumulation window
            step = engine.global_steps
            if (hooks.after_step is not None and hooks.after_step(step)) or (max_steps and step >= max_steps):
                stop = True
                break
        if not stop and hooks.after_epoch is not None and epochs_done.ended_epoch and epochs_done.completed < epochs:
            hooks.after_epoch(engine.global_steps)
    result.wall, result.cpu = time.perf_counter() - started, time.process_time() - cpu_started
    result.steps = engine.global_steps
    return result
