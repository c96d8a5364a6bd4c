"""Rank and world, MPI discovery that honours MASTER_ADDR, gathers, and plan agreement.

This is one of the two ends of the pipeline allowed to touch torch.distributed.
"""
from __future__ import annotations

import atexit
import gc
import logging
import os
import random
import socket
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional, Union

from ds_cluster.collectives import LOCAL, Collectives

logger = logging.getLogger(__name__)

_MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")


def is_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if is_initialized() else int(os.environ.get("RANK", 0))


def get_world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def launched_by_mpi() -> bool:
    """True under mpirun without a torch-style launcher having set RANK."""
    return "RANK" not in os.environ and any(var in os.environ for var in _MPI_RANK_VARS)


def interface_address(ifname: str) -> Optional[str]:
    """IPv4 address of a network interface, or None."""
    import psutil

    for address in psutil.net_if_addrs().get(ifname, []):
        if address.family == socket.AF_INET:
            return address.address
    return None


def _own_address() -> str:
    # The interface gloo is told to use is the one peers can reach us on.
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    if ifname:
        address = interface_address(ifname.split(",")[0])
        if address:
            return address
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def mpi_discovery(default_port: int = 29500) -> None:
    """Set RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT from MPI.

    DeepSpeed's own discovery takes rank 0's address from `hostname -I`, which
    is not the loopback or private interface the job runs on; we take it from
    MASTER_ADDR when set, else rank 0's address on GLOO_SOCKET_IFNAME,
    broadcast over MPI.
    """
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, world_size = comm.Get_rank(), comm.Get_size()
    master_addr = os.environ.get("MASTER_ADDR") or (_own_address() if rank == 0 else None)
    master_addr = comm.bcast(master_addr, root=0)
    local_rank = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", os.environ.get("MPI_LOCALRANKID", 0)))
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(local_rank),
        MASTER_ADDR=master_addr,
        MASTER_PORT=os.environ.get("MASTER_PORT", str(default_port)),
    )
    comm.Barrier()
    logger.info("MPI discovery: rank %d of %d, master %s:%s", rank, world_size, master_addr, os.environ["MASTER_PORT"])


def init_distributed(timeout_s: float = 600.0) -> None:
    """Start the process group the way DeepSpeed does, after our own MPI discovery."""
    if is_initialized():
        return
    under_mpi = launched_by_mpi()  # asked before discovery sets RANK
    if under_mpi:
        mpi_discovery()
    else:
        # A single process started by hand: DeepSpeed would fall back to MPI discovery.
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    import deepspeed

    try:
        deepspeed.init_distributed(auto_mpi_discovery=False, timeout=timedelta(seconds=timeout_s))
    except Exception:
        if not under_mpi:
            raise
        # Under mpirun a rank that fails here (rank 0's rendezvous port taken: EADDRINUSE) would leave the others
        # waiting out the rendezvous timeout and itself blocked in MPI's finalize at exit: stop the whole job now.
        logger.exception("rank %s could not start the process group (MASTER_ADDR %s, MASTER_PORT %s): stopping "
                         "every rank", os.environ.get("RANK"), os.environ.get("MASTER_ADDR"),
                         os.environ.get("MASTER_PORT"))
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)
        raise
    release_shared_memory_buffer()


