"""What one all-gather costs a CPU rank under gloo: the growth of each rank's peak RSS while a 100 MB float32 tensor
is gathered from 2 ranks' halves with all_gather_into_tensor (the call DeepSpeed's ZeRO-3 gathers make). The output
is allocated untouched, so the growth counts the output's pages and whatever gloo holds beside them;
bench/zero3_memory.py's GATHER_COPIES is this ratio, rounded.

    torchrun --nproc_per_node 2 --master_addr 127.0.0.1 bench/gloo_gather_memory.py     # prints one line a rank
"""
from __future__ import annotations

import resource
import sys

import torch
import torch.distributed as dist

ELEMENTS = 25_000_000  # the gathered tensor: 100 MB of float32


def peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    part = torch.ones(ELEMENTS // world)
    output = torch.empty(ELEMENTS)
    before = peak_bytes()
    dist.all_gather_into_tensor(output, part)
    grown = peak_bytes() - before
    print(f"rank {rank}: a {output.numel() * 4 / 1e6:.0f} MB gather grew the peak by {grown / 1e6:.0f} MB "
          f"({grown / (output.numel() * 4):.2f} times the tensor)", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
