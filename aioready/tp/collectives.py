"""Collectives of a tensor-parallel group, tagged with the task that issues them.

Where they run: inside a task's compute (the device's worker thread), called from the autograd
Functions of aioready.tp. We chose blocking-with-deadline collectives in the compute thread over
nonblocking collectives awaited by the event loop: the all-reduces sit in the middle of a torch
forward/backward, which cannot yield to the loop, and the compute thread is exactly the thread
that must wait. MPI is initialised with MPI_THREAD_MULTIPLE, so the loop thread keeps
progressing point-to-point traffic meanwhile. "Blocking" is an Iallreduce polled with `Test` and
a backoff, so that a wait has a deadline: a collective that cannot complete raises
CoordinationError after `timeout` seconds instead of hanging the job.

Note [tagged collectives]: each collective carries a tag naming the task that issues it
(step, stage, kind, microbatch, index of the collective inside the task), so members that run
different tasks get a CoordinationError at their first collective -- never an all-reduce that
silently sums two microbatches. Three levels (`verify=`):
- "exchange" (default): a fixed-size all-gather of the tags before each all-reduce. It has the
  same size on every member whatever the tasks, and the error names every member's task. Cost:
  one extra latency-bound collective per all-reduce.
- "inline": the tag's 24-bit key k and k*k ride in front of the all-reduce buffer (one
  collective). After the sum S1 = sum k_i, S2 = sum k_i^2, each member checks S1 == T*k and
  S2 == T*k^2, which holds iff every k_i == k (sum (k_i - k)^2 = S2 - 2k S1 + T k^2 = 0); both are
  exact in float64. Cheaper, but names only this member's task, misses a 2^-24 key collision,
  and needs the members' buffers to have the same size (true of same-shape microbatches).
- "off": no check (a mismatch of same-sized buffers then corrupts silently).
A member that runs fewer collectives (a W with none, or the end of its step) leaves the others
waiting: the deadline turns that into a CoordinationError too. An MPI error inside a
collective (sizes that do not match) is reported the same way.
"""

from __future__ import annotations

import threading
import time
import zlib
from typing import Any, Callable, Protocol, Sequence, TypeVar

import numpy as np

from ..devices.base import Device, TaskInfo
from ..errors import ConfigError, CoordinationError, StageError

__all__ = ["TPComm", "MPITPComm", "ThreadTPGroup", "ThreadTPComm", "TPDevice", "DEFAULT_TIMEOUT",
           "VERIFY_LEVELS"]

T = TypeVar("T")
DEFAULT_TIMEOUT = 60.0  # seconds a member waits in one collective before giving up
_TAG_LEN = 5
VERIFY_LEVELS = ("exchange", "inline", "off")


