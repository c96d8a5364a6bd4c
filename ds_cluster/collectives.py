"""Rank, world size and the two collectives the stages use, passed in instead of read from globals.

The stages (feature extraction, analysis, sharded clustering) never ask
torch.distributed who they are: the caller hands them a `Collectives`, built
at one of the two ends (`ds_cluster.distributed.collectives(group)`), or
`LOCAL` for a single process. The agreement checks live here because they
need nothing but a gather: a failure on any rank becomes an error on every
rank, never a rank left waiting in a collective.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, TypeVar

import numpy as np

Result = TypeVar("Result")


def _gather_alone(value: Any) -> list[Any]:
    return [value]


def _sum_alone(values: Any) -> np.ndarray:
    return np.asarray(values)


@dataclass(frozen=True)
class Collectives:
    """Who this process is among the ranks, and how to gather and sum across them.

    gather(value) -> every rank's value in rank order (all ranks call it);
    sum(array) -> the element-wise sum over the ranks (int64 or float64).
    """

    rank: int = 0
    world_size: int = 1
    gather: Callable[[Any], list[Any]] = _gather_alone
    sum: Callable[[Any], np.ndarray] = _sum_alone

    def agree_on_error(self, error: Optional[BaseException], what: str) -> None:
        """Collective check: if any rank hit an error, raise a clear one on every rank.

        Call it on every rank, passing the local exception (or None): ranks that
        succeeded then fail too instead of waiting forever for the failed one.
        """
        messages = self.gather(None if error is None else f"{type(error).__name__}: {error}")
        failed = {rank: message for rank, message in enumerate(messages) if message is not None}
        if not failed:
            return
        if error is not None and len(failed) == 1:
            raise error
        summary = "; ".join(f"rank {rank}: {message}" for rank, message in failed.items())
        exc_type = (type(error) if error is not None and isinstance(error, (ValueError, FileNotFoundError))
                    else RuntimeError)
        raise exc_type(f"{what} failed on ranks {sorted(failed)}: {summary}") from error

    def run_agreed(self, what: str, function: Callable[[], Result], *, only_rank: Optional[int] = None,
                   errors: tuple[type[BaseException], ...] = (ValueError, OSError)) -> Optional[Result]:
        """Collective: call `function` (on every rank, or on `only_rank` alone), then agree on the outcome.

        If it raised one of `errors` on any rank, every rank raises (`agree_on_error`); otherwise its
        result is returned (None on the ranks that did not call it). When every rank calls it, other exceptions
        propagate at once; when one rank alone does (`only_rank`), any exception is agreed on, since the other
        ranks would otherwise wait for it in the next collective until the process group times out.
        """
        error: Optional[BaseException] = None
        result: Optional[Result] = None
        agreed = errors if only_rank is None else (Exception,)
        if only_rank is None or self.rank == only_rank:
            try:
                result = function()
            except agreed as err:
                error = err
        self.agree_on_error(error, what)
        return result

    def check_agreement(self, value: Any, what: str,
                        fix: str = "Every rank must see the same data, config and analysis directory.") -> None:
        """Raise on every rank, naming the ranks that differ from rank 0 and `fix`, if the values disagree."""
        values = self.gather(value)
        differing = [rank for rank, other in enumerate(values) if other != values[0]]
        if differing:
            detail = ", ".join(f"rank {rank}: {values[rank]!r}" for rank in [0] + differing)
            raise RuntimeError(
                f"ranks disagree on the {what}: ranks {differing} differ from rank 0 ({detail}). {fix}"
            )

    def barrier(self) -> None:
        self.gather(None)


# One process, no process group: what a test or a notebook passes.
LOCAL = Collectives()
