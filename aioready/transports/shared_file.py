"""Shared memory among the ranks of one host, made collectively: the doorbell's "parked" bytes
(doorbell.py) and the notice board's rings (notice_board.py).

A file of /dev/shm that local rank 0 creates and unlinks once every local rank mapped it, not an
MPI window: freeing a window waits for every rank, and a rank that fails must be able to close
its transport while its peers are still running. Every rank of the job must be on this host
(each peer can then reach each other through the mapping), and every local rank must map it
(and pass its own `setup`), or none uses it.
"""

from __future__ import annotations

import mmap
import os
from typing import Any, Callable

import numpy as np

__all__ = ["job_name", "map_on_every_rank", "unmap"]


def job_name(world: Any) -> str:
    """A name of this job shared by its ranks (random; numpy over MPI, nothing pickled)."""
    token = np.frombuffer(os.urandom(8), np.uint8).copy()
    world.Bcast(token, root=0)
    return token.tobytes().hex()


def map_on_every_rank(MPI: Any, world: Any, path: str, size: Callable[[int], int],
                      setup: Callable[[], bool] | None = None
                      ) -> tuple[mmap.mmap, dict[int, int]] | None:
    """The file at `path` of `size(local ranks)` bytes (zeros) mapped on every rank, with each
    world rank's index among the local ranks; None on every rank unless all of them are on this
    host, mapped it and passed `setup` (called after the mapping; False or OSError: failed)."""
    local = world.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        if local.Get_size() != world.Get_size():
            return None
        return _map(MPI, local, world.Get_rank(), path, max(size(local.Get_size()), 1), setup)
    finally:
        local.Free()


def _map(MPI: Any, local: Any, me: int, path: str, nbytes: int,
         setup: Callable[[], bool] | None) -> tuple[mmap.mmap, dict[int, int]] | None:
    first = local.Get_rank() == 0
    ok = np.zeros(1, np.int32)
    try:
        if first:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, nbytes)
            os.close(fd)
        ok[0] = 1
    except OSError:
        pass
    local.Bcast(ok, root=0)
    mapped = None
    if ok[0]:
        try:
            fd = os.open(path, os.O_RDWR)
            try:
                mapped = mmap.mmap(fd, nbytes)
            finally:
                os.close(fd)
            ok[0] = setup is None or setup()
        except (OSError, ValueError):  # ValueError: the file is shorter than this rank maps
            ok[0] = 0
    every = np.zeros(1, np.int32)
    local.Allreduce(ok, every, op=MPI.MIN)  # also: each rank's setup is done before any use
    if first and os.path.exists(path):
        os.unlink(path)  # the mappings keep the bytes; nothing is left behind
    ranks = np.zeros(local.Get_size(), np.int64)
    local.Allgather(np.array([me], np.int64), ranks)
    if not every[0]:
        if mapped is not None:
            mapped.close()
        return None
    assert mapped is not None
    return mapped, {int(w): i for i, w in enumerate(ranks)}


def unmap(mapped: mmap.mmap | None) -> None:
    """Close a mapping of `map_on_every_rank` (local). A view of it still alive somewhere
    keeps it mapped until the collector frees that view: closing then is not an error."""
    if mapped is None:
        return
    try:
        mapped.close()
    except BufferError:
        pass
