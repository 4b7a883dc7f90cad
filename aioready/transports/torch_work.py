"""Completion of torch.distributed `Work` objects on the event loop, never blocking it.

Two kinds of Work, two ways to learn they finished:

- **gloo** (CPU tensors): the Work of a point-to-point `send`/`recv` is marked completed only by
  `wait()`: `is_completed()` stays False after the bytes arrived, and `get_future()` is not
  implemented (torch 2.13, checked when this was written). So each channel (peer x direction)
  has one waiter thread that calls `wait()` on its Works in posting order (which releases the
  GIL), queues the result and wakes the loop through an eventfd (see WorkWaiter for why not
  `call_soon_threadsafe`). One FIFO per channel is exact: gloo completes the transfers of one
  peer pair in the order they were posted, so the thread never waits behind a Work that
  finished later.
- **NCCL** (CUDA tensors): `is_completed()` queries the Work's CUDA event without blocking, so
  these Works are polled by the loop's ProgressEngine (this is one of its CompletionSources),
  head of each channel's FIFO only, like CUDA events.

Either way the callback runs on the loop thread with the exception `wait()` raised, if any (a
peer that died: "Connection closed by peer"), so the transport turns it into an error that names
the peer. A *lazy* channel (sends: nobody waits for each one) does not wake the loop for a
success: the completion waits in a queue that `drain()` empties (the transport drains on its
next send, and asks for wake-ups with `eager` while it waits for its sends). On 2 busy cores a
loop wake-up is tens of microseconds, and each message had one for its send. torch is not
imported here: Works are whatever objects the transport hands in. `stop()` ends the threads
without waiting, for owners closed outside the loop (the DP reducer, dp/torch_requests.py).
"""

from __future__ import annotations

import asyncio
import collections
import os
import queue
import threading
import weakref
from typing import Any, Callable, Hashable

from ..progress import ProgressEngine

__all__ = ["WorkWaiter", "Done"]

Done = Callable[[BaseException | None], None]
_STOP = None


class _Channel(threading.Thread):
    """One waiter thread: `wait()` on each Work in order, then call back on the loop."""

    def __init__(self, name: str, owner: "WorkWaiter", lazy: bool) -> None:
        super().__init__(name=name, daemon=True)  # a thread blocked in a dead peer's recv must
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()  # not keep the process up
        self._owner = owner
        self._loop = owner.loop
        self._lazy = lazy
        self.stopped: asyncio.Future[None] = owner.loop.create_future()
        self.put_item = self._queue.put  # (work, done)

    def stop(self) -> None:
        self._queue.put(_STOP)

    def run(self) -> None:
        get = self._queue.get
        while True:
            item = get()
            if item is _STOP:
                try:
                    self._loop.call_soon_threadsafe(self._owner.ended, self)
                except RuntimeError:  # the loop closed
                    pass
                return
            work, done = item
            exc: BaseException | None = None
            try:
                work.wait()
            except BaseException as err:  # handed to the loop, which names the peer
                exc = err
            owner = self._owner
            if self._lazy and exc is None:
                owner.ready.append(done)  # appended before `eager` is read: see drain
                if owner.eager:
                    owner.wake()
            else:
                owner.arrived.append((done, exc))  # before `wake` reads `signalled`
                owner.wake()


