"""The training script says when --bf16 would be slow: on DeepSpeed's CPU accelerator, a CPU without bf16
instructions multiplies bf16 matrices two orders of magnitude slower than float32 (measured on an AVX2 host)."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from ds_cluster import train


@pytest.mark.parametrize("avx512_bf16, amx, accelerator, slow", [
    (False, False, "cpu", True),
    (True, False, "cpu", False),
    (False, True, "cpu", False),
    (False, False, None, False),  # a GPU job: the CPU's instructions do not matter
])
def test_bf16_is_slow_only_on_a_cpu_accelerator_without_bf16_instructions(monkeypatch, avx512_bf16, amx,
                                                                          accelerator, slow):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    if accelerator is None:
        monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    else:
        monkeypatch.setenv("DS_ACCELERATOR", accelerator)
    assert train.bf16_is_slow_here() is slow


@pytest.mark.skipif(not Path("/proc/cpuinfo").is_file(), reason="reads the kernel's CPU flags")
def test_the_check_agrees_with_the_kernels_cpu_flags(monkeypatch):
    flags = next(line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("flags"))
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert train.bf16_is_slow_here() is not bool({"avx512_bf16", "amx_bf16"} & set(flags))


@pytest.mark.parametrize("slow", [True, False])
def test_the_training_script_warns_on_rank_0_when_bf16_would_be_slow(monkeypatch, caplog, slow):
    monkeypatch.setattr(train, "bf16_is_slow_here", lambda: slow)
    monkeypatch.setenv("RANK", "0")
    args = train.parse_args(["--deepspeed", "ds_configs/zero0.json", "--model", "m", "--data", "d", "--analysis", "a",
                             "--output-dir", "o", "--bf16"])
    with caplog.at_level(logging.WARNING, logger="ds_cluster.train"):
        config = train.prepare_config(args)
    assert config["bf16"] == {"enabled": True}
    assert any("leave out --bf16" in record.getMessage() for record in caplog.records) is slow
