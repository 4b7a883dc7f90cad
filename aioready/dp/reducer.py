"""Gradient reduction over a data-parallel group, started per stage as soon as it is final.

A stage's gradients are final once its last backward piece of the step ended (the last W with
split backward, else the last B): the runtime calls `reduce_nowait(chunk)` right then
(`RankRuntime.grads_ready`), so the all-reduce of one chunk overlaps the backward work of
the others and the bubbles of the schedule, which is what Megatron's `overlap_grad_reduce` does
by hand with hooks. The reduction is a mean (each replica's loss is already a mean over its
microbatches), so the result equals one model on the whole batch.

Why buckets: one collective per parameter pays the latency per parameter, one per stage delays
the first byte until the whole stage is packed; buckets of `bucket_bytes` (4 MiB by default,
`AIOREADY_DP_BUCKET_MB`) are the usual middle. Parameters are packed into a flat buffer per
bucket on the loop thread (a memcpy); half-precision gradients are reduced in float32.

Why one communicator per chunk: collectives on one communicator match by issue order, and in
ready mode two replicas may finish their chunks in different orders. A duplicate per chunk makes
the order between chunks free; inside a chunk the buckets are issued in a fixed order.

`Iallreduce` requests are completed by the loop's ProgressEngine (through `requests.Requests`, a
CompletionSource), never by a blocking wait on the loop thread. CUDA gradients are staged
through host memory here (one synchronous copy per bucket); nccl_reducer.py sums them on the
device over NCCL where the ranks agree on the nccl GPU plane.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np

from ..errors import ConfigError

__all__ = ["GradReducer", "BucketedReducer", "MPIGradReducer", "ReduceStatistics",
           "DEFAULT_BUCKET_BYTES", "resolve_bucket_bytes", "plan_buckets", "flat_grads"]

DEFAULT_BUCKET_BYTES = 4 << 20


def resolve_bucket_bytes(value: int | None = None) -> int:
    """The explicit value, else AIOREADY_DP_BUCKET_MB, else 4 MiB."""
    if value is None:
        env = os.environ.get("AIOREADY_DP_BUCKET_MB")
        if env is None:
            return DEFAULT_BUCKET_BYTES
        try:
            value = int(float(env) * (1 << 20))
        except ValueError:
            raise ConfigError("AIOREADY_DP_BUCKET_MB is not a number", expected="MiB",
                              got=repr(env)) from None
    if value < 1:
        raise ConfigError("bucket size must be positive", expected=">= 1 byte", got=value)
    return value


@runtime_checkable
class GradReducer(Protocol):
    """The whole surface a Pipeline needs from a data-parallel reducer, and why.

    - `reduce_nowait(chunk)`: the chunk's gradients of this step are final; start their mean
      over the group and return at once (called on the loop thread by the runtime).
    - `wait_reduced()`: every reduction started so far finished (the step ends after it).
    - `mean(value)`: the mean of a small tensor (the loss) over the group, awaited.
    - `size`: the number of replicas.
    """

    @property
    def size(self) -> int: ...

    def reduce_nowait(self, chunk: int) -> None: ...

    async def wait_reduced(self) -> None: ...

    async def mean(self, value: Any) -> Any: ...


@dataclass(frozen=True, slots=True)
class ReduceStatistics:
    num_buckets: int  # started since the reducer was made
    num_bytes: int  # bytes all-reduced (as sent, after any upcast)
    busy_s: float  # sum over chunks of (last bucket done - chunk started)


def plan_buckets(params: Sequence[Any], bucket_bytes: int) -> list[list[Any]]:
    """Parameters split into buckets of at most `bucket_bytes` (one parameter may exceed it),
    each of one dtype and device, in parameter order."""
    buckets: list[list[Any]] = []
    size = 0
    key = None
    for p in params:
        nbytes = p.numel() * p.element_size()
        k = (p.dtype, p.device)
        if not buckets or k != key or size + nbytes > bucket_bytes and buckets[-1]:
            buckets.append([])
            size = 0
            key = k
        buckets[-1].append(p)
        size += nbytes
    return buckets


class BucketedReducer:
    """What every reducer shares: the buckets of each chunk, unpacking a reduced flat buffer
    into the gradients (divided by the group size), and the statistics."""

    def __init__(self, size: int, rank: int, params: Sequence[Sequence[Any]],
                 bucket_bytes: int | None) -> None:
        self._size = size
        self.rank = rank
        self.bucket_bytes = resolve_bucket_bytes(bucket_bytes)
        self._buckets = [plan_buckets([p for p in ps if p.requires_grad], self.bucket_bytes)
                         for ps in params]
        self._chunk_start: dict[int, float] = {}
        self._chunk_left: dict[int, int] = {}
        self.spans: list[tuple[int, float, float]] = []  # (chunk, start, end), monotonic s
        self.num_buckets = self.num_bytes = 0
        self.busy_s = 0.0

    @property
    def size(self) -> int:
        return self._size

    def statistics(self) -> ReduceStatistics:
        return ReduceStatistics(self.num_buckets, self.num_bytes, self.busy_s)

    def _begin(self, chunk: int) -> list[list[Any]]:
        """The chunk's buckets to reduce now (none with one replica)."""
        buckets = self._buckets[chunk]
        if self._size == 1 or not buckets:
            return []
        self._chunk_start[chunk] = time.monotonic()
        self._chunk_left[chunk] = len(buckets)
        return buckets

    def _unpack(self, chunk: int, bucket: list[Any], flat: Any) -> None:
        """Copy the reduced sum `flat` (a tensor) into the bucket's gradients, as a mean."""
        import torch
        flat.div_(self._size)
        offset = 0
        with torch.no_grad():
            for p in bucket:
                n = p.numel()
                view = flat[offset:offset + n].view_as(p)
                offset += n
                if p.grad is None:
                    p.grad = view.to(device=p.device, dtype=p.dtype, copy=True)
                else:
                    p.grad.copy_(view)
        self._chunk_left[chunk] -= 1
        if not self._chunk_left[chunk]:
            end = time.monotonic()
            self.spans.append((chunk, self._chunk_start[chunk], end))
            self.busy_s += end - self._chunk_start[chunk]


