"""Tagged TP all-reduce of CUDA tensors in an mpirun job: tags over MPI, sums over NCCL (CuPy).

`MPITPComm` sums numpy arrays, so a TP layer whose activations live on a GPU could not use it.
`MPIDeviceTPComm` adds `allreduce_tensor_` (which tp/layers.py prefers when a comm has it):

- on the ``nccl`` GPU plane (docs/async.md "The GPU data plane"), the sum is an NCCL all-reduce
  on the tensor's device pointer, enqueued on the caller's stream (the task's stream, in the
  compute thread), through one NcclPlane communicator over the TP group (no point-to-point);
- otherwise the tensor goes to the host, through MPI, and back (a copy the compute thread waits
  for: the loop thread never does).

The tags keep their MPI path (Note [tagged collectives]): with verify="exchange" the members'
tags are gathered over MPI before every sum, under the deadline, so members in different tasks
fail with a CoordinationError before any NCCL call; "inline" sums the key and its square in front
of the buffer and reads them back (float64 only). The NCCL sum itself has no deadline: a member
that passed the tag check and then died is caught by the peer monitor, not here.

`mpi_tp_comm(comm, device=...)` agrees on the plane over the TP group (collective) and returns
this comm; the NCCL code path has not run on a GPU yet.
"""

from __future__ import annotations

import zlib
from typing import Any

from ..cuda.mpi import cuda_mpi_support
from ..cuda.nccl import open_gpu_plane
from ..errors import ConfigError
from .collectives import DEFAULT_TIMEOUT, MPITPComm

__all__ = ["MPIDeviceTPComm", "mpi_tp_comm"]


class MPIDeviceTPComm(MPITPComm):
    """MPITPComm whose `allreduce_tensor_` sums CUDA tensors over NCCL (or the host)."""

    def __init__(self, comm: Any, *, plane: Any = None, verify: str = "exchange",
                 timeout: float = DEFAULT_TIMEOUT) -> None:
        super().__init__(comm, verify=verify, timeout=timeout)
        self.plane = plane  # an NcclPlane over `comm`, or None: through the host

    def allreduce_tensor_(self, t: Any) -> None:
        """Sum a contiguous tensor over the group in place, on its own device."""
        if not t.is_cuda:
            self.allreduce_(t.numpy())
            return
        if self.plane is None:
            host = t.cpu()  # waits in the compute thread, never on the loop
            self.allreduce_(host.numpy())
            t.copy_(host)
            return
        if self._size == 1:
            return
        self.num_collectives += 1
        if self.verify == "inline":
            self._inline(t)
            return
        if self.verify == "exchange":
            self._exchange_tags()
        self.plane.all_reduce_(t)

    def _inline(self, t: Any) -> None:
        import torch
        if t.dtype != torch.float64:  # k*k must be exact: 48 bits
            raise ConfigError("verify='inline' needs float64 tensors", expected="float64",
                              got=str(t.dtype), fix="use verify='exchange'")
        key = float((zlib.crc32(self._tag().tobytes()) & 0xFFFFFF) + 1)
        buf = torch.cat([t.new_tensor([key, key * key]), t.reshape(-1)])
        self.plane.all_reduce_(buf)
        sum_k, sum_kk = buf[:2].tolist()  # the compute thread waits for the sum
        self._check_inline(sum_k, sum_kk, key)
        t.view(-1).copy_(buf[2:])

    def close(self) -> None:
        if self.plane is not None:
            self.plane.close()
            self.plane = None


def mpi_tp_comm(comm: Any, *, device: Any = None, gpu_plane: str | None = None,
                verify: str = "exchange", timeout: float = DEFAULT_TIMEOUT) -> MPIDeviceTPComm:
    """The TP comm of an mpirun job over `comm` (collective: the ranks agree on the plane)."""
    _, plane = open_gpu_plane(comm, cuda_aware=cuda_mpi_support(comm).aware, device=device,
                              explicit=gpu_plane, p2p=False)
    return MPIDeviceTPComm(comm, plane=plane, verify=verify, timeout=timeout)
