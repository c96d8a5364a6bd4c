"""Batch arithmetic: world size x micro batch x accumulation steps, checked and read from a DeepSpeed config.

DeepSpeed's rule: train_batch_size = train_micro_batch_size_per_gpu x
gradient_accumulation_steps x data-parallel world size, with a missing one
of the three derived from the others. Hugging Face configs often say "auto"
(the Trainer fills it in); a command that needs the figure then asks for it
by name instead of guessing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

import numpy as np

TRAIN_BATCH = "train_batch_size"
MICRO_BATCH = "train_micro_batch_size_per_gpu"
ACCUMULATION = "gradient_accumulation_steps"
BATCH_KEYS = (TRAIN_BATCH, MICRO_BATCH, ACCUMULATION)


@dataclass(frozen=True)
class BatchShape:
    """How many samples one optimizer step takes: world x micro x accumulation."""

    world_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int

    def __post_init__(self) -> None:
        check_batch_shape(self.world_size, self.micro_batch_size, self.gradient_accumulation_steps)

    @property
    def per_rank(self) -> int:
        """Samples one rank takes per optimizer step (micro x accumulation)."""
        return self.micro_batch_size * self.gradient_accumulation_steps

    @property
    def global_batch_size(self) -> int:
        return self.world_size * self.per_rank


def check_batch_shape(world_size: Any, micro_batch_size: Any, gradient_accumulation_steps: Any) -> None:
    for name, value in (("world_size", world_size), ("micro_batch_size", micro_batch_size),
                        ("gradient_accumulation_steps", gradient_accumulation_steps)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _number(config: Mapping[str, Any], key: str) -> Optional[int]:
    value = config.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _is_auto(config: Mapping[str, Any], key: str) -> bool:
    return config.get(key) == "auto"


def batch_shape_from_config(config: Mapping[str, Any], source: str, *, world_size: Optional[int] = None,
                            micro_batch_size: Optional[int] = None,
                            gradient_accumulation_steps: Optional[int] = None,
                            flags: Mapping[str, str] = {}) -> BatchShape:  # noqa: B006 - read only
    """The batch shape of a run: the given values first, then the config's, by DeepSpeed's rules.

    A value the config says "auto" must be given: ValueError naming the key,
    the config and the flag (`flags` maps world_size / micro_batch_size /
    gradient_accumulation_steps to the caller's flag names). Without a world
    size it is train_batch_size / (micro x accumulation) when the config has
    all three numbers, else 1.
    """
    def ask(key: str, flag_of: str) -> ValueError:
        flag = flags.get(flag_of, flag_of)
        return ValueError(f"{key} is 'auto' in {source}: pass {flag}")

    train = _number(config, TRAIN_BATCH)
    micro = micro_batch_size if micro_batch_size is not None else _number(config, MICRO_BATCH)
    accumulation = (gradient_accumulation_steps if gradient_accumulation_steps is not None
                    else _number(config, ACCUMULATION))
    if micro is None and _is_auto(config, MICRO_BATCH):
        raise ask(MICRO_BATCH, "micro_batch_size")
    if accumulation is None and _is_auto(config, ACCUMULATION):
        raise ask(ACCUMULATION, "gradient_accumulation_steps")
    if world_size is None:
        if _is_auto(config, TRAIN_BATCH):
            raise ask(TRAIN_BATCH, "world_size")
        if train is not None and micro is not None and accumulation is not None:
            if train % (micro * accumulation):
                raise ValueError(f"{source}: {TRAIN_BATCH} {train} is not a multiple of micro batch {micro} x "
                                 f"accumulation {accumulation}: pass {flags.get('world_size', 'world_size')}")
            world_size = train // (micro * accumulation)
        else:
            world_size = 1
    # DeepSpeed derives a missing micro batch or accumulation from train_batch_size, else takes 1.
    if accumulation is None:
        accumulation = max(train // (micro * world_size), 1) if (train is not None and micro is not None) else 1
    if micro is None:
        micro = max(train // (world_size * accumulation), 1) if train is not None else 1
    return BatchShape(int(world_size), int(micro), int(accumulation))


def check_batch_arithmetic(config: Mapping[str, Any], source: str, world_size: int) -> None:
    """train_batch_size = micro x accumulation x world, or a ValueError saying which key to change and how.

    DeepSpeed asserts the same later, naming the numbers but not the keys or
    the fix. Values that are not numbers ("auto") are left to DeepSpeed.
    """
    values = {key: config.get(key) for key in BATCH_KEYS}
    if any(value is not None and _number(config, key) is None for key, value in values.items()):
        return
    for key, value in values.items():
        if value is not None and value < 1:
            raise ValueError(f"{source}: {key} must be >= 1, got {value}")
    train, micro, accumulation = values[TRAIN_BATCH], values[MICRO_BATCH], values[ACCUMULATION]
    if train is None or (micro is None and accumulation is None):
        if train is not None and train % world_size:
            raise ValueError(f"{source}: {TRAIN_BATCH} {train} is not a multiple of the world size {world_size}; "
                             f"set {MICRO_BATCH} (and {ACCUMULATION}) instead")
        return
    micro = micro if micro is not None else max(train // world_size // accumulation, 1)
    accumulation = accumulation if accumulation is not None else max(train // (micro * world_size), 1)
    product = micro * accumulation * world_size
    if train != product:
        raise ValueError(
            f"{source}: {TRAIN_BATCH} {train} != {MICRO_BATCH} {micro} x {ACCUMULATION} {accumulation} x "
            f"data-parallel world size {world_size} (= {product}); set {TRAIN_BATCH} to {product}, or remove it "
            "and DeepSpeed derives it from the other two"
        )
