"""The arbiter: one coroutine per rank that runs the best-ranked ready task, one at a time.

It is woken by the event that made a task ready (a `Wakeup` set by the message or completion
handler), never by a timer. Running a task and its bookkeeping is the caller's `execute`; the
choice comes from a `ReadyQueue`: normally the ReadySet, and in a tensor-parallel group the
leader's ReadySet that announces its choices or a member's queue that follows them
(tp/coordination.py).
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Protocol, runtime_checkable

from .clock import virtual_clock
from .ready_set import ReadySetStatistics
from .tasks import Task

__all__ = ["Wakeup", "ReadyQueue", "run_arbiter"]


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


@runtime_checkable
class ReadyQueue(Protocol):
    """A rank's ready tasks: the whole surface the arbiter and the runtime use, and why.

    - `push(task)`: the task's dependencies are met (the runtime, on a message or a completion).
    - `pop_nowait()`: the task to run now, or None if nothing may run yet (the arbiter).
    - `done(task)`: the task ended (in-flight bookkeeping).
    - `in_flight`, `in_flight_microbatches`, `peak_in_flight`: the microbatches admitted and
      not yet released, their indices and the step's peak (step reports and stall dumps).
    - `next_in_order`: the task this queue must offer next, if an order fixes it (a strict hint,
      or a TP leader's decision); None otherwise (stall dumps: what the rank waits for).
    - `ready_tasks()`: the ready tasks, best first; `statistics()`: counts (dumps and tests).
    """

    def push(self, task: Task) -> None: ...

    def pop_nowait(self) -> Task | None: ...

    def done(self, task: Task) -> None: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def in_flight_microbatches(self) -> list[int]: ...

    @property
    def peak_in_flight(self) -> int: ...

    @property
    def next_in_order(self) -> Task | None: ...

    def ready_tasks(self) -> list[Task]: ...

    def statistics(self) -> ReadySetStatistics: ...


async def run_arbiter(
    queue: ReadyQueue,
    execute: Callable[[Task], Awaitable[None]],
    wakeup: Wakeup,
    num_tasks: int,
    check: Callable[[], None] | None = None,
    on_wait: Callable[[bool], None] | None = None,
) -> None:
    """Run `num_tasks` tasks, each as soon as `queue` offers it.

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
        task = queue.pop_nowait()
        if task is None:
            if on_wait is not None:
                on_wait(True)
            await wakeup.wait()
            continue
        if on_wait is not None:
            on_wait(False)
        await execute(task)
        left -= 1
