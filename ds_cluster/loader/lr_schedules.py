"""Learning-rate schedules whose length is known only once the plan is built."""
from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Optional

import torch

from ds_cluster.loader.sampler import cluster_loader


def warmup_cosine(total_steps: Callable[[], int], warmup_fraction: float) -> Callable[[int], float]:
    """A LambdaLR factor: linear warm-up over ``warmup_fraction`` of the steps, then cosine to 0 at the last step.

    ``total_steps`` is read at every call, so the scheduler can be made before
    the run's length is known (deepspeed.initialize builds the loader and the
    scheduler together; the plan then gives the steps per epoch).
    """
    def factor(step: int) -> float:
        total = max(total_steps(), 1)
        warmup = max(1, round(warmup_fraction * total))
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1.0 + math.cos(math.pi * min(step - warmup, total - warmup) / max(total - warmup, 1)))
    return factor


def warmup_stable_decay(total_steps: Callable[[], int], warmup_fraction: float, decay_fraction: float,
                        cooldown: Callable[[], Optional[tuple[int, int]]] = lambda: None) -> Callable[[int], float]:
    """A LambdaLR factor for a run that may end before its step cap (the adaptive schedule's auto budget):
    linear warm-up over ``warmup_fraction`` of the cap, then constant, then linear to 0, over the last
    ``decay_fraction`` of the cap, or sooner over the cool-down that ``cooldown`` announces ((first step, end
    step), e.g. the adaptive loader's ``cooldown_steps``; None while the run goes on), whichever is lower.

    The rate cannot decay towards an end nobody knows yet: it stays constant until the run has decided.
    """
    def factor(step: int) -> float:
        total = max(total_steps(), 1)
        warmup = max(1, round(warmup_fraction * total))
        if step < warmup:
            return (step + 1) / warmup
        decay_start = total - max(1, round(decay_fraction * total))
        value = 1.0 if step < decay_start else max(total - step, 0) / max(total - decay_start, 1)
        announced = cooldown()
        if announced is not None:
            start, end = announced
            if step >= start:
                value = min(value, max(end - step, 0) / max(end - start, 1))
        return value
    return factor


def run_lr_schedule(total_steps: Callable[[], int], warmup_fraction: float,
                    loader: Callable[[], Any]) -> Callable[[int], float]:
    """The LambdaLR factor of a run: `warmup_cosine` to the run's last step or, when the loader's schedule may end
    the run itself with a cool-down (the auto budget with `auto_cooldown` > 0: `ClusterDataLoader.run_end`),
    `warmup_stable_decay` over the cool-down it announces. `loader()`: ds_cluster's loader, None until
    deepspeed.initialize has built it or when the run has none (the factor of step 0, which LambdaLR reads then, is
    the warm-up's either way); the choice is made at the first step after it exists, when its first block is
    open."""
    cosine = warmup_cosine(total_steps, warmup_fraction)
    chosen: dict[str, Callable[[int], float]] = {}

    def factor(step: int) -> float:
        built = loader()
        if built is None:
            return cosine(step)
        if "factor" not in chosen:
            run_end = built.run_end()
            # The auto budget decides its end while training: constant LR until then, linear to 0 over its cool-down.
            chosen["factor"] = cosine if run_end is None else warmup_stable_decay(
                total_steps, warmup_fraction, run_end.fraction / (1 + run_end.fraction),
                lambda: getattr(built.run_end(), "steps", None))
        return chosen["factor"](step)
    return factor


class LateLRSchedule:
    """The learning-rate schedule of a training script whose run length and loader exist only once
    `deepspeed.initialize` has returned: give `scheduler` to initialize as its `lr_scheduler`, then call `start`
    with what initialize returned. The factor is `run_lr_schedule`'s.

        lr = LateLRSchedule(warmup_fraction=0.05)
        engine, _, loader, _ = deepspeed.initialize(..., lr_scheduler=lr.scheduler)
        lr.start(loader, total_steps=epochs * steps_per_epoch)
    """

    def __init__(self, warmup_fraction: float) -> None:
        self.total_steps = 0
        self.loader: Any = None
        self.factor = run_lr_schedule(lambda: self.total_steps, warmup_fraction, lambda: self.loader)

    def scheduler(self, optimizer: Any) -> Any:
        """What deepspeed.initialize's `lr_scheduler` takes: a LambdaLR over the late-bound factor."""
        return torch.optim.lr_scheduler.LambdaLR(optimizer, self.factor)

    def start(self, loader: Any, total_steps: int) -> None:
        """The run's loader (ds_cluster's, or DeepSpeed's own: then plain warm-up and cosine) and its length."""
        self.loader = cluster_loader(loader)
        self.total_steps = int(total_steps)


def run_schedule(cluster_sampling: Any, total_steps: Callable[[], int], warmup_fraction: float,
                 loader: Callable[[], Any]) -> Callable[[int], float]:
    """0.5.0's `run_lr_schedule`, which read the block: the loader's schedule says it now."""
    warnings.warn("run_schedule(block, ...) is run_lr_schedule(total_steps, warmup_fraction, loader) since 0.6.0",
                  DeprecationWarning, stacklevel=2)
    return run_lr_schedule(total_steps, warmup_fraction, loader)
