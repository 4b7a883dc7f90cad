"""Data-parallel gradient means of CUDA tensors in an mpirun job, summed over NCCL (CuPy).

MPIGradReducer (reducer.py) stages CUDA gradients through host memory, one synchronous copy per
bucket. On the ``nccl`` GPU plane (docs/async.md "The GPU data plane") `NcclGradReducer` keeps
them on the device: each bucket is packed on the device, summed by an NCCL all-reduce on the
chunk's own stream (after the work queued on the current stream), and unpacked once its CUDA
event completed, awaited through the completion engine, never a synchronize on the loop thread.

One NCCL communicator per chunk, made over the chunk's duplicate of the DP communicator, for the
reason reducer.py gives for the duplicates: replicas may finish their chunks in different orders
in ready mode, and collectives of one communicator match by issue order. The loss mean and any
CPU bucket stay on MPI. `mpi_grad_reducer` agrees on the plane over the DP group (collective)
and returns this reducer or MPIGradReducer. The NCCL path has not run on a GPU yet.
"""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Any, Sequence

from ..cuda.mpi import cuda_mpi_support
from ..cuda.nccl import NcclPlane, agree_gpu_plane
from ..errors import AioreadyError, InternalError
from .reducer import MPIGradReducer, flat_grads

__all__ = ["NcclGradReducer", "mpi_grad_reducer"]


class NcclGradReducer(MPIGradReducer):
    """MPIGradReducer whose CUDA buckets are summed over NCCL, one communicator per chunk.

    Collective to construct (the duplicates, then the NCCL communicators in chunk order)."""

    def __init__(self, comm: Any, params: Sequence[Sequence[Any]], *, device: Any,
                 bucket_bytes: int | None = None, shared: tuple[int, int] | None = None
                 ) -> None:
        import torch
        super().__init__(comm, params, bucket_bytes=bucket_bytes)
        self._torch = torch
        self._planes = [NcclPlane(c, device, p2p=False, shared=shared) for c in self._comms]
        self._streams = [torch.cuda.Stream(p.device) for p in self._planes]
        self._waiting: list[asyncio.Future[None]] = []

    def _reduce_bucket(self, chunk: int, bucket: list[Any]) -> None:
        if not bucket[0].is_cuda:
            super()._reduce_bucket(chunk, bucket)
            return
        plane, stream = self._planes[chunk], self._streams[chunk]
        flat = flat_grads(bucket, bucket[0].device)  # on the current stream
        stream.wait_stream(self._torch.cuda.current_stream(plane.device))
        plane.all_reduce_(flat, stream)
        flat.record_stream(stream)
        self.num_buckets += 1
        self.num_bytes += flat.numel() * flat.element_size()
        fut = plane.completion(stream)
        fut.add_done_callback(partial(self._summed, chunk, bucket, flat))
        self._waiting.append(fut)

    def _summed(self, chunk: int, bucket: list[Any], flat: Any,
                fut: asyncio.Future[None]) -> None:
        if not fut.cancelled() and fut.exception() is None:
            self._unpack(chunk, bucket, flat)  # the sum is there: its event completed

    async def wait_reduced(self) -> None:
        waiting, self._waiting = self._waiting, []
        try:
            await asyncio.gather(*waiting)
        except AioreadyError:
            raise
        except Exception as exc:
            raise InternalError(f"a data-parallel NCCL all-reduce failed: {exc}",
                                rank=self.rank) from exc
        await super().wait_reduced()

    def close(self) -> None:
        super().close()
        for plane in self._planes:
            plane.close()
        self._planes = []

    def __repr__(self) -> str:
        return (f"<NcclGradReducer member {self.rank}/{self._size} chunks={len(self._comms)} "
                f"pending={len(self._waiting)}>")


def mpi_grad_reducer(comm: Any, params: Sequence[Sequence[Any]], *,
                     gpu_plane: str | None = None, bucket_bytes: int | None = None
                     ) -> MPIGradReducer:
    """The DP reducer of an mpirun job over `comm`: NCCL for CUDA gradients where the ranks
    agree on the nccl plane, else MPI (collective: every member calls it at the same point)."""
    first = next((p for ps in params for p in ps if p.requires_grad), None)
    device = first.device if first is not None and first.is_cuda else None
    choice = agree_gpu_plane(comm, cuda_aware=cuda_mpi_support(comm).aware, device=device,
                             explicit=gpu_plane, what="DP gradient plane")
    if choice.plane == "nccl":
        return NcclGradReducer(comm, params, device=device, bucket_bytes=bucket_bytes,
                               shared=choice.shared)
    return MPIGradReducer(comm, params, bucket_bytes=bucket_bytes)