class MPIGradReducer(BucketedReducer):
    """Mean of each chunk's gradients over an mpi4py communicator (the DP group).

    Constructing it duplicates `comm` once per chunk plus once for the loss: a collective call,
    made by every member at the same point of the program.
    """

    def __init__(self, comm: Any, params: Sequence[Sequence[Any]], *,
                 bucket_bytes: int | None = None) -> None:
        from mpi4py import MPI

        from .requests import Requests
        super().__init__(comm.Get_size(), comm.Get_rank(), params, bucket_bytes)
        self._MPI = MPI
        self._comms = [comm.Dup() for _ in params]
        self._loss_comm = comm.Dup()
        self._requests = Requests(f"data-parallel all-reduce (DP member {self.rank} of "
                                  f"{self._size})")

    # -- GradReducer ----------------------------------------------------------------------
    def reduce_nowait(self, chunk: int) -> None:
        for bucket in self._begin(chunk):
            self._reduce_bucket(chunk, bucket)

    def _reduce_bucket(self, chunk: int, bucket: list[Any]) -> None:
        array = _pack(bucket)
        req = self._comms[chunk].Iallreduce(self._MPI.IN_PLACE, array, op=self._MPI.SUM)
        self.num_buckets += 1
        self.num_bytes += array.nbytes
        self._requests.track(req, partial(self._unpack_array, chunk, bucket, array),
                             nbytes=array.nbytes)

    async def wait_reduced(self) -> None:
        await self._requests.wait_all()

    async def mean(self, value: Any) -> Any:
        import torch
        if self._size == 1:
            return value
        array = np.array([float(value)], dtype=np.float64)
        self._requests.track(self._loss_comm.Iallreduce(self._MPI.IN_PLACE, array,
                                                        op=self._MPI.SUM))
        await self._requests.wait_all()
        return torch.tensor(float(array[0]) / self._size,
                            dtype=getattr(value, "dtype", torch.float64))

    def close(self) -> None:
        """Stop polling and free the duplicated communicators (once)."""
        self._requests.close()
        for comm in (*self._comms, self._loss_comm):
            if comm != self._MPI.COMM_NULL:
                comm.Free()

    def _unpack_array(self, chunk: int, bucket: list[Any], array: np.ndarray) -> None:
        import torch
        self._unpack(chunk, bucket, torch.from_numpy(array))

    def __repr__(self) -> str:
        return (f"<MPIGradReducer member {self.rank}/{self._size} chunks={len(self._comms)} "
                f"pending={self._requests.num_pending()}>")


def _pack(bucket: list[Any]) -> np.ndarray:
    """A flat host copy of the bucket's gradients (see `flat_grads`)."""
    return flat_grads(bucket, "cpu").numpy()  # type: ignore[no-any-return]


def flat_grads(bucket: list[Any], device: Any) -> Any:
    """A flat copy of the bucket's gradients on `device` (zeros where a gradient is None), in
    the parameters' dtype, or float32 for half precision (MPI has no standard half type, and
    both backends then sum the same way)."""
    import torch
    p0 = bucket[0]
    wire = torch.float32 if p0.dtype in (torch.float16, torch.bfloat16) else p0.dtype
    with torch.no_grad():
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p))
                          .reshape(-1).to(device=device, dtype=wire) for p in bucket])
