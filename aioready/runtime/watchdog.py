"""Stall diagnosis: a step that makes no progress for a while stops with every rank's state.

The arbiter is woken only by completions (docs/architecture.md "The arbiter"), never by a timer, so
the watchdog is a separate loop timer that reads the runtimes' progress counters (`num_events`:
messages in, tasks started and ended) and never touches the arbiter. When the count has not moved
for `stall_timeout` seconds, it takes each rank's dump (ready set, pending receives, in-flight
microbatches, hint position) and cancels the step, which then raises StallError carrying the dump.
The check runs every quarter of the timeout, so a stall is reported between 1x and 1.25x the
timeout after the last progress.

`StepGuard` runs one step as a child task so that a watchdog (this one, or the peer watchdog of
faults.py) can stop it even while a task's compute is in progress: it records the error and
cancels the child; the step then raises that error instead of CancelledError.

Configuration, in order: the `stall_timeout=` argument, the AIOREADY_STALL_TIMEOUT environment
variable, then 60 s; None, 0 or "off" disables. On a virtual-clock loop (the simulator) the default
is off: simulated durations are in arbitrary units; pass a value to watch there too.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, Awaitable, Callable, Sequence, TypeVar

from ..errors import ConfigError, StallError

__all__ = ["StepGuard", "StallWatchdog", "resolve_timeout", "DEFAULT", "STALL_TIMEOUT_S"]

T = TypeVar("T")
STALL_TIMEOUT_S = 60.0
DEFAULT: Any = object()  # "not given": fall back to the environment variable, then the default
_OFF = ("", "0", "none", "off")


def resolve_timeout(name: str, value: Any, env: str, default: float | None) -> float | None:
    """The timeout in seconds (None: disabled) from an argument, then `env`, then `default`."""
    where = f"{name}="
    if value is DEFAULT:
        raw = os.environ.get(env)
        if raw is None:
            return default
        where, value = f"environment variable {env}", raw.strip()
        if value.lower() in _OFF:
            return None
        try:
            value = float(value)
        except ValueError:
            raise ConfigError(f"{where} is not a number of seconds",
                              expected="seconds > 0, or 'off'", got=repr(raw)) from None
    if value is None or value == 0:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
            or value == float("inf"):
        raise ConfigError(f"{where} must be a positive number of seconds",
                          expected="seconds > 0, or None to disable", got=repr(value))
    return float(value)


class StepGuard:
    """Runs a step as a child task that a watchdog may stop with an error (`abort`)."""

    def __init__(self) -> None:
        self._task: asyncio.Task[Any] | None = None
        self._error: BaseException | None = None
        self.on_start: list[Callable[[int], None]] = []
        self.on_end: list[Callable[[], None]] = []
        self.on_error: list[Callable[[BaseException], None]] = []

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def run(self, coro: Awaitable[T], step: int) -> T:
        """Await `coro` as a task; raise the error given to `abort` if it was stopped.

        A second call while one runs is refused before it touches anything: the running step
        keeps its task, its watchdogs and its peers."""
        if self.running:
            if asyncio.iscoroutine(coro):
                coro.close()
            raise RuntimeError(f"step {step}: a step is already running; await it before "
                               "starting the next")
        self._error = None
        self._task = asyncio.ensure_future(coro)
        for fn in self.on_start:
            fn(step)
        try:
            return await self._task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if self._error is None or (current is not None and current.cancelling()):
                raise
            for handler in self.on_error:
                handler(self._error)
            raise self._error from None
        except Exception as exc:
            for handler in self.on_error:
                handler(exc)
            raise
        finally:
            for end in self.on_end:
                end()
            self._task = None

    def abort(self, exc: BaseException) -> None:
        """Stop the running step with `exc` (the first abort wins)."""
        if self.running and self._error is None:
            self._error = exc
            self._task.cancel()  # type: ignore[union-attr]


class StallWatchdog:
    """Stops a step whose runtimes made no progress for `timeout` seconds (see module note)."""

    def __init__(self, runtimes: Sequence[Any], guard: StepGuard, timeout: float) -> None:
        self.runtimes = runtimes
        self.guard = guard
        self.timeout = timeout
        self._handle: asyncio.TimerHandle | None = None
        self._count = -1
        self._since = 0.0
        self._step = -1
        self.last_dump: str | None = None
        self.enabled = True
        guard.on_start.append(self.arm)
        guard.on_end.append(self.disarm)

    def _progress(self) -> int:
        return sum(rt.num_events for rt in self.runtimes)

    def arm(self, step: int) -> None:
        if not self.enabled:
            return
        loop = asyncio.get_running_loop()
        self._step = step
        self._count = self._progress()
        self._since = loop.time()
        self._handle = loop.call_later(self.timeout / 4, self._check)

    def disarm(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _check(self) -> None:
        loop = asyncio.get_running_loop()
        now, count = loop.time(), self._progress()
        if count != self._count:
            self._count, self._since = count, now
        elif now - self._since >= self.timeout:
            self._handle = None
            self.fire(now - self._since)
            return
        self._handle = loop.call_later(self.timeout / 4, self._check)

    def fire(self, idle: float) -> None:
        self.last_dump = "\n".join(_dump(rt) for rt in self.runtimes)
        ranks = [rt.rank for rt in self.runtimes]
        error = StallError(
            f"no progress for {idle:.3g} s (stall_timeout={self.timeout:g} s); state of "
            f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))}:\n"
            f"{self.last_dump}\n", rank=ranks[0] if len(ranks) == 1 else None, step=self._step,
            fix="a message was lost or a peer stopped, or the hint and cap leave nothing to "
                "run; raise stall_timeout (AIOREADY_STALL_TIMEOUT) if one task legitimately "
                "takes longer")
        self.guard.abort(error)


def _dump(runtime: Any) -> str:
    """A rank's dump; a failing dump must not keep the watchdog from stopping the step."""
    try:
        return str(runtime.dump())
    except Exception as exc:
        return f"rank {runtime.rank}: dump failed ({type(exc).__name__}: {exc})"
