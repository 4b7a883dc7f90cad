"""Results between the bench harness's ranks as JSON in byte buffers, never as pickles.

mpi4py's lowercase collectives (`gather`, `bcast`, `reduce`) and torch.distributed's `*_object`
ones pickle what they carry, and the receiving rank unpickles bytes another process sent: what
the project never does, in the bench's harness too. A rank's record here is numbers, None and
lists of them, which JSON carries exactly (floats round-trip through their repr; NaN and inf as
JSON's extensions), so each collective is a length exchange and one byte buffer exchange.
Tuples come back as lists.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

__all__ = ["gather_json", "bcast_int", "reduce_sum_float", "all_gather_json_torch"]


def _encode(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def gather_json(comm: Any, obj: Any, root: int = 0) -> list[Any] | None:
    """Every rank's `obj` on `root`, in rank order (None on the others): mpi4py's buffer
    Gather and Gatherv, no pickle."""
    from mpi4py import MPI
    data = np.frombuffer(_encode(obj), dtype=np.uint8)
    rank, size = comm.Get_rank(), comm.Get_size()
    lengths = np.zeros(size, dtype=np.int64) if rank == root else None
    comm.Gather(np.array([data.size], dtype=np.int64), lengths, root=root)
    if rank != root:
        comm.Gatherv(data, None, root=root)
        return None
    assert lengths is not None
    counts = [int(n) for n in lengths]
    offsets = [sum(counts[:i]) for i in range(size)]
    buf = np.empty(sum(counts), dtype=np.uint8)
    comm.Gatherv(data, [buf, counts, offsets, MPI.BYTE], root=root)
    return [json.loads(buf[o:o + n].tobytes()) for o, n in zip(offsets, counts)]


def bcast_int(comm: Any, value: int | None, root: int = 0) -> int:
    """`root`'s integer on every rank (the others pass None): a buffer Bcast, no pickle."""
    buf = np.array([value if comm.Get_rank() == root else 0], dtype=np.int64)
    comm.Bcast(buf, root=root)
    return int(buf[0])


def reduce_sum_float(comm: Any, value: float, root: int = 0) -> float | None:
    """The sum of every rank's float on `root` (None on the others): a buffer Reduce."""
    from mpi4py import MPI
    recv = np.zeros(1, dtype=np.float64) if comm.Get_rank() == root else None
    comm.Reduce(np.array([value], dtype=np.float64), recv, op=MPI.SUM, root=root)
    return None if recv is None else float(recv[0])


def all_gather_json_torch(obj: Any) -> list[Any]:
    """Every rank's `obj` on every rank, in rank order, over torch.distributed's default group:
    two tensor all_gathers (the lengths, then the bytes padded to the longest), no pickle."""
    import torch
    import torch.distributed as dist
    data = torch.frombuffer(bytearray(_encode(obj)), dtype=torch.uint8)
    size = dist.get_world_size()
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(lengths, torch.tensor([data.numel()], dtype=torch.int64))
    longest = max(int(n) for n in lengths)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[:data.numel()] = data
    every = [torch.zeros(longest, dtype=torch.uint8) for _ in range(size)]
    dist.all_gather(every, padded)
    return [json.loads(b[:int(n)].numpy().tobytes()) for b, n in zip(every, lengths)]