class WorkWaiter:
    """Calls `done(exc)` on the loop when each Work completes; one FIFO per channel key.

    Threads wake the loop through an eventfd the loop watches, written with the GIL released,
    not with `call_soon_threadsafe`: that returns holding the GIL, and the loop thread, woken
    by its write within microseconds, then blocked on the GIL until the thread was back inside
    `wait()` (strace: a futex wait after every wake-up, two context switches of the loop thread
    per message instead of one). Completions that arrive before the loop ran are handed over
    by the same wake-up (`signalled`).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.ready: collections.deque[Done] = collections.deque()  # lazy successes
        self.arrived: collections.deque[tuple[Done, BaseException | None]] = collections.deque()
        self.eager = False  # wake the loop for lazy completions too (someone is waiting)
        self.signalled = False  # a wake-up is on its way: later completions ride along
        self._fd = -1
        self._stopping: set[_Channel] = set()  # stopped threads that did not end yet
        self._threads: dict[Hashable, _Channel] = {}
        self._polled: dict[Hashable, collections.deque[tuple[Any, Done]]] = {}
        self._num_polled = 0
        self._engine: ProgressEngine | None = None

    def add(self, channel: Hashable, work: Any, done: Done, *, pollable: bool = False,
            lazy: bool = False) -> None:
        """Track `work`; `pollable` Works (NCCL) are polled, the others waited on a thread
        (`lazy`: that channel's successes wait for `drain()` unless `eager` is set)."""
        if pollable:
            self._polled.setdefault(channel, collections.deque()).append((work, done))
            self._num_polled += 1
            if self._engine is None:
                self._engine = ProgressEngine.for_loop(self.loop)
                self._engine.add_source(self)
            self._engine.kick()
            return
        self.channel(channel, lazy=lazy)((work, done))

    def channel(self, channel: Hashable, *, lazy: bool = False) -> Callable[[tuple[Any, Done]],
                                                                              None]:
        """What `add(channel, work, done)` does, as one call: `put((work, done))` (its thread
        started if need be). A transport keeps it per peer: a message's slot receive and its
        send then cost one C call each here instead of three Python calls."""
        thread = self._threads.get(channel)
        if thread is None:
            if self._fd < 0:
                self._open_fd()
            thread = self._threads[channel] = _Channel(f"aioready-work-{channel}", self, lazy)
            thread.start()
        return thread.put_item

    def _open_fd(self) -> None:
        """The eventfd the threads write and the loop watches; closed when this object is
        collected (a thread may still write it after `stop()`: the number must stay ours)."""
        if not hasattr(os, "eventfd"):  # not Linux: wake through the loop's own queue
            return
        fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        try:
            self.loop.add_reader(fd, self._readable)
        except NotImplementedError:  # a loop without readers
            os.close(fd)
            return
        self._fd = fd
        weakref.finalize(self, os.close, fd)

    def wake(self) -> None:
        """Called on a waiter thread after it queued a completion: wake the loop, once."""
        if self.signalled:
            return
        self.signalled = True
        try:
            if self._fd >= 0:
                os.eventfd_write(self._fd, 1)  # releases the GIL: the loop can take it
            else:
                self.loop.call_soon_threadsafe(self._readable)
        except (OSError, RuntimeError):  # the loop closed: nobody is left to tell
            pass

    def _readable(self) -> None:
        if self._fd >= 0:
            try:
                os.eventfd_read(self._fd)
            except BlockingIOError:
                pass
        self.signalled = False  # before draining: a completion queued later wakes again
        arrived = self.arrived
        while arrived:
            done, exc = arrived.popleft()
            try:
                done(exc)
            except Exception as err:  # one callback's bug must not strand the others
                self.loop.call_exception_handler({"message": "WorkWaiter callback failed",
                                                  "exception": err})
        if self.eager:
            self.drain()

    def ended(self, thread: _Channel) -> None:
        """On the loop: `thread` ended after `stop()`. After the last one, hand over what
        they queued and stop watching the eventfd (then nothing refers to this object)."""
        _resolve(thread.stopped)
        self._stopping.discard(thread)
        if not self._stopping and not self._threads and self._fd >= 0:
            self._readable()
            if not self.loop.is_closed():
                self.loop.remove_reader(self._fd)

    def drain(self) -> int:
        """Run the callbacks of lazy completions that arrived; return how many.

        Set `eager` before a final drain: a thread appends before it reads `eager`, so each
        completion is either seen by that drain or followed by a drain it schedules itself.
        """
        n = 0
        ready = self.ready
        while ready:
            ready.popleft()(None)
            n += 1
        return n

    def stop(self) -> list[_Channel]:
        """Stop the threads once they finished what they hold, without waiting (for owners
        closed outside the loop whose Works are all complete: the threads are idle)."""
        threads = list(self._threads.values())
        self._threads.clear()
        self._stopping.update(threads)
        for thread in threads:
            thread.stop()
        if self._engine is not None:
            self._engine.remove_source(self)
            self._engine = None
        return threads

    async def aclose(self, timeout: float) -> None:
        """Stop the threads once they finished what they hold, and wait (at most `timeout`)
        until they have: torch's `destroy_process_group` aborts the process (std::terminate)
        while a thread that waited on one of its Works is still running."""
        threads = self.stop()
        if threads:
            await asyncio.wait([t.stopped for t in threads], timeout=timeout)
        for thread in threads:
            if thread.stopped.done():
                thread.join()  # it returned right after resolving `stopped`

    # -- CompletionSource (NCCL Works) ------------------------------------------------------
    def poll(self) -> int:
        n = 0
        for fifo in self._polled.values():
            while fifo and fifo[0][0].is_completed():
                work, done = fifo.popleft()
                self._num_polled -= 1
                n += 1
                exc: BaseException | None = None
                try:
                    work.wait()  # completed: only orders the current stream after it
                except Exception as err:
                    exc = err
                done(exc)
        return n

    def num_pending(self) -> int:
        return self._num_polled

    def wants_hot(self) -> bool:
        return False  # NCCL progresses on the GPU without being polled

    def __repr__(self) -> str:
        return f"<WorkWaiter threads={len(self._threads)} polled={self._num_polled}>"


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
