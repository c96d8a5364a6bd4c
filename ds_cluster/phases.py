"""The phases of a ds_cluster job (the features pass, clustering, the plan), logged where each starts and ends, so a
user reading the log, or a memory sampler watching it, knows which part of the job is running; each phase ends by
giving back the memory the process freed.

Records go to the logger ``ds_cluster.phases`` at INFO; each carries ``ds_cluster_phase`` (the phase's name) and
``ds_cluster_phase_event`` ("start" or "end") for a handler to read instead of parsing the message.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import gc
import logging
import sys
import time
from typing import Iterator

PHASE_LOGGER = "ds_cluster.phases"
PHASE_FIELD = "ds_cluster_phase"
EVENT_FIELD = "ds_cluster_phase_event"

logger = logging.getLogger(PHASE_LOGGER)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Log the start and the end of `name` (the end also when the block raises), with its seconds; at the end, give
    back what was freed (`release_freed_memory`), so the next phase (training too) starts from what the job holds.
    The analysis releases once more before its first phase (`ds_cluster.analysis.compute.analyze`)."""
    started = time.perf_counter()
    logger.info("phase %s started", name, extra={PHASE_FIELD: name, EVENT_FIELD: "start"})
    try:
        yield
    finally:
        release_freed_memory()
        logger.info("phase %s ended after %.1f s", name, time.perf_counter() - started,
                    extra={PHASE_FIELD: name, EVENT_FIELD: "end"})


def release_freed_memory(collect: bool = True) -> None:
    """Give memory this process has freed back to the system: the objects only a collection frees (`collect`), a
    CUDA device's cached blocks, and on glibc the freed heap (malloc_trim). glibc keeps what a phase's many
    medium-sized temporaries freed (on this project's CPU machines 1.3 GB after the lora features of a 360M model,
    by far the largest part of the pass's footprint), and the next phase cannot always reuse it."""
    if collect:
        gc.collect()
    torch = sys.modules.get("torch")  # only when torch is loaded: this module does not need it
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.lru_cache(maxsize=None)
def _malloc_trim():
    """glibc's malloc_trim, or None on another C library."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
