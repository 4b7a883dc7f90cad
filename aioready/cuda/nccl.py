"""NCCL communicators made with CuPy over an MPI communicator: the thin layer that touches NCCL.

Everything NCCL-specific of the GPU data plane is here, and kept small: the agreement on the
plane is cuda/plane.py, the id broadcast cuda/nccl_bootstrap.py, the per-peer ordering and the
payload framing transports/ordered.py and transports/device_payloads.py; those run on CPUs in
the tests. This layer has never run on a GPU (docs/async.md "The GPU data plane").

Shape, and why:

- One *one-way* communicator per ordered pair of ranks (`src -> dst`, 2 members: the sender is
  NCCL rank 0), each with a CUDA stream of its own at both ends. `ncclSend`/`ncclRecv` block on
  the GPU until the peer's call is there, so a send and a receive between two ranks on one
  stream (or one communicator) can wait on each other forever when both ranks send first. On a
  one-way communicator a rank only sends or only receives, both ends issue their calls in the
  same order (the sender in send order, the receiver in header order, transports/ordered.py), so
  every call waits only for calls issued before it: no cycle. The cost is 2 (N-1) small
  communicators per rank, made once.
- One communicator over all ranks for collectives (`all_reduce_`), enqueued on the caller's
  stream, like any kernel.
- Communicators are made in one global order (the index of their id), so the blocking
  `ncclCommInitRank` of every rank meets its peers' and none waits on one made later.
- Completion: an event recorded after each transfer on its stream, awaited through the
  completion engine (cuda/events.py), never a host synchronize. A sent buffer is marked
  `record_stream` for the transfer's stream, so the allocator does not reuse it early.

CuPy API used (cupy.cuda.nccl): `get_unique_id()`, `NcclCommunicator(ndev, commId, rank)`,
`.send/.recv(ptr, count, datatype, peer, stream)`, `.allReduce(sendbuf, recvbuf, count,
datatype, op, stream)`, `.destroy()`, `get_version()`, `available`; pointers and streams are the
ints of torch's `data_ptr()` and `Stream.cuda_stream`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import socket
import warnings
from typing import Any

import numpy as np

from ..errors import ConfigError
from . import plane as planes
from .events import CUDAEventSource
from .nccl_bootstrap import broadcast_ids, id_from_bytes, id_to_bytes, num_ids, pair_index

__all__ = ["nccl_missing", "NcclPlane", "MIN_NCCL_VERSION", "nccl_dtype", "open_gpu_plane",
           "agree_gpu_plane", "gpu_identity"]

log = logging.getLogger("aioready.cuda")

MIN_NCCL_VERSION = 2700  # ncclSend/ncclRecv; codes are 1000*major+100*minor before 2.9


def nccl_missing() -> str | None:
    """None when CuPy with a usable NCCL imports here and torch sees a GPU, else what is
    missing, in words."""
    import torch
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            from cupy.cuda import nccl
    except Exception as exc:  # ImportError, or a CUDA error while CuPy loads
        return f"import cupy.cuda.nccl failed: {type(exc).__name__}: {exc}"
    if not getattr(nccl, "available", False):
        why = "; ".join(str(w.message) for w in caught)[:300] or "libnccl was not found"
        return f"CuPy was built without a loadable NCCL ({why})"
    try:
        version = int(nccl.get_version())
    except Exception as exc:
        return f"ncclGetVersion failed: {exc}"
    if version < MIN_NCCL_VERSION:
        return f"NCCL version code {version} has no send/recv (needs 2.7 or newer)"
    return None


def nccl_dtype(nccl: Any, dtype: Any) -> int:
    """The NCCL datatype of a torch dtype, for collectives (point-to-point moves bytes)."""
    import torch
    names = {torch.float32: "NCCL_FLOAT32", torch.float64: "NCCL_FLOAT64",
             torch.float16: "NCCL_FLOAT16", torch.bfloat16: "NCCL_BFLOAT16",
             torch.int32: "NCCL_INT32", torch.int64: "NCCL_INT64", torch.uint8: "NCCL_UINT8",
             torch.int8: "NCCL_INT8"}
    code = getattr(nccl, names.get(dtype, ""), None)
    if code is None:
        raise ConfigError("an NCCL all-reduce cannot sum this dtype", expected=sorted(
            str(d) for d in names), got=str(dtype), fix="cast it, or use the staged plane")
    return int(code)


def gpu_identity(device: Any) -> int:
    """A positive int64 naming (host, GPU UUID) of a CUDA device, for the agreement table."""
    import torch
    props = torch.cuda.get_device_properties(torch.device(device))
    uuid = str(getattr(props, "uuid", "")) or f"{getattr(props, 'pci_bus_id', '')}{props.name}"
    digest = hashlib.sha256(f"{socket.gethostname()}|{uuid}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1 or 1


def agree_gpu_plane(comm: Any, *, cuda_aware: bool | None, device: Any = None,
                    explicit: str | None = None, what: str = "GPU data plane"
                    ) -> planes.PlaneChoice:
    """Collective over `comm`: every rank's row gathered, the same choice settled and logged
    on each (cuda/plane.py). A rank without a CUDA `device` cannot use NCCL."""
    me, size = comm.Get_rank(), comm.Get_size()
    cuda_device = device is not None and str(device).startswith("cuda")
    missing: str | None = "no CUDA device given" if not cuda_device else None
    if missing is None:
        missing = nccl_missing()
    wish = planes.choose_gpu_plane(explicit, cuda_aware=cuda_aware, nccl_missing=missing)
    gpu = gpu_identity(device) if missing is None else 0
    row = np.array(planes.rank_row(wish, can_nccl=missing is None, gpu=gpu), dtype=np.int64)
    rows = np.empty((size, row.size), dtype=np.int64)
    comm.Allgather(row, rows)
    table = [planes.RankPlane(int(a), bool(c), int(g), bool(w)) for a, c, g, w in rows]
    choice = planes.settle_gpu_plane(me, wish, table, missing)
    log.info("rank %d/%d: %s %s (%s: %s)", me, size, what, choice.plane, choice.how,
             choice.reason)
    shared = planes.shared_gpu(table)
    return choice._replace(shared=shared) if shared else choice


def open_gpu_plane(comm: Any, *, cuda_aware: bool | None, device: Any = None,
                   explicit: Any = None, p2p: bool = True) -> tuple[planes.PlaneChoice, Any]:
    """Collective over `comm`: agree on the plane (`agree_gpu_plane`), and make the NCCL plane
    if chosen (with one-way communicators unless `p2p` is False). Returns (choice, NcclPlane or
    None). `explicit` may also be a byte plane object (transports/device_payloads.py's
    BytePlane, e.g. aioready.testing.mpi_plane's): used as given, plane "custom", not agreed.
    """
    if explicit is not None and not isinstance(explicit, str):
        choice = planes.PlaneChoice("custom", "argument", type(explicit).__name__)
        log.info("rank %d/%d: GPU data plane custom (%s)", comm.Get_rank(), comm.Get_size(),
                 choice.reason)
        return choice, explicit
    choice = agree_gpu_plane(comm, cuda_aware=cuda_aware, device=device, explicit=explicit)
    if choice.plane != "nccl":
        return choice, None
    return choice, NcclPlane(comm, device, p2p=p2p, shared=choice.shared)


class NcclPlane:
    """The NCCL communicators of one MPI communicator, on one CUDA device; see the docstring.

    Collective: every rank of `comm` constructs it at the same point. `p2p=False` makes only the
    communicator over all ranks (a TP or DP group needs no point-to-point).
    """

    def __init__(self, comm: Any, device: Any, *, p2p: bool = True,
                 shared: tuple[int, int] | None = None, wake: str = "poll") -> None:
        import cupy
        import torch
        from cupy.cuda import nccl
        self._torch, self._nccl = torch, nccl
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        device = torch.device(device)
        self.device = torch.device("cuda", device.index if device.index is not None
                                   else torch.cuda.current_device())
        self.wake = wake
        count = num_ids(self.size) if p2p else 1
        ids = broadcast_ids(comm, count, lambda: id_to_bytes(nccl.get_unique_id()))
        self._sends: dict[int, tuple[Any, Any]] = {}  # dest -> (communicator, stream)
        self._recvs: dict[int, tuple[Any, Any]] = {}  # src -> (communicator, stream)
        self._source: CUDAEventSource | None = None
        with cupy.cuda.Device(self.device.index):  # ncclCommInitRank takes the current device
            self.world = self._make(ids[0], self.size, self.rank, shared)
            for src, dst in self._pairs() if p2p else ():
                made = self._make(ids[pair_index(src, dst, self.size)], 2, int(dst == self.rank),
                                  shared)
                pair = (made, torch.cuda.Stream(self.device))
                if src == self.rank:
                    self._sends[dst] = pair
                else:
                    self._recvs[src] = pair

    def _pairs(self) -> list[tuple[int, int]]:
        """This rank's one-way pairs, in the global order of their ids (see the docstring)."""
        n, me = self.size, self.rank
        mine = [(a, b) for a in range(n) for b in range(n) if a != b and me in (a, b)]
        return sorted(mine, key=lambda p: pair_index(p[0], p[1], n))

    def _make(self, uid: bytes, ndev: int, rank: int, shared: tuple[int, int] | None) -> Any:
        try:
            return self._nccl.NcclCommunicator(ndev, id_from_bytes(uid), rank)
        except Exception as exc:
            note = (f"; ranks {shared[0]} and {shared[1]} share a GPU, which NCCL 2.5 and newer "
                    "refuses ('Duplicate GPU detected')" if shared else "")
            raise ConfigError("making an NCCL communicator failed", rank=self.rank,
                              expected=f"ncclCommInitRank of {ndev} ranks on {self.device}",
                              got=f"{type(exc).__name__}: {exc}{note}",
                              fix=planes.NCCL_FIX) from exc

    # -- point-to-point ---------------------------------------------------------------------
    def send(self, dest: int, t: Any) -> asyncio.Future[None]:
        """Send the bytes of CUDA tensor `t` to `dest` after the work queued on the current
        stream (its producer); the future resolves once NCCL is done with the buffer."""
        torch = self._torch
        comm, stream = self._one_way(self._sends, dest, "to")
        buf = t.detach().contiguous().reshape(-1).view(torch.uint8)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        comm.send(buf.data_ptr(), buf.numel(), self._nccl.NCCL_UINT8, 1, stream.cuda_stream)
        buf.record_stream(stream)
        return self.completion(stream)

    def recv(self, src: int, nbytes: int) -> tuple[Any, asyncio.Future[None]]:
        """A uint8 CUDA tensor of `nbytes` that NCCL fills from `src`, and its completion."""
        torch = self._torch
        comm, stream = self._one_way(self._recvs, src, "from")
        with torch.cuda.stream(stream):
            raw = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        comm.recv(raw.data_ptr(), nbytes, self._nccl.NCCL_UINT8, 0, stream.cuda_stream)
        raw.record_stream(torch.cuda.current_stream(self.device))  # read there once it arrived
        return raw, self.completion(stream)

    def _one_way(self, table: dict[int, tuple[Any, Any]], peer: int, way: str
                 ) -> tuple[Any, Any]:
        pair = table.get(peer)
        if pair is None:
            raise ConfigError(f"no NCCL communicator {way} rank {peer}", rank=self.rank,
                              expected=f"a peer in 0..{self.size - 1} other than {self.rank}",
                              got=peer)
        return pair

    def completion(self, stream: Any) -> asyncio.Future[None]:
        """A future the completion engine resolves once the work queued on `stream` so far
        has completed (an event recorded now)."""
        loop = asyncio.get_running_loop()
        if self._source is None or self._source.loop is not loop:
            self._source = CUDAEventSource(loop, wake=self.wake)
        done = self._torch.cuda.Event(blocking=self.wake in ("thread", "hybrid"))
        done.record(stream)
        return self._source.add(done, stream.cuda_stream, device=self.device)

    # -- collectives ------------------------------------------------------------------------
    def all_reduce_(self, t: Any, stream: Any = None) -> None:
        """Sum contiguous CUDA tensor `t` in place over all ranks, enqueued on `stream` (the
        current one by default): later work on that stream sees the sum, the host never waits."""
        torch = self._torch
        if not t.is_contiguous():
            raise ConfigError("an NCCL all-reduce needs a contiguous tensor",
                              expected="contiguous", got=f"strides {tuple(t.stride())}")
        stream = stream if stream is not None else torch.cuda.current_stream(self.device)
        ptr = t.data_ptr()
        self.world.allReduce(ptr, ptr, t.numel(), nccl_dtype(self._nccl, t.dtype),
                             self._nccl.NCCL_SUM, stream.cuda_stream)

    def close(self) -> None:
        """Destroy the communicators (after the caller awaited every transfer)."""
        if self._source is not None:
            self._source.close()
            self._source = None
        for comm, _ in [*self._sends.values(), *self._recvs.values(), (self.world, None)]:
            comm.destroy()
        self._sends.clear()
        self._recvs.clear()

    def __repr__(self) -> str:
        return (f"<NcclPlane rank={self.rank}/{self.size} device={self.device} "
                f"one-way={len(self._sends) + len(self._recvs)}>")
