"""WorkWaiter (transports/torch_work.py) with fake Works: waiter threads wake the loop through
its eventfd, completions that arrive together ride one wake-up, each channel keeps its order,
a failing callback strands nothing, and stopping lets go of the eventfd."""

from __future__ import annotations

import asyncio
import threading

import pytest

from aioready.transports.torch_work import WorkWaiter

pytestmark = pytest.mark.timeout(30)


class Work:
    """A Work whose wait() blocks until `finish()` (or raises what `fail()` set)."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None

    def finish(self, error: BaseException | None = None) -> None:
        self.error = error
        self._done.set()

    def wait(self) -> bool:
        self._done.wait()
        if self.error is not None:
            raise self.error
        return True


def test_completions_arrive_in_channel_order_and_batch_into_one_wake_up() -> None:
    async def main() -> tuple[list[tuple[str, int, str | None]], int]:
        loop = asyncio.get_running_loop()
        waiter = WorkWaiter(loop)
        seen: list[tuple[str, int, str | None]] = []
        works = {ch: [Work() for _ in range(5)] for ch in ("a", "b")}
        for ch, ws in works.items():
            for i, w in enumerate(ws):
                waiter.add(ch, w, lambda exc, ch=ch, i=i: seen.append(
                    (ch, i, None if exc is None else str(exc))))
        wakes = 0
        readable = waiter._readable

        def counting() -> None:
            nonlocal wakes
            wakes += 1
            readable()
        loop.remove_reader(waiter._fd)
        loop.add_reader(waiter._fd, counting)
        for ch in ("b", "a"):  # finished while the loop is busy: one wake-up for all of them
            for i, w in enumerate(works[ch]):
                w.finish(RuntimeError("peer gone") if (ch, i) == ("b", 3) else None)
        while len(seen) < 10:
            await asyncio.sleep(0.005)
        await waiter.aclose(5)
        return seen, wakes
    seen, wakes = asyncio.run(main())
    for ch in ("a", "b"):
        assert [i for c, i, _ in seen if c == ch] == [0, 1, 2, 3, 4], seen
    assert [e for c, i, e in seen if e is not None] == ["peer gone"]
    assert [(c, i) for c, i, e in seen if e is not None] == [("b", 3)]
    assert 1 <= wakes < 10, wakes


def test_a_failing_callback_strands_no_other_completion() -> None:
    async def main() -> tuple[list[int], list[dict]]:
        loop = asyncio.get_running_loop()
        errors: list[dict] = []
        loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
        waiter = WorkWaiter(loop)
        got: list[int] = []
        works = [Work() for _ in range(3)]

        def bad(exc: BaseException | None) -> None:
            raise ValueError("callback bug")
        waiter.add("c", works[0], bad)
        waiter.add("c", works[1], lambda exc: got.append(1))
        waiter.add("d", works[2], lambda exc: got.append(2))
        for w in works:
            w.finish()
        while len(got) < 2:
            await asyncio.sleep(0.005)
        await waiter.aclose(5)
        return got, errors
    got, errors = asyncio.run(main())
    assert sorted(got) == [1, 2]
    assert [str(ctx["exception"]) for ctx in errors] == ["callback bug"]


def test_lazy_successes_wait_for_drain_unless_eager() -> None:
    async def main() -> tuple[int, int, int]:
        loop = asyncio.get_running_loop()
        waiter = WorkWaiter(loop)
        got: list[int] = []
        first, second = Work(), Work()
        waiter.add("s", first, lambda exc: got.append(1), lazy=True)
        first.finish()
        while not waiter.ready:  # queued by the thread, not handed to the loop
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.02)
        before = len(got)
        drained = waiter.drain()
        waiter.eager = True  # someone waits: a lazy success wakes the loop
        waiter.add("s", second, lambda exc: got.append(2), lazy=True)
        second.finish()
        while len(got) < 2:
            await asyncio.sleep(0.005)
        await waiter.aclose(5)
        return before, drained, len(got)
    assert asyncio.run(main()) == (0, 1, 2)


def test_stopping_ends_the_threads_and_releases_the_eventfd() -> None:
    async def main() -> tuple[bool, bool]:
        loop = asyncio.get_running_loop()
        waiter = WorkWaiter(loop)
        w = Work()
        waiter.add("x", w, lambda exc: None)
        w.finish()
        threads = waiter.stop()
        await asyncio.wait([t.stopped for t in threads], timeout=5)
        await asyncio.sleep(0)
        watched = loop._selector.get_map().get(waiter._fd)  # type: ignore[attr-defined]
        return all(t.stopped.done() for t in threads), watched is not None
    ended, watched = asyncio.run(main())
    assert ended and not watched


def test_a_channels_put_joins_add_on_one_thread_in_posting_order() -> None:
    """`channel(key)` is `add(key, ...)` as one call (the transport keeps it per peer): the
    same thread, so Works put and Works added complete in the order they were handed in, with
    the Work's exception, and a lazy channel's successes still wait for `drain()`."""
    async def main() -> tuple[list[tuple[int, str | None]], int, int, list[int]]:
        loop = asyncio.get_running_loop()
        waiter = WorkWaiter(loop)
        seen: list[tuple[int, str | None]] = []
        works = [Work() for _ in range(4)]
        put = waiter.channel("p")
        for i, w in enumerate(works):
            done = (lambda exc, i=i: seen.append((i, None if exc is None else str(exc))))
            if i % 2:
                waiter.add("p", w, done)
            else:
                put((w, done))
        for i, w in reversed(list(enumerate(works))):  # finished last to first
            w.finish(RuntimeError("closed") if i == 2 else None)
        while len(seen) < 4:
            await asyncio.sleep(0.005)
        lazy: list[int] = []
        w = Work()
        waiter.channel("q", lazy=True)((w, lambda exc: lazy.append(1)))
        w.finish()
        while not waiter.ready:
            await asyncio.sleep(0.005)
        before = len(lazy)
        waiter.drain()
        threads = len(waiter._threads)
        await waiter.aclose(5)
        return seen, threads, before, lazy
    seen, threads, before, lazy = asyncio.run(main())
    assert seen == [(0, None), (1, None), (2, "closed"), (3, None)]
    assert threads == 2 and before == 0 and lazy == [1]
