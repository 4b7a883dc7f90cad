"""A minimal completion engine, used only when aioready.progress is not available.

It follows the progress-engine contract (BRIEF: `for_loop`, `add_source`, `kick`; sources have
`poll()`, `num_pending()`, `wants_hot()`): one coroutine per loop polls every source, spins with
`sleep(0)` while a source with pending work wants it hot, and otherwise parks on an asyncio.Event
until `kick()`. Sources that wake themselves (a waiter thread, an eventfd) resolve their own
futures on the loop thread, so parking never loses a completion.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any, Protocol

__all__ = ["CompletionSource", "LocalEngine", "engine_for"]


class CompletionSource(Protocol):
    def poll(self) -> int: ...

    def num_pending(self) -> int: ...

    def wants_hot(self) -> bool: ...


class LocalEngine:
    """One per loop: hot-polls sources that want it, parks otherwise."""

    _engines: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LocalEngine]" = (
        weakref.WeakKeyDictionary())

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.sources: list[CompletionSource] = []
        self._kicked = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.num_polls = 0

    @classmethod
    def for_loop(cls, loop: asyncio.AbstractEventLoop | None = None) -> "LocalEngine":
        loop = loop or asyncio.get_running_loop()
        engine = cls._engines.get(loop)
        if engine is None:
            engine = cls._engines[loop] = cls(loop)
        return engine

    def add_source(self, src: CompletionSource) -> None:
        if src not in self.sources:
            self.sources.append(src)

    def remove_source(self, src: CompletionSource) -> None:
        if src in self.sources:
            self.sources.remove(src)

    def kick(self) -> None:
        """New work arrived: make sure the poller runs."""
        self._kicked.set()
        if self._task is None or self._task.done():
            self._task = self.loop.create_task(self._run(), name="aioready-local-engine")

    def poll(self) -> int:
        self.num_polls += 1
        return sum(src.poll() for src in self.sources)

    def _hot(self) -> bool:
        return any(s.num_pending() and s.wants_hot() for s in self.sources)

    async def _run(self) -> None:
        while True:
            self.poll()
            if self._hot():
                await asyncio.sleep(0)
                continue
            self._kicked.clear()
            if self._hot():
                continue
            await self._kicked.wait()


def engine_for(loop: asyncio.AbstractEventLoop | None = None) -> Any:
    """The loop's progress engine: aioready.progress's when present, else a LocalEngine."""
    try:
        from ..progress import ProgressEngine  # type: ignore[attr-defined]
    except ImportError:
        return LocalEngine.for_loop(loop)
    return ProgressEngine.for_loop(loop)