def shared_memory_buffer_path(rank: int) -> str:
    """Where DeepSpeed's CPU shm all-reduce keeps a rank's buffer (named by uid, master address and port)."""
    return (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{rank}")


def release_shared_memory_buffer() -> None:
    """Unlink this rank's DeepSpeed shm all-reduce buffer name once every rank has mapped it.

    DeepSpeed's CPU shared-memory all-reduce (ranks on one node) creates a
    /dev/shm file of about 66 MB per rank and never unlinks it, so every job
    leaks it until /dev/shm (RAM) is full. Each rank maps its peers' buffers
    while the process group starts, so after a barrier the names can go; the
    mappings stay valid until the processes exit, even if they are killed.

    Collective: call it on every rank, at any point after DeepSpeed's
    communication backend exists (a second call is harmless). The name is
    also unlinked at interpreter exit, for a backend created after the last
    call.
    """
    import torch.distributed as dist

    if not is_initialized():
        return
    if dist.get_world_size() > 1:
        dist.barrier()
    path = Path(shared_memory_buffer_path(dist.get_rank()))
    path.unlink(missing_ok=True)
    atexit.register(path.unlink, missing_ok=True)


def free_port(attempts: int = 64) -> int:
    """A TCP port free on loopback right now (for MASTER_PORT of a job on this machine).

    Taken below the kernel's ephemeral range, where no outgoing connection (mpirun's daemons, gloo's own
    sockets) can be handed the port between this check and the job binding it; a port the kernel picks
    itself could be (EADDRINUSE at the rendezvous). Falls back to the kernel's pick if none is free there.
    """
    low = _ephemeral_port_low()
    first = max(1024, low - 16384)
    chooser = random.SystemRandom()  # not the seeded streams: a port is no part of a plan
    for _ in range(attempts if low - first > 0 else 0):
        port = chooser.randrange(first, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ephemeral_port_low() -> int:
    """The first port of the range the kernel hands to outgoing connections (Linux; 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def all_gather_object(value: Any, group: Any = None) -> list[Any]:
    """Every rank's value in rank order, over `group` (all ranks by default; just [value] without a process group)."""
    import torch.distributed as dist

    if not is_initialized() or dist.get_world_size(group=group) == 1:
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size(group=group)
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def sum_over_ranks(values: Any, group: Any = None) -> Any:
    """Element-wise sum of an int64 or float64 array over the ranks of `group` (all ranks by default); collective."""
    import numpy as np
    import torch
    import torch.distributed as dist

    array = np.asarray(values)
    array = array.astype(np.float64 if np.issubdtype(array.dtype, np.floating) else np.int64, copy=False)
    if not is_initialized() or dist.get_world_size(group=group) == 1:
        return array
    tensor = torch.from_numpy(array.copy())
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor.numpy()


def collectives(group: Any = None) -> Collectives:
    """This process's rank and world size in `group` (all ranks by default), with its gather and sum.

    What the stages are given instead of asking torch.distributed themselves.
    Gather and sum span `group`: with model parallelism, pass the data-parallel group.
    """
    import functools

    import torch.distributed as dist

    if not is_initialized():
        return LOCAL
    return Collectives(rank=int(dist.get_rank(group=group)), world_size=int(dist.get_world_size(group=group)),
                       gather=functools.partial(all_gather_object, group=group),
                       sum=functools.partial(sum_over_ranks, group=group))


def check_agreement(value: Any, what: str) -> None:
    """Raise on every rank, naming the ranks that differ from rank 0, if values disagree (all ranks)."""
    collectives().check_agreement(value, what)


def agree_on_error(error: Optional[BaseException], what: str) -> None:
    """Collective check over all ranks: if any rank hit an error, raise a clear one on every rank."""
    collectives().agree_on_error(error, what)


SHARED_CHECK_PREFIX = ".ds_cluster_shared_check."


class SharedPathError(RuntimeError):
    """A path that every rank must see (through a shared filesystem) is not the same on every rank."""


def _write_shared_token(folder: Path) -> tuple[Optional[str], Optional[str]]:
    """Rank 0's half: a token file with unique contents in `folder`; (file name, None) or (None, reason)."""
    if not folder.is_dir():
        return None, "it does not exist or is not a directory"
    token = uuid.uuid4().hex
    name = f"{SHARED_CHECK_PREFIX}{token}"
    try:
        (folder / name).write_text(token, encoding="utf-8")
    except OSError as err:
        return None, f"cannot write a file there ({err.strerror or err})"
    return name, None


def _sees_shared_token(path: Path, grace_s: float) -> bool:
    # A network filesystem may take a moment to show another host's new file (attribute caching).
    deadline = time.monotonic() + grace_s
    while True:
        try:
            if path.read_text(encoding="utf-8") == path.name[len(SHARED_CHECK_PREFIX):]:
                return True
        except OSError:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)


def check_shared_path(path: Union[str, os.PathLike], what: str, grace_s: float = 5.0,
                      ranks: Optional[Collectives] = None) -> None:
    """Collective: check that every rank sees the same folder `path`, or raise on every rank.

    Ranks on different hosts share the analysis directory, the feature store and
    checkpoints through a shared filesystem. Rank 0 writes a file with a unique
    token into `path`, every rank reads it back, and the ranks compare what they
    saw with `all_gather_object`: a rank that cannot see the file (a local disk,
    a different mount) fails the job on every rank with the ranks, their hosts
    and the path named, instead of a hang or a wrong result later. The token is
    removed afterwards. `ranks`: the ranks that share it (default: every rank). Without a process group (or
    with one rank) this does nothing.
    """
    ranks = ranks if ranks is not None else collectives()
    if ranks.world_size == 1:
        return
    folder, rank = Path(path), ranks.rank
    token_name, write_error = _write_shared_token(folder) if rank == 0 else (None, None)
    try:
        # The gather is the barrier: nobody looks for the token before rank 0 has written it.
        token_name, write_error, writer_host = ranks.gather((token_name, write_error, socket.gethostname()))[0]
        if write_error is not None:
            raise SharedPathError(
                f"the {what} {folder} must be a folder on a filesystem shared by every rank, but on rank 0 "
                f"(host {writer_host}) {write_error}"
            )
        sees = _sees_shared_token(folder / token_name, grace_s)
        views = ranks.gather((sees, socket.gethostname()))
    finally:
        if rank == 0 and token_name is not None:
            (folder / token_name).unlink(missing_ok=True)
    blind = [other for other, (sees, _) in enumerate(views) if not sees]
    if blind:
        hosts = ", ".join(f"rank {other} on host {views[other][1]}" for other in blind)
        raise SharedPathError(
            f"the {what} {folder} is not shared between the ranks: {hosts} cannot see the file rank 0 "
            f"(host {views[0][1]}) wrote there. Ranks on different hosts must see the same {what} "
            "through a shared filesystem (NFS, Lustre, ...) at the same path; see launch/MULTINODE.md"
        )


def shutdown() -> None:
    """Barrier and destroy the process group, so gloo does not abort at exit under MPI."""
    import torch.distributed as dist

    gc.collect()
    if is_initialized():
        dist.barrier()
        dist.destroy_process_group()
