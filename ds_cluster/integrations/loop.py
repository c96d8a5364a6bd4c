"""The plain DeepSpeed training loop over the cluster loader, with the weighted loss: the one loop of
`python -m ds_cluster.train` and of the quality benchmark's job.

    result = train_loop(engine, loader, epochs=2, hooks=LoopHooks(after_step=save_every_100))

`deepspeed.initialize` (with `ds_cluster.install()`, or `ds_cluster.initialize`) gives the engine and the loader;
each micro-batch is a forward, `weighted_causal_lm_loss`, `engine.backward` (which hands the per-sample losses to
the loader) and `engine.step`. What a caller adds (checkpoints, a trace, validation at the end of an epoch, a
record of the learning rate) goes in `LoopHooks`. The loop also measures what the loader costs: the time spent
waiting for the next batch (the plan lookup, a window's opening, collating).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ds_cluster.loader.loss import weighted_causal_lm_loss


@dataclass(frozen=True)
class LoopHooks:
    """What a caller does at the loop's three points; each may be None."""

    # After each micro-batch's step: the batch (as the loader gave it) and its weighted loss.
    after_micro_step: Optional[Callable[[Any, float], None]] = None
    # After each optimizer step, with the engine's step count; returning True ends the run there.
    after_step: Optional[Callable[[int], Optional[bool]]] = None
    # After an epoch ran to its end when the run goes on (not after the last one), with the step count.
    after_epoch: Optional[Callable[[int], None]] = None


@dataclass
class LoopResult:
    """What the loop did on this rank."""

    losses: list = field(default_factory=list)  # every micro-step's weighted loss
    wall: float = 0.0  # seconds in the loop (the hooks' own time included)
    cpu: float = 0.0  # this process's CPU seconds in the loop (all its threads)
    loader_wall: float = 0.0  # seconds waiting on the loader for the next batch
    steps: int = 0  # the engine's optimizer steps at the end


def train_loop(engine: Any, loader: Any, *, epochs: int, max_steps: int = 0,
               hooks: Optional[LoopHooks] = None) -> LoopResult:
    """Train `engine` on `loader` for `epochs` epochs (the loader's own, so a resumed run finishes the one it was
    in), or until `max_steps` optimizer steps (0: no cap), a hook says stop, or the loader's schedule ends the run
    (the adaptive schedule's automatic budget). Collective: every rank runs it."""
    hooks = hooks or LoopHooks()
    result = LoopResult()
    micro_per_step = engine.gradient_accumulation_steps()
    started, cpu_started = time.perf_counter(), time.process_time()
    stop = False
    while not stop and loader.completed_epochs < epochs:
        batches = iter(loader)
        while True:
            waiting = time.perf_counter()
            batch = next(batches, None)
            result.loader_wall += time.perf_counter() - waiting
            if batch is None:
                break
            inputs = {key: value.to(engine.device) for key, value in batch.items()}
            outputs = engine(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
            loss = weighted_causal_lm_loss(outputs, inputs)
            engine.backward(loss)
            engine.step()
            result.losses.append(float(loss.detach().float()))
            if hooks.after_micro_step is not None:
                hooks.after_micro_step(batch, result.losses[-1])
            if loader.position % micro_per_step:
                continue  # inside a gradient-accumulation window
            step = engine.global_steps
            if (hooks.after_step is not None and hooks.after_step(step)) or (max_steps and step >= max_steps):
                stop = True
                break
        if (not stop and hooks.after_epoch is not None and loader.position >= loader.micro_batches_per_epoch
                and loader.completed_epochs < epochs):
            hooks.after_epoch(engine.global_steps)
    result.wall, result.cpu = time.perf_counter() - started, time.process_time() - cpu_started
    result.steps = engine.global_steps
    return result
