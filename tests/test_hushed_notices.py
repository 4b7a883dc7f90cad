"""Notices ring no loop that computes, and a probe after a match looks twice
(docs/hot_path_measurements.md "Notices ring no loop that computes"): the engine hushes its parked
sources' doorbells for a task on the loop thread and polls until dry at its end; the doorbell
leaves such a rank alone for a notice and rings it for data; `MPITransport._probe` delivers a
message that a match left behind. Each with its switch off, the behaviour it replaces."""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from test_progress import BellSource

from aioready.clock import run_virtual
from aioready.progress import ProgressConfig, ProgressEngine


class HushSource(BellSource):
    """A doorbell source whose notices ring only while it is not hushed (as the MPI
    transport's do); `can_hush=False`: a source with the switch off."""

    def __init__(self, loop: asyncio.AbstractEventLoop, engine: ProgressEngine,
                 can_hush: bool) -> None:
        super().__init__(loop, engine)
        self.can_hush = can_hush
        self.hushed = False
        self.calls: list[bool] = []

    def hush_doorbell(self, hushed: bool = True) -> bool:
        self.calls.append(hushed)
        if self.can_hush:
            self.hushed = hushed
        return self.can_hush

    def arrive_notice(self) -> None:
        self.arrive(ring=not self.hushed)


@pytest.mark.parametrize("can_hush", [True, False], ids=["hushed", "switch-off"])
def test_a_notice_during_a_loop_thread_task_rings_nobody_and_is_read_at_its_end(
        can_hush: bool) -> None:
    """Parked on its doorbells when a task starts on the loop thread, the engine hushes the
    source: two notices that come during the task ring nobody; at the task's end the source is
    un-hushed first, then polled (one poll takes every message that came, as MPITransport's
    `_probe` does when it probes again after a match), so both are delivered there, and the park
    goes on. With the switch off the notices ring the rank during the task: the end's poll
    delivers them all the same, and the ring then wakes the engine for nothing."""
    async def main() -> tuple[int, int, int, HushSource, ProgressEngine, bool, bool]:
        loop = asyncio.get_running_loop()
        engine = ProgressEngine(loop, ProgressConfig(spin_s=0.0, bell_backstop_s=50e-3))
        src = HushSource(loop, engine, can_hush)
        engine.add_source(src)
        engine.set_waiting(True)
        src.add(1e9)  # always something pending: the engine parks, never idles
        futs = [src.add(100.0) for _ in range(2)]
        await asyncio.sleep(0.002)  # parked on the doorbell
        assert src.armed
        parks = engine.num_doorbell_parks
        engine.set_waiting(False)
        engine.inline_task_begins()
        hushed_during = src.hushed
        src.arrive_notice()
        engine.inline_task_ends()
        delivered = sum(f.done() for f in futs)
        armed_after = src.armed  # the park goes on
        await asyncio.sleep(0.1)
        assert all(f.done() for f in futs)  # either way, by now
        engine.close()
        return delivered, engine.num_doorbell_parks - parks, src.num_rung, src, engine, \
            hushed_during, armed_after

    delivered, parks, rung, src, engine, hushed_during, armed_after = run_virtual(main())
    assert delivered == 2  # both by the task's end, either way
    if can_hush:
        assert hushed_during and not src.hushed and src.calls == [True, False]
        assert rung == 0 and engine.num_rings == 0 and parks == 0 and armed_after
    else:
        assert not hushed_during and src.calls == [True]
        assert rung == 1 and engine.num_rings == 1