class TPComm(Protocol):
    """The whole surface TP layers need: who I am, and an in-place sum over the group."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def begin_task(self, info: TaskInfo | None) -> None: ...

    def allreduce_(self, array: np.ndarray) -> None: ...


class _Tagged:
    """Task context and tag bookkeeping shared by the implementations."""

    def __init__(self, rank: int, size: int, *, verify: str, timeout: float) -> None:
        if verify not in VERIFY_LEVELS:
            raise ConfigError("unknown TP collective check", expected=" | ".join(VERIFY_LEVELS),
                              got=repr(verify))
        self._rank = rank
        self._size = size
        self.verify = verify
        self.timeout = timeout
        self._info: TaskInfo | None = None
        self._index = 0
        self.num_collectives = 0

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def begin_task(self, info: TaskInfo | None) -> None:
        """Collectives from now on belong to `info`'s task (TPDevice calls this)."""
        self._info = info
        self._index = 0

    def _tag(self) -> np.ndarray:
        i = self._info
        tag = (-1, -1, -1, -1) if i is None else (i.step, i.stage, int(i.kind), i.microbatch)
        self._index += 1
        return np.array((*tag, self._index - 1), dtype=np.int64)

    def _check(self, tags: np.ndarray) -> None:
        if (tags == tags[0]).all():
            return
        mine = tags[self._rank]
        others = {r: _tag_text(tags[r]) for r in range(self._size) if r != self._rank}
        raise CoordinationError(
            f"tensor-parallel members are in different collectives (TP member {self._rank} of "
            f"{self._size})",
            step=int(mine[0]) if mine[0] >= 0 else None, task=_tag_text(mine),
            expected="every TP member in the same task and collective", got=f"members {others}",
            fix="run TP groups with a Coordinator (mode='ready') or in mode='strict'")

    def _pack(self, array: np.ndarray) -> tuple[np.ndarray, float]:
        """The buffer to reduce: [k, k*k, *array] for verify="inline" (Note [tagged ...])."""
        if array.dtype != np.float64:  # k*k must be exact: 48 bits
            raise ConfigError("verify='inline' needs float64 buffers", expected="float64",
                              got=str(array.dtype), fix="use verify='exchange'")
        key = float((zlib.crc32(self._tag().tobytes()) & 0xFFFFFF) + 1)
        buf = np.empty(array.size + 2, dtype=np.float64)
        buf[0], buf[1] = key, key * key
        buf[2:] = array.reshape(-1)
        return buf, key

    def _unpack(self, buf: np.ndarray, key: float, array: np.ndarray) -> None:
        self._check_inline(float(buf[0]), float(buf[1]), key)
        array.reshape(-1)[...] = buf[2:]

    def _check_inline(self, sum_k: float, sum_kk: float, key: float) -> None:
        """The sums of k and k*k over the members say whether all ran this collective."""
        n = float(self._size)
        if sum_k != n * key or sum_kk != n * key * key:
            raise CoordinationError(
                f"tensor-parallel members are in different collectives (TP member {self._rank}"
                f" of {self._size}; inline tag check)", task=_tag_text(self._tag_now()),
                expected="every TP member in this task and collective",
                got="another task on some member (verify='exchange' names it)",
                fix="run TP groups with a Coordinator (mode='ready') or in mode='strict'")

    def _timeout(self, what: str) -> CoordinationError:
        return CoordinationError(
            f"{what} did not complete within {self.timeout:g} s (TP member {self._rank} of "
            f"{self._size})",
            task=_tag_text(self._tag_now()), expected="all TP members to reach it",
            got="a member elsewhere (a different task, the end of its step, or gone)",
            fix="run TP groups with a Coordinator, or raise the timeout")

    def _tag_now(self) -> np.ndarray:
        i = self._info
        tag = (-1, -1, -1, -1) if i is None else (i.step, i.stage, int(i.kind), i.microbatch)
        return np.array((*tag, self._index - 1), dtype=np.int64)


def _tag_text(tag: Sequence[int]) -> str:
    step, stage, kind, mb, index = (int(v) for v in tag)
    if step < 0:
        return f"no task, collective {index}"
    return f"{'FBW'[kind]}{mb} of stage {stage} step {step}, collective {index}"


class MPITPComm(_Tagged):
    """A TP group over an mpi4py communicator (its ranks are the TP ranks)."""

    def __init__(self, comm: Any, *, verify: str = "exchange",
                 timeout: float = DEFAULT_TIMEOUT) -> None:
        super().__init__(comm.Get_rank(), comm.Get_size(), verify=verify, timeout=timeout)
        from mpi4py import MPI

        self._MPI = MPI
        self.comm = comm
        self._gathered = np.empty((self._size, _TAG_LEN), dtype=np.int64)

    def allreduce_(self, array: np.ndarray) -> None:
        if self._size == 1:
            return
        self.num_collectives += 1
        if not array.flags.c_contiguous:
            raise ValueError("allreduce_ needs a C-contiguous array")
        if self.verify == "inline":
            buf, key = self._pack(array)
            self._wait(self.comm.Iallreduce(self._MPI.IN_PLACE, buf, op=self._MPI.SUM),
                       "all-reduce")
            self._unpack(buf, key, array)
            return
        if self.verify == "exchange":
            self._exchange_tags()
        self._wait(self.comm.Iallreduce(self._MPI.IN_PLACE, array, op=self._MPI.SUM),
                   "all-reduce")

    def _exchange_tags(self) -> None:
        """verify="exchange": every member's tag, gathered and compared (Note [tagged ...])."""
        self._wait(self.comm.Iallgather(self._tag(), self._gathered), "tag exchange")
        self._check(self._gathered)

    def _wait(self, req: Any, what: str) -> None:
        """Test with a backoff: spin briefly (latency), then sleep up to 200 us (2 cores)."""
        deadline = time.monotonic() + self.timeout
        spins = 0
        while not self._test(req, what):
            spins += 1
            if spins < 64:
                time.sleep(0)
            else:
                time.sleep(min(2e-4, 1e-6 * spins))
                if time.monotonic() > deadline:
                    raise self._timeout(what)

    def _test(self, req: Any, what: str) -> bool:
        try:
            return bool(req.Test())
        except self._MPI.Exception as exc:
            raise CoordinationError(
                f"{what} failed in MPI (TP member {self._rank} of {self._size}): "
                f"{exc.Get_error_string()}", task=_tag_text(self._tag_now()),
                expected="matching collectives on every member", got="an MPI error",
                fix="run TP groups with a Coordinator, or use verify='exchange'") from None


