"""Learning-rate schedules whose length is known only once the plan is built."""
from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Optional


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
    the run itself with a cool-down (the auto budget with `auto_cooldown` > 0: `ClusterDataLoader.cooldown_fraction`),
    `warmup_stable_decay` over the cool-down it announces. `loader()`: the loader, None until deepspeed.initialize
    has built it (the factor of step 0, which LambdaLR reads then, is the warm-up's either way)."""
    cosine = warmup_cosine(total_steps, warmup_fraction)
    chosen: dict[str, Callable[[int], float]] = {}

    def factor(step: int) -> float:
        built = loader()
        if built is None:
            return cosine(step)
        if "factor" not in chosen:
            cooldown = built.cooldown_fraction
            # The auto budget decides its end while training: constant LR until then, linear to 0 over its cool-down.
            chosen["factor"] = cosine if not cooldown else warmup_stable_decay(
                total_steps, warmup_fraction, cooldown / (1 + cooldown), lambda: built.cooldown_steps())
        return chosen["factor"](step)
    return factor


def run_schedule(cluster_sampling: Any, total_steps: Callable[[], int], warmup_fraction: float,
                 loader: Callable[[], Any]) -> Callable[[int], float]:
    """0.5.0's `run_lr_schedule`, which read the block: the loader's schedule says it now."""
    warnings.warn("run_schedule(block, ...) is run_lr_schedule(total_steps, warmup_fraction, loader) since 0.6.0",
                  DeprecationWarning, stacklevel=2)
    return run_lr_schedule(total_steps, warmup_fraction, loader)
