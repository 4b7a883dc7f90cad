"""An ordered byte plane over MPI on CPUs: NCCL's matching rule across processes, no GPU.

`MPIBytePlane(comm)` implements transports/device_payloads.py's BytePlane with point-to-point on
a duplicate of `comm` and one tag, so a peer's transfers match in posting order alone (MPI's
non-overtaking rule), as NCCL's do; a receive whose count differs from its send's fails with a
ProtocolError (NCCL would hang or corrupt memory). Passed as `MPITransport(comm,
gpu_plane=MPIBytePlane(comm))`, every payload that is not inline goes through it, so the
transport's NCCL path (flagged headers, per-peer order, posting receives by header) runs end to
end under mpiexec on CPUs. It is a completion source of the loop's ProgressEngine.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from ..errors import ProtocolError
from ..progress import ProgressEngine
from ..transports.tensor_bytes import host_bytes, torch_module

__all__ = ["MPIBytePlane"]

_TAG = 7


class MPIBytePlane:
    """The BytePlane protocol over MPI with one tag; collective to construct (a Dup)."""

    def __init__(self, comm: Any) -> None:
        from mpi4py import MPI
        self._MPI = MPI
        self._comm = comm.Dup()
        self.rank = comm.Get_rank()
        self.device = torch_module().device("cpu")
        self._pending: list[tuple[Any, asyncio.Future[None], Any, int, Any]] = []
        self._engine: ProgressEngine | None = None
        self.num_sent = self.num_received = 0

    def send(self, dest: int, t: Any) -> asyncio.Future[None]:
        buf = host_bytes(t)
        return self._track(self._comm.Isend(buf, dest, _TAG), buf, -1)

    def recv(self, src: int, nbytes: int) -> tuple[Any, asyncio.Future[None]]:
        buf = np.empty(nbytes, np.uint8)
        fut = self._track(self._comm.Irecv(buf, src, _TAG), buf, nbytes)
        return torch_module().from_numpy(buf), fut

    def _track(self, req: Any, buf: Any, nbytes: int) -> asyncio.Future[None]:
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((req, fut, buf, nbytes, self._MPI.Status()))
        if self._engine is None:
            self._engine = ProgressEngine.for_loop()
            self._engine.add_source(self)
        self._engine.kick()
        return fut

    # -- CompletionSource -------------------------------------------------------------------
    def poll(self) -> int:
        keep, n = [], 0
        for entry in self._pending:
            req, fut, _, nbytes, status = entry
            try:
                if not req.Test(status):
                    keep.append(entry)
                    continue
                got = status.Get_count(self._MPI.BYTE) if nbytes >= 0 else nbytes
                error = None if got == nbytes else f"{got} bytes"
            except self._MPI.Exception as exc:  # a longer send: truncated
                error = str(exc)
            n += 1
            if error is None:
                self.num_sent += nbytes < 0
                self.num_received += nbytes >= 0
                fut.set_result(None)
            else:
                fut.set_exception(ProtocolError("a transfer matched a receive of another size",
                                                rank=self.rank, expected=f"{nbytes} bytes",
                                                got=error))
        self._pending = keep
        return n

    def num_pending(self) -> int:
        return len(self._pending)

    def wants_hot(self) -> bool:
        return False  # parked polls suffice for a test plane; spinning starved shared cores

    def close(self) -> None:
        if self._engine is not None:
            self._engine.remove_source(self)
            self._engine = None
        if self._comm != self._MPI.COMM_NULL:
            self._comm.Free()
