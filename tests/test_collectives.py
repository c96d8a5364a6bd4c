"""The agreement checks: an error on one rank is an error on every rank, never a rank left waiting."""
from __future__ import annotations

import threading
from typing import Any, Callable

import pytest

from ds_cluster.collectives import Collectives

TIMEOUT_S = 30


def _run_two_ranks(work: Callable[[Collectives], Any]) -> list[Any]:
    """`work` on two threads, one rank each, gathering through a barrier; each rank's result or exception."""
    barrier = threading.Barrier(2, timeout=TIMEOUT_S)
    slots: list[Any] = [None, None]
    outcomes: list[Any] = [None, None]

    def collectives(rank: int) -> Collectives:
        def gather(value: Any) -> list[Any]:
            slots[rank] = value
            barrier.wait()
            values = list(slots)
            barrier.wait()
            return values
        return Collectives(rank=rank, world_size=2, gather=gather)

    def run(rank: int) -> None:
        try:
            outcomes[rank] = work(collectives(rank))
        except BaseException as error:  # noqa: BLE001 - handed back to the test
            outcomes[rank] = error

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S * 3)
    return outcomes


def _fails_with(error: BaseException) -> Callable[[], None]:
    def function() -> None:
        raise error
    return function


def test_any_error_of_the_one_rank_that_works_reaches_the_others():
    outcomes = _run_two_ranks(lambda ranks: ranks.run_agreed(
        "writing the folder", _fails_with(KeyError("summary")), only_rank=0))
    assert isinstance(outcomes[0], KeyError)  # the failing rank keeps its own error
    assert isinstance(outcomes[1], RuntimeError)
    assert "writing the folder failed on ranks [0]" in str(outcomes[1]) and "KeyError" in str(outcomes[1])


def test_a_value_error_on_every_rank_is_one_error_naming_each():
    outcomes = _run_two_ranks(lambda ranks: ranks.run_agreed(
        "reading the data", _fails_with(ValueError(f"bad record on rank {ranks.rank}"))))
    for outcome in outcomes:
        assert isinstance(outcome, ValueError)
        assert "rank 0: ValueError: bad record on rank 0; rank 1: ValueError: bad record on rank 1" in str(outcome)


def test_success_gives_the_result_where_it_was_computed():
    outcomes = _run_two_ranks(lambda ranks: ranks.run_agreed("counting", lambda: 7, only_rank=0))
    assert outcomes == [7, None]


def test_unlisted_errors_on_every_rank_propagate_as_they_are():
    outcomes = _run_two_ranks(lambda ranks: ranks.run_agreed("typing", _fails_with(TypeError("no"))))
    assert all(isinstance(outcome, TypeError) for outcome in outcomes)


@pytest.mark.parametrize("rank", [0, 1])
def test_agree_on_error_raises_on_the_rank_that_did_not_fail(rank):
    outcomes = _run_two_ranks(lambda ranks: ranks.agree_on_error(
        OSError("disk full") if ranks.rank == rank else None, "saving"))
    assert isinstance(outcomes[rank], OSError)
    assert isinstance(outcomes[1 - rank], RuntimeError) and "saving failed on ranks" in str(outcomes[1 - rank])
