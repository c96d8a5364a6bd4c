"""The features pass's work split evenly over the ranks whatever the number of samples and store shards, and the
store still resumable after a rank dies. The ranks here are threads of one process exchanging through a barrier
(the only collective the pass makes on a plain model is the gather that joins a finished shard);
tests/test_features_distributed.py runs the same split under real DeepSpeed ZeRO-3 on 2 processes."""
from __future__ import annotations

import copy
import threading
from typing import Any, Callable

import numpy as np
import pytest

from ds_cluster.collectives import Collectives
from ds_cluster.features.batches import _batches_of, deal_batches, shard_completion_steps
from ds_cluster.features.extract import run_extraction
from ds_cluster.features.store import FeatureStore
from tests.workers.feature_fixtures import tiny_llama, token_dataset

TIMEOUT_S = 120


def _random_batches(rng: np.random.Generator) -> tuple[list, int]:
    """The batches of a random layout: 1-7 pending shards of 1-40 samples (shard sizes as a store's: all equal but
    the last), cut every 1-9 samples, in order of random lengths."""
    shard_size, num_samples, batch_size = int(rng.integers(1, 41)), int(rng.integers(1, 200)), int(rng.integers(1, 10))
    num_shards = -(-num_samples // shard_size)
    pending = sorted(rng.choice(num_shards, size=min(num_shards, int(rng.integers(1, 8))), replace=False).tolist())
    lengths = rng.integers(1, 64, size=num_samples)

    def bounds(shard: int) -> tuple[int, int]:
        return shard * shard_size, min(num_samples, (shard + 1) * shard_size)

    return _batches_of(pending, bounds, batch_size, lengths), batch_size


def test_every_rank_gets_as_many_batches_and_samples_as_any_other_within_one_batch():
    rng = np.random.default_rng(0)
    for _ in range(3000):
        batches, batch_size = _random_batches(rng)
        world_size = int(rng.integers(1, 9))
        shares = deal_batches(batches, world_size)
        assert len(shares) == world_size
        # Every batch exactly once.
        dealt = sorted(int(indices[0]) for share in shares for _, indices in share)
        assert dealt == sorted(int(indices[0]) for _, indices in batches)
        counts = [len(share) for share in shares]
        samples = [sum(len(indices) for _, indices in share) for share in shares]
        assert max(counts) - min(counts) <= 1, (counts, batch_size)
        assert max(samples) - min(samples) <= batch_size, (samples, batch_size)
        # Each rank's share in shard order, so the shards finish one after another.
        for share in shares:
            shard_order = [shard for shard, _ in share]
            assert shard_order == sorted(shard_order)
        completing = shard_completion_steps(shares)
        finished = [shard for step in sorted(completing) for shard in completing[step]]
        assert sorted(finished) == sorted({shard for shard, _ in batches})  # each shard joined once
        for step, shards in completing.items():  # nothing of a shard is left after its completion step
            for share in shares:
                assert all(later_shard not in shards for later_shard, _ in share[step + 1:])


def test_the_issues_case_48_samples_in_one_shard_are_halved_over_two_ranks():
    lengths = np.arange(48) % 7 + 10
    batches = _batches_of([0], lambda shard: (0, 48), 2, lengths)
    shares = deal_batches(batches, 2)
    assert [len(share) for share in shares] == [12, 12]
    assert [sum(len(indices) for _, indices in share) for share in shares] == [24, 24]
    assert shard_completion_steps(shares) == {11: [0]}


def _run_ranks(world_size: int, work: Callable[[Collectives], Any]) -> list[Any]:
    """`work(collectives)` on `world_size` threads, one rank each; a rank's exception breaks the others' barrier
    (as a dead process breaks a process group) and comes back in its slot."""
    barrier = threading.Barrier(world_size, timeout=TIMEOUT_S)
    slots: list[Any] = [None] * world_size
    results: list[Any] = [None] * world_size

    def collectives(rank: int) -> Collectives:
        def gather(value: Any) -> list[Any]:
            slots[rank] = value
            barrier.wait()
            values = list(slots)
            barrier.wait()
            return values

        return Collectives(rank=rank, world_size=world_size, gather=gather,
                           sum=lambda values: np.sum(gather(np.asarray(values)), axis=0))

    def run(rank: int) -> None:
        try:
            results[rank] = work(collectives(rank))
        except BaseException as err:  # noqa: BLE001 - handed back to the test
            results[rank] = err
            barrier.abort()

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S)
    assert not any(thread.is_alive() for thread in threads)
    return results


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


@pytest.mark.parametrize("world_size, num_samples, shard_size", [(2, 21, 512), (3, 37, 8), (2, 30, 7)])
def test_ranks_share_the_pass_evenly_and_get_the_one_process_features(model, world_size, num_samples, shard_size):
    dataset = token_dataset(num_samples, seed=2, empty=[3])
    alone = run_extraction(model, dataset, kind="lm_head", dim=64, batch_size=4, shard_size=shard_size,
                           show_progress=False)
    models = [copy.deepcopy(model) for _ in range(world_size)]  # a rank's hooks are its own
    results = _run_ranks(world_size, lambda ranks: run_extraction(
        models[ranks.rank], dataset, kind="lm_head", dim=64, batch_size=4, shard_size=shard_size,
        show_progress=False, collectives=ranks))
    for result in results:
        np.testing.assert_allclose(result.features, alone.features, atol=1e-5, rtol=0)
        assert result.empty_mask.nonzero()[0].tolist() == [3]
        assert result.samples_per_rank == results[0].samples_per_rank
        assert sum(result.samples_per_rank) == num_samples
        assert max(result.samples_per_rank) - min(result.samples_per_rank) <= 4
        assert max(result.batches_per_rank) - min(result.batches_per_rank) <= 1
    # Even when the data fit in fewer shards than there are ranks: every rank works.
    assert min(results[0].samples_per_rank) >= num_samples // world_size - 4


def test_a_rank_dying_after_a_shard_leaves_a_store_that_resumes_to_the_same_features(model, tmp_path):
    dataset = token_dataset(40, seed=3)
    options = dict(kind="proxy", batch_size=4, shard_size=8, store=tmp_path / "store", show_progress=False)
    alone = run_extraction(model, dataset, kind="proxy", batch_size=4, shard_size=8, show_progress=False)
    models = [copy.deepcopy(model) for _ in range(2)]

    def dies_after_its_first_shard(ranks: Collectives):
        def die(shard: int) -> None:
            if ranks.rank == 1:
                raise KeyboardInterrupt(f"rank 1 killed after writing shard {shard}")

        return run_extraction(models[ranks.rank], dataset, on_shard_done=die, collectives=ranks, **options)

    killed = _run_ranks(2, dies_after_its_first_shard)
    assert isinstance(killed[1], KeyboardInterrupt) and isinstance(killed[0], threading.BrokenBarrierError)
    store = FeatureStore(tmp_path / "store")
    manifest = store.read_manifest()
    # Shards of 8 in batches of 4: each shard is one step of both ranks, joined by rank (shard mod 2).
    finished = store.finished_shards(manifest)
    assert finished == [0, 1]

    resumed = _run_ranks(2, lambda ranks: run_extraction(models[ranks.rank], dataset, collectives=ranks, **options))
    for result in resumed:
        assert result.reused_shards == [0, 1] and result.computed_shards == [2, 3, 4]
        assert result.samples_per_rank == [12, 12]  # the 24 samples left, halved
        np.testing.assert_allclose(result.features, alone.features, atol=1e-6, rtol=0)
    assert store.finished_shards(manifest) == [0, 1, 2, 3, 4]
