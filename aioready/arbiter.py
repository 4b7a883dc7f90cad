"""The arbiter: one coroutine per rank that runs the best-ranked ready task, one at a time.

It is woken by the event that made a task ready (a `Wakeup` set by the message or completion
handler), never by a timer. Running a task and its bookkeeping is the caller's `execute`; the
choice comes from a `Chooser`, normally the ReadySet, and for a tensor-parallel follower the
leader's decisions.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Protocol

from .clock import virtual_clock
from .tasks import Task

__all__ = ["Wakeup", "Chooser", "run_arbiter"]


class Wakeup:
    """A one-waiter wake-up: `notify` resolves the future the arbiter is parked on."""

    __slots__ = ("_fut",)

    def __init__(self) -> None:
        self._fut: asyncio.Future[None] | None = None

    def notify(self) -> None:
        fut = self._fut
        if fut is not None and not fut.done():
            fut.set_result(None)

    def fail(self, exc: BaseException) -> None:
        fut = self._fut
        if fut is not None and not fut.done():
            fut.set_exception(exc)

    async def wait(self) -> None:
        self._fut = asyncio.get_running_loop().create_future()
        try:
            await self._fut
        finally:
            self._fut = None


class Chooser(Protocol):
    """Picks the next task; None means nothing can run yet."""

    def pop_nowait(self) -> Task | None: ...


async def run_arbiter(
    chooser: Chooser,
    execute: Callable[[Task], Awaitable[None]],
    wakeup: Wakeup,
    num_tasks: int,
    check: Callable[[], None] | None = None,
    on_wait: Callable[[bool], None] | None = None,
) -> None:
    """Run `num_tasks` tasks, each as soon as the chooser offers it.

    `check` runs before each decision and raises to abort the step (an error delivered by a
    message handler, for example); `on_wait(True)` is called when the arbiter starts waiting
    for a task to become ready and `on_wait(False)` when it starts one (the completion engine
    polls eagerly only while it waits). On a virtual-clock loop (aioready.clock) each decision first
    waits for the end of the current instant, so same-instant completions are all seen first.
    """
    clock = virtual_clock(asyncio.get_running_loop())
    settle = None if clock is None else clock.wait_idle
    left = num_tasks
    while left:
        if settle is not None:
            await settle()
        if check is not None:
            check()
        task = chooser.pop_nowait()
        if task is None:
            if on_wait is not None:
                on_wait(True)
            await wakeup.wait()
            continue
        if on_wait is not None:
            on_wait(False)
        await execute(task)
        left -= 1
