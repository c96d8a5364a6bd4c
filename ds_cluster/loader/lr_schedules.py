"""Learning-rate schedules whose length is known only once the plan is built."""
from __future__ import annotations

import math
from typing import Callable


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
