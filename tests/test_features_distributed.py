"""Features through real DeepSpeed engines: ZeRO-0 single process vs ZeRO-3 on 2 ranks, and crash-resume; the
model carries LoRA adapters (peft), so the lora kind's backward runs under ZeRO-3 too, and the hidden kind reads the
forward of a PEFT model."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tests.launching import check, run_mpirun, run_single

pytestmark = pytest.mark.integration

WORKER = "tests/workers/extract_worker.py"
KINDS = ("proxy", "lm_head", "lora", "hidden")
LORA = ("--lora", "4")


def _load(out, kind: str, rank: int = 0):
    return np.load(out / f"{kind}.rank{rank}.npz")


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory):
    """One uninterrupted 2-rank ZeRO-3 run with a store, every kind."""
    root = tmp_path_factory.mktemp("zero3")
    check(run_mpirun([WORKER, "--zero", "3", "--kinds", ",".join(KINDS), *LORA, "--out", str(root / "out"), "--store",
                      str(root / "store")],
                        timeout=240))
    return root / "out"


def test_zero0_single_process_matches_zero3_two_ranks(zero3_run, tmp_path):
    check(run_single([WORKER, "--zero", "0", "--kinds", ",".join(KINDS), *LORA, "--out", str(tmp_path)],
                     timeout=240))
    for kind in KINDS:
        single, rank0, rank1 = _load(tmp_path, kind), _load(zero3_run, kind, 0), _load(zero3_run, kind, 1)
        np.testing.assert_array_equal(rank0["features"], rank1["features"])  # identical on every rank
        np.testing.assert_allclose(rank0["features"], single["features"], atol=1e-4, rtol=0)
        assert single["features"].shape == (40, 32 if kind in ("proxy", "hidden") else 256)
        assert rank0["empty_mask"].nonzero()[0].tolist() == [5] and not rank0["features"][5].any()
        assert rank0["computed"].tolist() == [0, 1, 2, 3, 4]
    # The model fingerprint does not depend on the ZeRO stage or the world size.
    fingerprints = {(tmp_path / "fingerprint.rank0.txt").read_text()}
    fingerprints |= {(zero3_run / f"fingerprint.rank{rank}.txt").read_text() for rank in (0, 1)}
    assert len(fingerprints) == 1


def test_killed_run_resumes_only_unfinished_shards(zero3_run, tmp_path):
    store, kind = tmp_path / "store", "proxy"
    shards = store / kind / "shards"
    # 40 samples in shards of 8, batches of 4: each shard is one step of both ranks (a batch each), joined and written
    # by rank (shard mod 2); rank 1 dies right after writing its first, shard 1.
    killed = run_mpirun([WORKER, "--zero", "3", "--kinds", kind, *LORA, "--store", str(store), "--out",
                            str(tmp_path / "killed"), "--kill-after", "1"], timeout=180)
    assert killed.returncode != 0, killed.stdout[-3000:]
    finished_before = {json.loads(path.read_text())["shard"] for path in shards.glob("*.done.json")}
    assert 1 in finished_before and 3 not in finished_before, finished_before
    run_ids_before = {path.name: json.loads(path.read_text())["run_id"] for path in shards.glob("*.done.json")}

    check(run_mpirun([WORKER, "--zero", "3", "--kinds", kind, *LORA, "--store", str(store), "--out",
                         str(tmp_path / "resumed")], timeout=180))
    resumed = _load(tmp_path / "resumed", kind)
    assert sorted(resumed["computed"].tolist()) == sorted(set(range(5)) - finished_before)
    assert sorted(resumed["reused"].tolist()) == sorted(finished_before)
    # Finished shards were not rewritten: their markers still carry the first run's id.
    for name, run_id in run_ids_before.items():
        assert json.loads((shards / name).read_text())["run_id"] == run_id
    np.testing.assert_allclose(resumed["features"], _load(zero3_run, kind)["features"], atol=1e-6, rtol=0)
    np.testing.assert_array_equal(resumed["empty_mask"], _load(zero3_run, kind)["empty_mask"])
    assert resumed["samples_per_rank"].tolist() == [12, 12]  # the 24 samples left, halved


def test_fewer_shards_than_ranks_still_split_the_pass_evenly(zero3_run, tmp_path):
    """40 samples in one store shard (the default shard is 512 samples): both ranks compute 20, not rank 0 all."""
    check(run_mpirun([WORKER, "--zero", "3", "--kinds", "proxy", *LORA, "--shard-size", "512", "--store",
                      str(tmp_path / "store"), "--out", str(tmp_path / "out")], timeout=180))
    for rank in (0, 1):
        result = _load(tmp_path / "out", "proxy", rank)
        assert result["samples_per_rank"].tolist() == [20, 20]
        assert result["computed"].tolist() == [0]
        np.testing.assert_allclose(result["features"], _load(zero3_run, "proxy")["features"], atol=1e-4, rtol=0)
