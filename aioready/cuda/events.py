"""CUDA events as a completion source of the progress engine (docs/async.md "CUDA events").

Events recorded on one stream complete in order, so each stream keeps a FIFO of (event, future)
and `poll()` queries only the head of each FIFO (`event.query()`, never blocking). How the loop
learns of a completion is the `wake` mode:

- ``poll``: the source wants the engine hot while anything is pending; the engine's passes call
  `poll()`. Lowest latency, one core spinning while GPU work is outstanding.
- ``thread``: one waiter thread per stream blocks in `Event.synchronize()` (which releases the
  GIL; events are created with `blocking=True` so the thread sleeps) and wakes the loop with
  `call_soon_threadsafe`. The engine may park.
- ``hybrid``: hot as ``poll`` for `spin_s` after the last new event (docs/async.md "Spin, park,
  back off": stay hot while a completion is expected soon), then the pending events go to the
  waiter threads of ``thread`` and the engine may park. Short tasks get poll latency; long ones
  stop costing a spinning core.
- ``hostfn``: a C function (never a Python callable: a host callback that needs the GIL can
  deadlock against a thread holding the GIL and calling CUDA) enqueued with `cuLaunchHostFunc`
  on a side notify stream, after `wait_event`, writes to an eventfd the loop watches. The compute
  stream is never held up by it. Needs a C compiler once, to build the three-line shim.

This module imports torch only inside the `thread` and `hostfn` machinery, so the poll logic runs
(and is tested) with fake events: any object with `query() -> bool` (and `synchronize()`).
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import hashlib
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import time
from typing import Any, Callable, Hashable

from ..errors import ConfigError, StageError
from ..progress import ProgressEngine

__all__ = ["CUDAEventSource", "WAKE_MODES", "DEFAULT_SPIN_S", "hostfn_available", "notify_shim"]

WAKE_MODES = ("poll", "hybrid", "thread", "hostfn")
DEFAULT_SPIN_S = 0.002

_SHIM_C = rb"""
#include <stdint.h>
#include <unistd.h>
void aioready_notify(void *fd) {
    uint64_t one = 1;
    ssize_t r = write((int)(intptr_t)fd, &one, sizeof one);
    (void)r;
}
"""
_shim: Any = None


def notify_shim() -> ctypes.CDLL:
    """Build (once, cached by content) and load the C host function that writes an eventfd."""
    global _shim
    if _shim is not None:
        return _shim
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise ConfigError("wake='hostfn' needs a C compiler to build its host function",
                          expected="cc or gcc on PATH", got=None, fix="use wake='thread'")
    digest = hashlib.sha256(_SHIM_C).hexdigest()[:12]
    folder = os.path.join(tempfile.gettempdir(), f"aioready-{os.getuid()}")
    os.makedirs(folder, exist_ok=True)
    lib = os.path.join(folder, f"notify-{digest}.so")
    if not os.path.exists(lib):
        src = os.path.join(folder, f"notify-{digest}.c")
        with open(src, "wb") as f:
            f.write(_SHIM_C)
        tmp = f"{lib}.{os.getpid()}"
        done = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", tmp, src],
                              capture_output=True, text=True, timeout=60)
        if done.returncode:
            raise ConfigError("building the eventfd host function failed", expected="cc to "
                              "build a shared object", got=done.stderr.strip()[:300])
        os.replace(tmp, lib)
    _shim = ctypes.CDLL(lib)
    return _shim


def hostfn_available() -> bool:
    try:
        notify_shim()
        ctypes.CDLL("libcuda.so.1")
    except (ConfigError, OSError):
        return False
    return hasattr(os, "eventfd")


class _Waiter:
    """A thread that blocks in `synchronize()` on one stream's events, in order."""

    def __init__(self, loop: asyncio.AbstractEventLoop, wake: Callable[[], None]) -> None:
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._loop = loop
        self._wake = wake
        self._thread = threading.Thread(target=self._main, name="aioready-cuda-waiter",
                                        daemon=True)
        self._thread.start()

    def submit(self, event: Any) -> None:
        self._q.put(event)

    def _main(self) -> None:
        while True:
            event = self._q.get()
            if event is None:
                return
            try:
                event.synchronize()
            except Exception:  # the loop thread's query() reports the error with its task
                pass
            try:
                self._loop.call_soon_threadsafe(self._wake)
            except RuntimeError:  # loop closed
                return

    def close(self) -> None:
        self._q.put(None)


