"""The slice of an mpi4py communicator that telemetry/gather.py uses, over torch.distributed.

The CLI gathers step reports, sums counters and lines ranks up with `Igather`, `Igatherv`,
`Ireduce` and `Ibarrier` (telemetry/gather.py). Under torchrun there is no MPI, so this adapter
offers the same calls on a torch.distributed group with numpy buffers: gather.py stays one piece
of code for both launches. Each call returns a request whose `Test()` never blocks: collective
Works (unlike gloo's point-to-point ones) report `is_completed()` as soon as they finish.
torch has no gatherv: `Igatherv` first all-gathers the counts, then all-gathers rows padded to
the longest, and the root keeps each rank's real rows. Reports are small; nothing is pickled.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

__all__ = ["TorchComm"]


class _Request:
    """A chain of Works: `Test()` starts the next stage when one completes."""

    def __init__(self, work: Any, then: Callable[[], Any] | None = None) -> None:
        self._work = work
        self._then = then

    def Test(self) -> bool:  # noqa: N802 - mpi4py's name
        while self._work is not None:
            if not self._work.is_completed():
                return False
            self._work.wait()  # raises what the collective raised
            then, self._then = self._then, None
            self._work = then() if then is not None else None
        return True


class TorchComm:
    """mpi4py-style `Get_rank`, `Get_size` and the nonblocking collectives gather.py calls."""

    def __init__(self, group: Any = None) -> None:
        import torch
        import torch.distributed as dist
        self._torch = torch
        self._dist = dist
        self.group = group
        self._rank = dist.get_rank(group)
        self._size = dist.get_world_size(group)

    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's names
        return self._rank

    def Get_size(self) -> int:  # noqa: N802
        return self._size

    def Ibarrier(self) -> _Request:  # noqa: N802
        return _Request(self._dist.barrier(group=self.group, async_op=True))

    def Igather(self, send: np.ndarray, recv: np.ndarray | None, *, root: int = 0
                ) -> _Request:  # noqa: N802
        parts, work = self._all_gather(np.ascontiguousarray(send))

        def done() -> None:
            if recv is not None:
                recv[:] = np.concatenate([p.numpy() for p in parts])
        return _Request(work, done)

    def Iallgather(self, send: np.ndarray, recv: np.ndarray) -> _Request:  # noqa: N802
        """Every rank's `send`, in rank order, into every rank's `recv` (secure_session)."""
        parts, work = self._all_gather(np.ascontiguousarray(send))

        def done() -> None:
            recv[:] = np.concatenate([p.numpy() for p in parts])
        return _Request(work, done)

    def Igatherv(self, send: np.ndarray, recv: Any, *, root: int = 0) -> _Request:  # noqa: N802
        send = np.ascontiguousarray(send).reshape(-1)
        counts, work = self._all_gather(np.array([send.size], dtype=np.int64))
        state: dict[str, Any] = {}

        def rows() -> Any:
            longest = max(int(c[0]) for c in counts)
            padded = np.zeros(longest, dtype=send.dtype)
            padded[:send.size] = send
            state["parts"], next_work = self._all_gather(padded)
            return _Chained(next_work, done)

        def done() -> None:
            if recv is None:
                return
            out, (sizes, displs) = recv
            for part, n, at in zip(state["parts"], sizes, displs):
                out[int(at):int(at) + int(n)] = part.numpy()[:int(n)]
        return _Request(work, rows)

    def Ibcast(self, buf: np.ndarray, *, root: int = 0) -> _Request:  # noqa: N802
        """`root`'s `buf` into every rank's (broadcast_ints: hint="auto"'s choice); the tensor
        shares `buf`'s memory, so it is filled in place."""
        t = self._torch.from_numpy(buf)
        return _Request(self._dist.broadcast(t, src=self._global(root), group=self.group,
                                             async_op=True))

    def Ireduce(self, send: np.ndarray, recv: np.ndarray | None, *, op: Any = None,
                root: int = 0) -> _Request:  # noqa: N802
        t = self._torch.from_numpy(np.array(send, copy=True))
        work = self._dist.reduce(t, dst=self._global(root), group=self.group, async_op=True)

        def done() -> None:
            if recv is not None:
                recv[:] = t.numpy()
        return _Request(work, done)

    def _all_gather(self, arr: np.ndarray) -> tuple[list[Any], Any]:
        t = self._torch.from_numpy(arr)
        parts = [self._torch.empty_like(t) for _ in range(self._size)]
        return parts, self._dist.all_gather(parts, t, group=self.group, async_op=True)

    def _global(self, rank: int) -> int:
        return rank if self.group is None else self._dist.get_global_rank(self.group, rank)


class _Chained:
    """A Work whose completion runs `done` once (the last stage of a `_Request` chain)."""

    def __init__(self, work: Any, done: Callable[[], None]) -> None:
        self._work = work
        self._done = done

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())

    def wait(self) -> None:
        self._work.wait()
        self._done()
