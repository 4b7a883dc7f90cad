"""When the notice board is read (transports/notice_board.py Note [no ring, read where
consulted]): at each consultation of the forecast, which sees a record posted just before it;
records of an older step are dropped in C without a call, a later step's kept for it; and an
in-process pipeline whose ranks share a board makes the same decisions, from the same forecast
at every consultation, as reading the board before every decision did."""

from __future__ import annotations

import asyncio
import zlib
from typing import Any

import pytest
from test_notice_board import boards, pipeline, runtime_of

from aioready.clock import run_virtual
from aioready.devices import SimDevice
from aioready.devices.base import TaskInfo
from aioready.forecast import Forecast
from aioready.runtime.rank import RankRuntime
from aioready.schedulers import make_hint
from aioready.tasks import Kind, Task
from aioready.transports.inproc import InprocWorld
from aioready.transports.notice_board import SLOTS


@pytest.fixture(autouse=True)
def _helper_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The board needs the compiled helper, also in a run with the fast paths switched off."""
    monkeypatch.setenv("AIOREADY_MPI_NATIVE", "1")


def test_older_steps_are_dropped_without_a_call_and_later_ones_kept() -> None:
    b0, b1 = boards(2)
    for m in range(SLOTS - 2):
        assert b0.post(1, 2, 1, m, 0, 0.0)  # step 2, never consulted
    assert b0.post(1, 3, 1, 0, 0, 1.0) and b0.post(1, 4, 1, 0, 0, 2.0)
    called: list[tuple[Any, ...]] = []
    assert b1.read(None, 3) == 0  # a step's start: the older ones go, step 3's stays
    assert (b1.num_skipped, called) == (SLOTS - 2, [])
    assert b1.read(lambda *f: called.append(f), 3) == 1 and called == [(3, 1, 0, 0, 1.0)]
    assert b1.read(lambda *f: called.append(f), 3) == 0  # step 4's waits for step 4
    assert b1.read(lambda *f: called.append(f), 4) == 1 and called[-1] == (4, 1, 0, 0, 2.0)
    for m in range(SLOTS):  # the ring is empty again
        assert b0.post(1, 5, 1, m, 0, 0.0)
    assert b1.read(None, 6) == 0 and b1.num_skipped == 2 * SLOTS - 2 and b1.num_read == 2


def test_a_consultation_sees_a_record_posted_just_before_it() -> None:
    """The reserved F2's notice, posted after the last decision, is read by `fits`: the
    candidate fits before the announced arrival (without it there is no estimate: it would
    not)."""
    pipe, shared = pipeline(3, 4, hint="1f1b", mode="ready")
    rt = runtime_of(pipe, 1)
    rt._board = shared[1]
    rt.forecast.new_step(lambda: 90.5)
    reserved, candidate = rt._own(Task(Kind.F, 2, 0)), rt._own(Task(Kind.B, 0, 0))
    rt._missing = {reserved: 1}
    rt.forecast.observe(candidate, 1.0)
    assert not rt.forecast.fits(candidate, reserved)
    assert shared[0].post(1, 4, 1, 2, 1_500_000, 90.0)  # F2 of stage 1, 1.5 s from 90.0
    assert rt._read_fits(candidate, reserved)
    assert rt.forecast.earliest_arrival(reserved) == 91.5 and shared[1].num_read == 1
    assert rt.failed == []
    pipe.close()


class Recorded(Forecast):
    """A forecast that notes its state at each consultation."""

    __slots__ = ("log",)

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[Any, ...]] = []

    def _note(self, *tasks: Task) -> None:
        self.log.append((self._now(), *map(str, tasks), sorted(map(str, self._expected.items())),
                         sorted(self._feeder.items())))

    def fits(self, candidate: Task, reserved: Task) -> bool:
        self._note(candidate, reserved)
        return super().fits(candidate, reserved)

    def clear_of_gradients(self, candidate: Task) -> bool:
        self._note(candidate)
        return super().clear_of_gradients(candidate)


def duration(info: TaskInfo) -> float:
    """Fixed, uneven durations: a deterministic run where reservations bind."""
    key = f"{info.stage} {info.microbatch} {int(info.kind)}".encode()
    return (0.25, 0.5, 1.0, 1.0, 2.0, 3.0)[zlib.crc32(key) % 6]


def run(policy: str, split: bool, eager: bool, R: int = 3, M: int = 8) -> tuple[Any, ...]:
    """Spans in order and every consultation's forecast of each rank over three steps; the
    board read before every decision (`eager`, what the runtime did before) or where the
    forecast is consulted."""
    hint = make_hint("1f1b", num_stages=R, num_microbatches=M, split_backward=split)
    caps = list(hint.default_caps)
    world = InprocWorld(R, delay=lambda src, dst, msg: 0.1 * (1 + (src + msg.microbatch) % 3))
    shared = boards(R)
    runtimes = []
    for r in range(R):
        world.endpoints[r].notice_board = shared[r]  # type: ignore[attr-defined]
        rt = RankRuntime(rank=r, hint=hint, mode="ready", cap=caps[r], executors=None,
                         device=SimDevice(duration, run_compute=False),
                         transport=world.endpoints[r], policy=policy, caps=caps)
        rt.forecast = Recorded()
        if eager:
            def check(rt: RankRuntime = rt) -> None:
                rt._board.read(rt._board_notice, rt.step_index)
                RankRuntime._check(rt)
            rt._check = check  # type: ignore[method-assign]
        runtimes.append(rt)

    async def main() -> None:
        async with asyncio.timeout(1e6):  # virtual seconds: a stall raises, never hangs
            for step in range(3):
                await asyncio.gather(*(rt.run_step(step) for rt in runtimes))

    run_virtual(main())
    spans = [[(s.kind, s.chunk, s.microbatch, s.start) for rep in rt.reports for s in rep.spans]
             for rt in runtimes]
    counts = [(b.num_posted, b.num_read, b.num_skipped, b.num_full) for b in shared]
    return spans, [rt.forecast.log for rt in runtimes], counts  # type: ignore[union-attr]


@pytest.mark.parametrize("policy,split", [("reserve", False), ("drain", True)])
def test_the_same_decisions_as_reading_before_every_decision(
        policy: str, split: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The forecasts are equal at every consultation with a late record's duration counted
    either way (Forecast.announced); without it, as before, the decisions are equal here."""
    spans, logs, counts = run(policy, split, eager=False)
    eager_spans, eager_logs, eager_counts = run(policy, split, eager=True)
    with monkeypatch.context() as patch:
        patch.setattr(Forecast, "announced", lambda self, task, duration: None)
        assert run(policy, split, eager=True)[0] == spans
    assert sum(len(log) for log in logs) > 0  # the forecast was consulted
    assert sum(c[1] for c in counts) > 0  # and records read for it
    assert spans == eager_spans
    assert logs == eager_logs  # the same forecast at every consultation
    posted, read, skipped, full = map(sum, zip(*counts))  # (each rank's board: posted by it)
    assert full == 0 and read + skipped == posted and posted == sum(c[0] for c in eager_counts)
    fewer = sum(c[1] for c in counts) - sum(c[1] for c in eager_counts)  # records read
    assert fewer < 0 if policy == "reserve" else fewer <= 0  # the drain consults at most pops


@pytest.mark.parametrize("policy,split", [("reserve", False), ("drain", True)])
def test_a_long_step_fills_no_ring_until_its_notices_outnumber_the_slots(
        policy: str, split: bool) -> None:
    """A neighbour that never consults its forecast (reserve) or not before its drain: a
    step's notices to it wait on the board. 128 microbatches fit in SLOTS, with no MPI
    fallback; 2 * SLOTS do not, and the surplus goes as Messages (counted as full), each
    step then dropping what was left unread."""
    _, _, counts = run(policy, split, eager=False, M=128)
    assert [c[3] for c in counts] == [0] * 3
    posted, read, skipped, _ = map(sum, zip(*counts))  # (each rank's board: posted by it)
    assert read + skipped == posted
    _, _, counts = run(policy, split, eager=False, M=2 * SLOTS)
    assert sum(c[3] for c in counts) > 0
    posted, read, skipped, _ = map(sum, zip(*counts))  # (each rank's board: posted by it)
    assert read + skipped == posted
