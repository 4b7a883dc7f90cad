"""Outstanding MPI collectives of one rank, completed by the loop's ProgressEngine.

The data-parallel reducer and the cross-stage reductions start nonblocking collectives
(`Iallreduce`) on the loop thread and must never wait for them with a blocking call there
(docs/contributing.md "Never block the loop"). This is the CompletionSource that holds them:
`track(req, done)` registers a request and the callback to run once it completed,
`wait_all()` awaits every request tracked so far. An MPI error fails every waiter with a
CoordinationError naming the group.

How it is polled (measured, bench/dp.py and a 4-rank Iallreduce loop on 2 cores): a large
collective moves one piece per MPI call. Left to the engine's busy parks (5 ms) a 16 MiB mean
took 90 ms instead of 15 ms blocking; spinning on `Test` took 35 ms (it starves the peer rank on a
shared core); a test every ~1 ms took 16 ms. So a request of 64 KiB or more gets a few tests per
poll (`BURST`), never a hot spin (`wants_hot` stays False), and `wait_all` tells the engine the
rank is waiting (`set_waiting(True)`: 250 us parks, no back-off), since the step's tasks are done.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from ..errors import CoordinationError
from ..progress import ProgressEngine
from ..transports.mpi_requests import PendingRequests

__all__ = ["Requests", "HOT_BYTES", "BURST"]

HOT_BYTES = 65536  # a request at least this large gets BURST tests per poll
BURST = 4  # tests per poll while such a request is pending


class Requests:
    """A CompletionSource of MPI requests with completion callbacks."""

    def __init__(self, what: str) -> None:
        from mpi4py import MPI
        self._MPI = MPI
        self.what = what  # names the group in errors: "data-parallel all-reduce (member 0 of 2)"
        self._pending = PendingRequests(MPI.Request.Testsome)
        self._waiters: list[asyncio.Future[None]] = []
        self._engine: ProgressEngine | None = None
        self._error: BaseException | None = None

    def track(self, req: Any, done: Callable[[], None] | None = None, *, nbytes: int = 0
              ) -> None:
        """Complete `req` (moving `nbytes`) through the engine, then call `done` on the loop."""
        if self._error is not None:
            raise self._error
        self._pending.add(req, done, nbytes >= HOT_BYTES)
        if self._engine is None:
            self._engine = ProgressEngine.for_loop()
            self._engine.add_source(self)
        self._engine.kick()

    async def wait_all(self) -> None:
        if self._pending and self._engine is not None:
            self._engine.set_waiting(True)  # nothing else runs: completions are the critical path
        while self._pending:
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            await fut
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        if self._engine is not None:
            self._engine.remove_source(self)
            self._engine = None

    # -- CompletionSource -----------------------------------------------------------------
    def poll(self) -> int:
        if not self._pending:
            return 0
        try:
            done = self._pending.completed(BURST)
        except self._MPI.Exception as exc:
            self._error = CoordinationError(
                f"a {self.what} failed in MPI: {exc.Get_error_string()}",
                expected="the same tensors, in the same order, on every member",
                got="an MPI error")
            self._pending.clear()
            self._wake()
            return 1
        for fn in done:
            if fn is not None:
                fn()
        if not self._pending:
            self._wake()
        return len(done)

    def num_pending(self) -> int:
        return len(self._pending)

    def wants_hot(self) -> bool:
        return False  # see the module note: spinning starves the peers on shared cores

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def __repr__(self) -> str:
        return f"<Requests {self.what}: {len(self._pending)} pending>"
