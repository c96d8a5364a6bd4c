"""The training script says when --bf16 would be slow: on DeepSpeed's CPU accelerator, a CPU without bf16
instructions multiplies bf16 matrices two orders of magnitude slower than float32 (measured on an AVX2 host)."""
from __future__ import annotations

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