class ThreadTPGroup:
    """An in-process TP group: members are threads (one CPUDevice per rank) in one process."""

    def __init__(self, size: int, *, timeout: float = 10.0) -> None:
        self.size = size
        self.timeout = timeout
        self._barrier = threading.Barrier(size)
        self._slots: list[Any] = [None] * size

    def member(self, rank: int, *, verify: str = "exchange") -> "ThreadTPComm":
        return ThreadTPComm(self, rank, verify=verify)

    def exchange(self, comm: "ThreadTPComm", value: Any, what: str) -> list[Any]:
        """All-gather of Python values among the members (two barrier phases)."""
        self._slots[comm.rank] = value
        self._wait(comm, what)
        values = list(self._slots)
        self._wait(comm, what)
        return values

    def _wait(self, comm: "ThreadTPComm", what: str) -> None:
        try:
            self._barrier.wait(self.timeout)
        except threading.BrokenBarrierError:
            raise comm._timeout(what) from None

    def abort(self) -> None:
        """Release every member waiting in a collective (they raise CoordinationError)."""
        self._barrier.abort()


class ThreadTPComm(_Tagged):
    """One member of a ThreadTPGroup; sums in rank order, so every member gets the same bits."""

    def __init__(self, group: ThreadTPGroup, rank: int, *, verify: str) -> None:
        super().__init__(rank, group.size, verify=verify, timeout=group.timeout)
        self.group = group

    def allreduce_(self, array: np.ndarray) -> None:
        if self._size == 1:
            return
        self.num_collectives += 1
        if self.verify == "exchange":
            self._check(np.stack(self.group.exchange(self, self._tag(), "tag exchange")))
        if self.verify == "inline":
            buf, key = self._pack(array)
            self._sum(buf)
            self._unpack(buf, key, array)
        else:
            self._sum(array)

    def _sum(self, array: np.ndarray) -> None:
        parts = self.group.exchange(self, array.copy(), "all-reduce")
        if any(p.shape != array.shape for p in parts):
            raise CoordinationError(
                f"all-reduce buffers differ in shape (TP member {self._rank} of {self._size})",
                task=_tag_text(self._tag_now()), expected=array.shape,
                got=[p.shape for p in parts])
        total = parts[0].copy()
        for part in parts[1:]:
            total += part
        array[...] = total


class TPDevice:
    """Wraps a rank's device so its TP collectives are tagged with the running task.

    A CoordinationError raised inside the stage's forward or backward is re-raised as itself
    (the stage executor wraps other exceptions in StageError), so callers see the real cause.
    """

    def __init__(self, inner: Device, comm: TPComm, *,
                 on_error: Callable[[], None] | None = None) -> None:
        self.inner = inner
        self.comm = comm
        self.on_error = on_error

    async def run(self, info: TaskInfo, fn: Callable[[], T]) -> T:
        def call() -> T:
            self.comm.begin_task(info)
            try:
                return fn()
            finally:
                self.comm.begin_task(None)
        try:
            return await self.inner.run(info, call)  # type: ignore[no-any-return]
        except (StageError, CoordinationError) as exc:
            if self.on_error is not None:
                self.on_error()
            cause = exc if isinstance(exc, CoordinationError) else exc.__cause__
            if isinstance(cause, CoordinationError):
                raise cause from None
            raise

    def close(self) -> None:
        self.inner.close()

    def __repr__(self) -> str:
        return f"<TPDevice rank {self.comm.rank}/{self.comm.size} over {self.inner!r}>"
