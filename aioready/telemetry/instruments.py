"""Optional instrument hooks (trio's Instrument, docs/contributing.md "Telemetry hooks").

An instrument is any object implementing some of the hooks below; every hook is optional. The
hooks run on the loop thread and must be quick. With no instrument nothing is wrapped, so
telemetry off costs nothing beyond the runtime's own span per task; with instruments, a rank's
device and transport are wrapped (`instrument_pipeline`) and only the hooks somebody implements
are called. An instrument that raises is removed and logged; training continues.

Hooks:
  before_task(info)                   a task is about to run on the device (TaskInfo)
  after_task(info, start, end)        it ended; loop-clock seconds
  message_sent(rank, dest, msg, nbytes)   a send started (payload bytes)
  after_step(report, metrics)         the driver finished a step (StepReport, StepMetrics)
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Iterable, TypeVar

from ..devices.base import Device, TaskInfo
from ..transports.base import Message, Transport, WrappedTransport

__all__ = ["HOOKS", "Instruments", "InstrumentedDevice", "InstrumentedTransport",
           "instrument_pipeline", "payload_bytes"]

log = logging.getLogger("aioready.telemetry.instruments")
T = TypeVar("T")
HOOKS = ("before_task", "after_task", "message_sent", "after_step")


class Instruments:
    """The set of active instruments, indexed by the hooks each one implements."""

    def __init__(self, instruments: Iterable[Any] = ()) -> None:
        self._hooks: dict[str, list[tuple[Any, Callable[..., Any]]]] = {h: [] for h in HOOKS}
        for inst in instruments:
            self.add(inst)

    def add(self, instrument: Any) -> None:
        for hook in HOOKS:
            fn = getattr(instrument, hook, None)
            if callable(fn):
                self._hooks[hook].append((instrument, fn))

    def remove(self, instrument: Any) -> None:
        for hook in HOOKS:
            self._hooks[hook] = [(i, f) for i, f in self._hooks[hook] if i is not instrument]

    def has(self, hook: str) -> bool:
        """Whether any instrument implements `hook` (callers skip the call when not)."""
        return bool(self._hooks[hook])

    def call(self, hook: str, *args: Any) -> None:
        for inst, fn in tuple(self._hooks[hook]):
            try:
                fn(*args)
            except Exception:
                log.exception("instrument %r raised in %s; removing it", inst, hook)
                self.remove(inst)

    def __bool__(self) -> bool:
        return any(self._hooks.values())

    def __repr__(self) -> str:
        counts = {h: len(v) for h, v in self._hooks.items() if v}
        return f"<Instruments {counts}>"


def payload_bytes(msg: Message) -> int:
    """Bytes of a message's tensors (objects with `nbytes`; others count 0)."""
    return sum(int(getattr(t, "nbytes", 0) or 0) for t in msg.tensors)


class InstrumentedDevice:
    """A device that calls before_task / after_task around the wrapped device's run."""

    def __init__(self, inner: Device, instruments: Instruments) -> None:
        self.inner = inner
        self.instruments = instruments

    async def run(self, info: TaskInfo, fn: Callable[[], T]) -> T:
        inst = self.instruments
        loop = asyncio.get_running_loop()
        if inst.has("before_task"):
            inst.call("before_task", info)
        start = loop.time()
        result = await self.inner.run(info, fn)
        if inst.has("after_task"):
            inst.call("after_task", info, start, loop.time())
        return result

    def close(self) -> None:
        self.inner.close()

    def __repr__(self) -> str:
        return f"<InstrumentedDevice {self.inner!r}>"


class InstrumentedTransport(WrappedTransport):
    """A transport that reports each send (and its payload bytes) to message_sent."""

    def __init__(self, inner: Transport, instruments: Instruments) -> None:
        super().__init__(inner)
        self.instruments = instruments

    def send_nowait(self, dest: int, msg: Message) -> None:
        self.inner.send_nowait(dest, msg)
        if self.instruments.has("message_sent"):
            self.instruments.call("message_sent", self.inner.rank, dest, msg, payload_bytes(msg))

    def __getattr__(self, name: str) -> Any:  # statistics() etc. of the wrapped transport
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"<InstrumentedTransport {self.inner!r}>"


def instrument_pipeline(pipe: Any, instruments: Instruments) -> None:
    """Wrap each rank runtime's device and transport of `pipe` so `instruments` see its tasks
    and sends; wraps only what some instrument listens to, and nothing when there is none."""
    for rt in pipe.runtimes:
        if (instruments.has("before_task") or instruments.has("after_task")) and \
                not _wrapped(rt.device, instruments):
            rt.device = InstrumentedDevice(rt.device, instruments)
        if instruments.has("message_sent") and not _wrapped(rt.transport, instruments):
            rt.transport = InstrumentedTransport(rt.transport, instruments)


def _wrapped(obj: Any, instruments: Instruments) -> bool:
    """Whether `instruments` already wrap `obj`: wrapping twice with one set is a no-op, and
    another set (a dashboard beside Prometheus metrics) wraps around the first."""
    while isinstance(obj, (InstrumentedDevice, InstrumentedTransport)):
        if obj.instruments is instruments:
            return True
        obj = obj.inner
    return False