class _Bell:
    """A Doorbell (transports/doorbell.py) whose shared bytes are a local array: one peer."""

    def __init__(self) -> None:
        from aioready.transports.doorbell import Doorbell
        self.peer = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.peer.setblocking(False)
        prefix = f"\0aioready-test-{id(self)}-".encode()
        self.peer.bind(prefix + b"1")
        bell = Doorbell.__new__(Doorbell)
        bell._prefix = prefix
        bell.num_rung = 0
        bell._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        bell._flags = np.zeros(2, np.uint8)
        bell._slot = {0: 0, 1: 1}
        bell._me = 0
        self.bell = bell

    def got(self) -> int:
        n = 0
        while True:
            try:
                self.peer.recv(64)
            except BlockingIOError:
                return n
            n += 1

    def close(self) -> None:
        self.peer.close()
        self.bell._sock.close()


def test_a_computing_rank_is_rung_for_data_and_not_for_a_notice() -> None:
    b = _Bell()
    try:
        flags, bell = b.bell._flags, b.bell
        bell.ring(1, True)  # not parked: nobody rings
        bell.ring(1)
        assert b.got() == 0
        flags[1] = 1  # parked and waiting: a notice rings it, data too
        bell.ring(1, True)
        bell.ring(1)
        assert b.got() == 2
        bell._me = 1  # as the peer: computing, then parked again
        bell.set_computing(True)
        assert flags[1] == 2
        bell.ring(1, True)
        assert b.got() == 0
        bell.ring(1)
        assert b.got() == 1
        bell.set_computing(False)
        bell.ring(1, True)
        assert b.got() == 1 and flags[1] == 1 and bell.num_rung == 4
    finally:
        b.close()


class _LateComm:
    """An MPI communicator whose `Improbe` matches a message only on the call after the one
    whose progress moved it into the queue (as MPICH may): `arrivals[k]` arrives just before
    call k, is queued by that call after its match was tried, and matched by call k + 1."""

    def __init__(self, arrivals: dict[int, bytes]) -> None:
        self.queue: list[bytes] = []
        self.arrivals = dict(arrivals)
        self.calls = 0

    def Improbe(self, source: int, tag: int, status: Any) -> Any:
        self.calls += 1
        m = None
        if self.queue:
            data = status.data = self.queue.pop(0)
            m = SimpleNamespace(Irecv=lambda raw: _Done(raw, data))
        late = self.arrivals.pop(self.calls, None)
        if late is not None:
            self.queue.append(late)
        return m


class _Done:
    def __init__(self, raw: Any, data: bytes) -> None:
        raw[:] = np.frombuffer(data, np.uint8)

    def Test(self) -> bool:
        return True


class _Status:
    data = b""

    def Get_source(self) -> int:
        return 1

    def Get_tag(self) -> int:
        return 0

    def Get_count(self, _: Any) -> int:
        return len(self.data)


@pytest.mark.parametrize("again", [True, False], ids=["probe-again", "switch-off"])
def test_a_poll_that_matched_an_older_message_still_delivers_the_newer_one(again: bool) -> None:
    """Two headers: the first is matched, the second came meanwhile and is visible one call
    late. Probing again after the match delivers both in one poll; without it the second waits
    for the next poll (a ring's, or the backstop's)."""
    pytest.importorskip("mpi4py")
    from aioready.transports.mpi import MPITransport

    t = MPITransport.__new__(MPITransport)
    t._hdr = _LateComm({1: b"old", 3: b"new"})  # "new" comes after the call matching "old"
    t._status = _Status()
    t._MPI = SimpleNamespace(ANY_SOURCE=-1, ANY_TAG=-1, BYTE=None)
    t._max_header_message = 1 << 20
    t._recv_plans = None
    t._order = None
    t._rung = False
    t._probe_again = again
    t.hot_bytes = 1 << 16
    got: list[bytes] = []
    t._on_header = lambda src, seq, buf, ticket, planned: got.append(bytes(buf))
    t._hdr.Improbe(-1, -1, t._status)  # the last MPI call: "old" arrives
    first = t._probe()
    assert got[:1] == [b"old"]
    if again:
        assert first == 2 and got == [b"old", b"new"]
    else:
        assert first == 1 and got == [b"old"]
        assert t._probe() == 1 and got == [b"old", b"new"]  # one poll later
