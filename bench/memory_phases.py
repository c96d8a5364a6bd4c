"""This process's resident memory, sampled in a thread and put down to the phase of the job that was running.

    memory = PhaseMemory().start()          # also listens to ds_cluster's own phase log records
    with memory.phase("load"):
        ...
    memory.stop(); memory.peaks()           # [{"phase", "seconds", "peak_rss", "peak_uss", "rss_at_start", ...}]

The peak RSS (resident set) is the kernel's own: every `interval` seconds the sampler reads the high-water mark
(VmHWM in /proc/self/status) and resets it (`5` written to /proc/self/clear_refs), so each reading is the largest
RSS since the one before, a spike shorter than the interval included (read as the current RSS every 50 ms, two
runs of the same plain job's larger rank peaked 0.45 GB apart; read as the high-water mark, three runs 0.18 GB
apart: diagnostic runs of 2026-12-06 whose logs were not kept). Where the reset is not allowed it falls
back to the current RSS (/proc/self/statm). USS (the pages only this process holds: psutil's memory_full_info,
which reads smaps, so it is slower) is read every `uss_interval`. Both are also read as each phase starts and ends,
so a phase shorter than an interval still has its figures. A sample counts for the innermost
phase running (a library phase inside the bench's `initialize` counts for itself, not for `initialize`). A phase that
runs more than once (training before and after a checkpoint) keeps one entry per run, in order.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Any, Iterator, Optional

from ds_cluster.phases import EVENT_FIELD, PHASE_FIELD, PHASE_LOGGER

PAGE = os.sysconf("SC_PAGE_SIZE")
OUTSIDE = "(between phases)"


def rss_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as handle:
        return int(handle.read().split()[1]) * PAGE


def high_water_bytes() -> int:
    """The largest RSS since the last `reset_high_water` (VmHWM)."""
    with open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmHWM in /proc/self/status")


def reset_high_water() -> bool:
    """Start VmHWM again from the current RSS; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def uss_bytes() -> int:
    import psutil

    return int(psutil.Process().memory_full_info().uss)


class PhaseMemory(logging.Handler):
    """Peak RSS and USS of this process per phase of the job; a logging handler for ds_cluster's phase records."""

    def __init__(self, interval: float = 0.05, uss_interval: float = 1.0) -> None:
        super().__init__(level=logging.INFO)
        self.interval, self.uss_interval = interval, uss_interval
        self._lock = threading.Lock()
        self._stack: list[dict[str, Any]] = []
        self._records: list[dict[str, Any]] = []
        self._outside = self._new(OUTSIDE)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._last_uss = 0.0
        self._sampling = threading.Lock()  # one reading and reset of the high-water mark at a time
        self.exact_peaks = reset_high_water()

    @staticmethod
    def _new(name: str) -> dict[str, Any]:
        return {"phase": name, "started": time.time(), "ended": None, "peak_rss": 0, "peak_uss": 0,
                "rss_at_start": 0, "uss_at_start": 0}

    # ------------------------------------------------------------------ phases
    def start(self) -> "PhaseMemory":
        phase_logger = logging.getLogger(PHASE_LOGGER)
        phase_logger.addHandler(self)
        if phase_logger.getEffectiveLevel() > logging.INFO:
            phase_logger.setLevel(logging.INFO)  # a rank whose root logger says WARNING still reports its phases
        self._thread = threading.Thread(target=self._run, name="phase-memory", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        logging.getLogger(PHASE_LOGGER).removeHandler(self)

    def enter(self, name: str) -> None:
        self._sample(with_uss=True)
        record = self._new(name)
        record["rss_at_start"], record["uss_at_start"] = rss_bytes(), uss_bytes()
        with self._lock:
            self._stack.append(record)
            self._records.append(record)
        self._sample(with_uss=False)

    def leave(self, name: str) -> None:
        self._sample(with_uss=True)
        with self._lock:
            for index in range(len(self._stack) - 1, -1, -1):  # the innermost run of `name`
                if self._stack[index]["phase"] == name:
                    self._stack.pop(index)["ended"] = time.time()
                    break

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.enter(name)
        try:
            yield
        finally:
            self.leave(name)

    def emit(self, record: logging.LogRecord) -> None:
        name, event = getattr(record, PHASE_FIELD, None), getattr(record, EVENT_FIELD, None)
        if name is None:
            return
        if event == "start":
            self.enter(name)
        elif event == "end":
            self.leave(name)

    # ------------------------------------------------------------------ sampling
    def _peak_since_last_sample(self) -> int:
        if not self.exact_peaks:
            return rss_bytes()
        with self._sampling:
            peak = high_water_bytes()
            reset_high_water()
        return peak

    def _sample(self, with_uss: bool) -> None:
        rss = self._peak_since_last_sample()
        uss = uss_bytes() if with_uss else 0
        with self._lock:
            current = self._stack[-1] if self._stack else self._outside
            current["peak_rss"] = max(current["peak_rss"], rss)
            current["peak_uss"] = max(current["peak_uss"], uss)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            with_uss = now - self._last_uss >= self.uss_interval
            if with_uss:
                self._last_uss = now
            try:
                self._sample(with_uss)
            except (OSError, ValueError):  # the process is exiting
                return

    def peaks(self) -> list[dict[str, Any]]:
        """Every phase run in order: name, start and end (epoch seconds), seconds, peak RSS and USS (bytes)."""
        with self._lock:
            records = [dict(record) for record in self._records]
        for record in records:
            ended = record["ended"] if record["ended"] is not None else time.time()
            record["seconds"] = round(ended - record["started"], 3)
        return records