class _HostFnNotifier:
    """Per stream: a side stream that waits for the event, then runs the C host function."""

    def __init__(self, loop: asyncio.AbstractEventLoop, wake: Callable[[], None]) -> None:
        import torch
        self._torch = torch
        self.efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._loop = loop
        self._wake = wake
        loop.add_reader(self.efd, self._readable)
        self._fn = ctypes.cast(notify_shim().aioready_notify, ctypes.c_void_p)
        self._launch = ctypes.CDLL("libcuda.so.1").cuLaunchHostFunc
        self._launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        self._launch.restype = ctypes.c_int
        self._streams: dict[Hashable, Any] = {}

    def launch(self, key: Hashable, event: Any, device: Any) -> None:
        side = self._streams.get(key)
        if side is None:
            side = self._streams[key] = self._torch.cuda.Stream(device)
        side.wait_event(event)
        rc = self._launch(side.cuda_stream, self._fn, self.efd)
        if rc:
            raise StageError("cuLaunchHostFunc failed", expected="CUDA_SUCCESS (0)",
                             got=f"CUresult {rc}")

    def _readable(self) -> None:
        try:
            os.eventfd_read(self.efd)
        except BlockingIOError:
            return
        self._wake()

    def close(self) -> None:
        try:
            self._loop.remove_reader(self.efd)
        except RuntimeError:
            pass
        os.close(self.efd)


class CUDAEventSource:
    """Completion source of CUDA events: per-stream FIFOs, only heads are queried."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None, *, wake: str = "poll",
                 engine: Any = None, spin_s: float = DEFAULT_SPIN_S) -> None:
        if wake not in WAKE_MODES:
            raise ConfigError("unknown CUDA wake mode", expected=" | ".join(WAKE_MODES),
                              got=repr(wake))
        self.loop = loop or asyncio.get_running_loop()
        self.wake = wake
        self.engine = engine if engine is not None else ProgressEngine.for_loop(self.loop)
        self.engine.add_source(self)
        self.spin_s = spin_s
        self._hot_until = 0.0
        self._fifos: dict[Hashable, collections.deque[list[Any]]] = {}
        self._pending = 0
        self._waiters: dict[Hashable, _Waiter] = {}
        self._notifier: _HostFnNotifier | None = None
        self.num_queries = 0
        self.num_completed = 0

    def add(self, event: Any, stream: Hashable, *, device: Any = None) -> asyncio.Future[None]:
        """Track `event` (recorded on `stream`); the future resolves when it has completed."""
        fut: asyncio.Future[None] = self.loop.create_future()
        fifo = self._fifos.get(stream)
        if fifo is None:
            fifo = self._fifos[stream] = collections.deque()
        entry = [event, fut, False]  # event, future, handed to a waiter thread
        fifo.append(entry)
        self._pending += 1
        if self.wake == "poll":
            self.engine.kick()
        elif self.wake == "hybrid":
            self._hot_until = time.monotonic() + self.spin_s
            self.engine.kick()
        elif self.wake == "thread":
            self._submit(stream, entry)
        else:
            if self._notifier is None:
                self._notifier = _HostFnNotifier(self.loop, self._on_wake)
            self._notifier.launch(stream, event, device)
        return fut

    def _submit(self, stream: Hashable, entry: list[Any]) -> None:
        waiter = self._waiters.get(stream)
        if waiter is None:
            waiter = self._waiters[stream] = _Waiter(self.loop, self._on_wake)
        entry[2] = True
        waiter.submit(entry[0])

    def _park(self) -> None:
        for stream, fifo in self._fifos.items():
            for entry in fifo:
                if not entry[2]:
                    self._submit(stream, entry)

    def _on_wake(self) -> None:
        self.poll()

    def poll(self) -> int:
        """Complete finished events (heads of each FIFO only); return how many completed."""
        done = 0
        for fifo in self._fifos.values():
            while fifo:
                event, fut, _ = fifo[0]
                self.num_queries += 1
                try:
                    finished = event.query()
                    error = None
                except Exception as exc:
                    finished, error = True, exc
                if not finished:
                    break
                fifo.popleft()
                self._pending -= 1
                done += 1
                if fut.done():
                    continue
                if error is None:
                    fut.set_result(None)
                else:
                    fut.set_exception(StageError(f"CUDA work failed: {error}",
                                                 expected="the event to complete",
                                                 got=type(error).__name__))
        self.num_completed += done
        return done

    def num_pending(self) -> int:
        return self._pending

    def wants_hot(self) -> bool:
        if self._pending == 0 or self.wake in ("thread", "hostfn"):
            return False
        if self.wake == "poll" or time.monotonic() < self._hot_until:
            return True
        self._park()  # hybrid, spin window over: waiter threads take the pending events
        return False

    def close(self) -> None:
        for waiter in self._waiters.values():
            waiter.close()
        self._waiters.clear()
        if self._notifier is not None:
            self._notifier.close()
            self._notifier = None
        remove = getattr(self.engine, "remove_source", None)
        if remove is not None:
            remove(self)

    def __repr__(self) -> str:
        return (f"<CUDAEventSource wake={self.wake} streams={len(self._fifos)} "
                f"pending={self._pending}>")
