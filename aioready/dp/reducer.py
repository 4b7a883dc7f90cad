"""Gradient reduction over a data-parallel group, started per stage as soon as it is final.

A stage's gradients are final once its last backward piece of the step ended (the last W with
split backward, else the last B): the runtime calls `reduce_nowait(chunk)` right then
(`RankRuntime(grads_ready=...)`), so the all-reduce of one chunk overlaps the backward work of
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

`Iallreduce` requests are completed by the loop's ProgressEngine (this reducer is a
CompletionSource), never by a blocking wait on the loop thread. CUDA gradients are staged
through host memory here (one synchronous copy per bucket); a CUDA-aware path is a later step.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import numpy as np

from ..errors import ConfigError, CoordinationError
from ..progress import ProgressEngine

__all__ = ["GradReducer", "MPIGradReducer", "ReduceStatistics", "DEFAULT_BUCKET_BYTES",
           "resolve_bucket_bytes", "plan_buckets"]

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


class MPIGradReducer:
    """Mean of each chunk's gradients over an mpi4py communicator (the DP group).

    Constructing it duplicates `comm` once per chunk plus once for the loss: a collective call,
    made by every member at the same point of the program.
    """

    def __init__(self, comm: Any, params: Sequence[Sequence[Any]], *,
                 bucket_bytes: int | None = None) -> None:
        from mpi4py import MPI
        self._MPI = MPI
        self._size = comm.Get_size()
        self.rank = comm.Get_rank()
        self.bucket_bytes = resolve_bucket_bytes(bucket_bytes)
        self._comms = [comm.Dup() for _ in params]
        self._loss_comm = comm.Dup()
        self._buckets = [plan_buckets([p for p in ps if p.requires_grad], self.bucket_bytes)
                         for ps in params]
        self._reqs: list[Any] = []
        self._done: list[Callable[[], None]] = []
        self._waiters: list[asyncio.Future[None]] = []
        self._engine: ProgressEngine | None = None
        self._error: BaseException | None = None
        self._chunk_start: dict[int, float] = {}
        self._chunk_left: dict[int, int] = {}
        self.spans: list[tuple[int, float, float]] = []  # (chunk, start, end), monotonic s
        self.num_buckets = self.num_bytes = 0
        self.busy_s = 0.0

    @property
    def size(self) -> int:
        return self._size

    # -- GradReducer ----------------------------------------------------------------------
    def reduce_nowait(self, chunk: int) -> None:
        if self._error is not None:
            raise self._error
        if chunk in self._chunk_left:
            raise CoordinationError("a chunk's gradients were handed to the reducer twice in "
                                    "one step", task=f"chunk {chunk}",
                                    expected="one reduction per chunk per step", got="two")
        buckets = self._buckets[chunk]
        if self._size == 1 or not buckets:
            return
        self._chunk_start[chunk] = time.monotonic()
        self._chunk_left[chunk] = len(buckets)
        for bucket in buckets:
            flat, array = _pack(bucket)
            req = self._comms[chunk].Iallreduce(self._MPI.IN_PLACE, array, op=self._MPI.SUM)
            self.num_buckets += 1
            self.num_bytes += array.nbytes
            self._track(req, partial(self._unpack, chunk, bucket, flat, array))
        self._kick()

    async def wait_reduced(self) -> None:
        while self._reqs:
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            await fut
        self._chunk_left.clear()
        if self._error is not None:
            raise self._error

    async def mean(self, value: Any) -> Any:
        import torch
        if self._size == 1:
            return value
        array = np.array([float(value)], dtype=np.float64)
        box: list[float] = []
        req = self._loss_comm.Iallreduce(self._MPI.IN_PLACE, array, op=self._MPI.SUM)
        self._track(req, lambda: box.append(float(array[0]) / self._size))
        self._kick()
        await self.wait_reduced()
        return torch.tensor(box[0], dtype=getattr(value, "dtype", torch.float64))

    def statistics(self) -> ReduceStatistics:
        return ReduceStatistics(self.num_buckets, self.num_bytes, self.busy_s)

    def close(self) -> None:
        if self._engine is not None:
            self._engine.remove_source(self)
        for comm in (*self._comms, self._loss_comm):
            comm.Free()

    # -- completion -----------------------------------------------------------------------
    def _kick(self) -> None:
        if self._engine is None:
            self._engine = ProgressEngine.for_loop()
            self._engine.add_source(self)
        self._engine.kick()

    def _track(self, req: Any, done: Callable[[], None]) -> None:
        self._reqs.append(req)
        self._done.append(done)

    def _unpack(self, chunk: int, bucket: list[Any], flat: Any, array: np.ndarray) -> None:
        import torch
        flat = torch.from_numpy(array) if flat is None else flat
        flat.div_(self._size)
        offset = 0
        with torch.no_grad():
            for p in bucket:
                n = p.numel()
                view = flat[offset:offset + n].view_as(p)
                offset += n
                if p.grad is None:
                    p.grad = view.to(p.dtype).to(p.device, copy=True)
                else:
                    p.grad.copy_(view)
        self._chunk_left[chunk] -= 1
        if not self._chunk_left[chunk]:
            end = time.monotonic()
            self.spans.append((chunk, self._chunk_start[chunk], end))
            self.busy_s += end - self._chunk_start[chunk]

    def poll(self) -> int:
        if not self._reqs:
            return 0
        try:
            idx = self._MPI.Request.Testsome(self._reqs)
        except self._MPI.Exception as exc:
            self._fail(CoordinationError(
                f"a data-parallel all-reduce failed in MPI (DP member {self.rank} of "
                f"{self._size}): {exc.Get_error_string()}",
                expected="the same parameters, in the same order, on every replica",
                got="an MPI error"))
            return 1
        if not idx:
            return 0
        finished = set(idx)
        done = [self._done[i] for i in idx]
        keep = [i for i in range(len(self._reqs)) if i not in finished]
        self._reqs = [self._reqs[i] for i in keep]
        self._done = [self._done[i] for i in keep]
        for fn in done:
            fn()
        if not self._reqs:
            self._wake()
        return len(done)

    def num_pending(self) -> int:
        return len(self._reqs)

    def wants_hot(self) -> bool:
        return False

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        self._reqs, self._done = [], []
        self._wake()

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def __repr__(self) -> str:
        return (f"<MPIGradReducer member {self.rank}/{self._size} chunks={len(self._comms)} "
                f"pending={len(self._reqs)}>")


def _pack(bucket: list[Any]) -> tuple[Any, np.ndarray]:
    """A flat copy of the bucket's gradients (zeros where a gradient is None), as the torch
    tensor to unpack from (None when the numpy array is the only copy) and the array MPI sends."""
    import torch
    p0 = bucket[0]
    wire = torch.float32 if p0.dtype in (torch.float16, torch.bfloat16) else p0.dtype
    with torch.no_grad():
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p))
                          .reshape(-1).to(device="cpu", dtype=wire) for p in bucket])
    return None, flat.numpy()
