"""Outstanding torch.distributed collectives of one rank, completed without blocking the loop.

The torchrun counterpart of requests.py: the data-parallel reducer and the cross-stage sums
start `all_reduce(..., async_op=True)` on the loop thread, `track(work, done, channel=...)`
registers the Work and the callback to run once it finished, `wait_all()` awaits every Work
tracked so far. Completion comes through transports/torch_work.py: a gloo Work is waited on a
thread per channel (`wait()` releases the GIL; the thread wakes the loop through an eventfd), so
a finished all-reduce wakes the loop at once instead of at the next poll of the progress engine;
an NCCL Work (`device=True`) is polled by the engine like a CUDA event. One channel per process group: a group's collectives finish in issue order, which is the
order its thread waits in. A backend error fails every waiter with a CoordinationError naming
the group (a peer that died: "Connection closed by peer", not a 30-minute timeout).
"""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Any, Callable, Hashable

from ..errors import CoordinationError
from ..transports.torch_work import WorkWaiter

__all__ = ["TorchRequests"]


class TorchRequests:
    """torch.distributed Works with completion callbacks, awaited on the loop."""

    def __init__(self, what: str) -> None:
        self.what = what  # names the group in errors
        self._waiter: WorkWaiter | None = None
        self._pending = 0
        self._waiters: list[asyncio.Future[None]] = []
        self._error: BaseException | None = None

    def track(self, work: Any, done: Callable[[], None] | None = None, *,
              channel: Hashable = 0, device: bool = False) -> None:
        """Call `done` on the loop once `work` finished (`device`: an NCCL Work, polled)."""
        if self._error is not None:
            raise self._error
        if self._waiter is None:
            self._waiter = WorkWaiter(asyncio.get_running_loop())
        self._pending += 1
        self._waiter.add(channel, work, partial(self._finished, done), pollable=device)

    async def wait_all(self) -> None:
        while self._pending and self._error is None:
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            await fut
        if self._error is not None:
            raise self._error

    def num_pending(self) -> int:
        return self._pending

    def close(self) -> None:
        """Stop the waiter threads (every Work finished: the step waited for them)."""
        if self._waiter is not None:
            self._waiter.stop()
            self._waiter = None

    def _finished(self, done: Callable[[], None] | None, exc: BaseException | None) -> None:
        self._pending -= 1
        if exc is not None:
            if self._error is None:
                self._error = CoordinationError(
                    f"a {self.what} failed in torch.distributed: {exc}",
                    expected="the same collectives, in the same order, on every member",
                    got="a backend error")
        elif done is not None and self._error is None:
            done()
        if not self._pending or self._error is not None:
            waiters, self._waiters = self._waiters, []
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)

    def __repr__(self) -> str:
        return f"<TorchRequests {self.what}: {self._pending} pending>"
