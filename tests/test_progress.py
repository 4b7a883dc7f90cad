"""The completion engine with fake sources: completes, parks, idles, wakes, and stays light."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from typing import Callable

import pytest

from aioready.clock import run_virtual
from aioready.errors import ConfigError
from aioready.progress import (
    CompletionSource,
    ProgressConfig,
    ProgressEngine,
    ProgressStatistics,
)


class FakeSource:
    """Items complete when their due time (loop clock) has passed."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: list[tuple[float, asyncio.Future[float]]] = []
        self.hot = False

    def add(self, delay: float) -> asyncio.Future[float]:
        fut = self.loop.create_future()
        self.items.append((self.loop.time() + delay, fut))
        return fut

    def poll(self) -> int:
        now = self.loop.time()
        done = [(t, f) for t, f in self.items if t <= now]
        self.items = [(t, f) for t, f in self.items if t > now]
        for _, f in done:
            f.set_result(now)
        return len(done)

    def num_pending(self) -> int:
        return len(self.items)

    def wants_hot(self) -> bool:
        return self.hot


def engine_with(source_cfg: ProgressConfig | None = None) -> tuple[ProgressEngine, FakeSource]:
    loop = asyncio.get_running_loop()
    engine = ProgressEngine(loop, source_cfg or ProgressConfig())
    src = FakeSource(loop)
    engine.add_source(src)
    return engine, src


def test_progress_imports_without_mpi4py_or_torch() -> None:
    code = ("import sys; sys.modules['mpi4py'] = None; sys.modules['torch'] = None; "
            "import aioready.progress, aioready.runtime.rank; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "ok", out.stderr


def test_fake_source_is_a_completion_source() -> None:
    assert isinstance(FakeSource(None), CompletionSource)  # type: ignore[arg-type]


def test_config_from_env_and_validation() -> None:
    cfg = ProgressConfig.from_env({"AIOREADY_SPIN_US": "500", "AIOREADY_PARK_US": "100",
                                   "AIOREADY_BACKOFF_MAX_MS": "4", "AIOREADY_YIELD_EVERY": "0",
                                   "AIOREADY_TIMER": "call_later"})
    assert cfg.spin_s == pytest.approx(500e-6) and cfg.park_s == pytest.approx(100e-6)
    assert cfg.backoff_max_s == pytest.approx(4e-3) and cfg.yield_every == 0
    assert cfg.timer == "call_later"
    assert ProgressConfig.from_env({}) == ProgressConfig()
    with pytest.raises(ConfigError, match="AIOREADY_SPIN_US is not a number"):
        ProgressConfig.from_env({"AIOREADY_SPIN_US": "fast"})
    with pytest.raises(ConfigError, match="expected auto | timerfd | call_later"):
        ProgressConfig(timer="select")
    with pytest.raises(ConfigError, match="park_s must be >= 0"):
        ProgressConfig(park_s=-1.0)


async def test_for_loop_returns_one_engine_per_loop() -> None:
    assert ProgressEngine.for_loop() is ProgressEngine.for_loop(asyncio.get_running_loop())


async def until(condition: Callable[[], bool]) -> None:
    """Wait, on a real loop, until `condition()` holds: the tests below assert on what happened
    in order, not on how many passes fit in some wall-clock time (the test timeout ends a hang)."""
    while not condition():
        await asyncio.sleep(0.005)


async def test_completes_and_then_idles_without_polling() -> None:
    engine, src = engine_with()
    fut = src.add(0.005)
    await asyncio.wait_for(fut, 5)
    assert engine.statistics().num_completed == 1  # the engine's poll completed it
    before = engine.statistics()
    await asyncio.sleep(0.1)  # nothing pending: the poller waits on a future, no passes at all
    after = engine.statistics()
    assert after.num_pending == 0
    assert after.num_hot_passes == before.num_hot_passes
    assert after.num_parks == before.num_parks
    assert after.num_idle_waits >= 1
    engine.close()


async def test_long_wait_parks_instead_of_spinning() -> None:
    engine, src = engine_with(ProgressConfig(spin_s=1e-3, park_window_s=20e-3))
    fut = src.add(10.0)  # never completes during the test
    await until(lambda: engine.num_parks >= 3)  # past the spin window: parked on the timerfd
    s0 = engine.statistics()
    await until(lambda: engine.num_parks >= s0.num_parks + 10)  # the timerfd keeps waking it
    s1 = engine.statistics()
    assert s0.timer == "timerfd"
    assert s1.num_hot_passes == s0.num_hot_passes, "the poller kept spinning while idle"
    assert s1.num_completed == 0 and not fut.done()
    fut.cancel()
    engine.close()


def test_parks_back_off_to_the_longest_park_in_a_long_bubble() -> None:
    """On the virtual clock the park policy is exact: 0.1 s into a bubble (past the 20 ms park
    window) every park is backoff_max_s long, so 0.2 s hold 0.2 / 8 ms = 25 parks."""
    async def main() -> tuple[ProgressStatistics, ProgressStatistics]:
        engine, src = engine_with(ProgressConfig(park_s=250e-6, park_window_s=20e-3,
                                                 backoff_max_s=8e-3))
        fut = src.add(10.0)
        await asyncio.sleep(0.1)
        s0 = engine.statistics()
        await asyncio.sleep(0.2)
        s1 = engine.statistics()
        fut.cancel()
        engine.close()
        return s0, s1

    s0, s1 = run_virtual(main())
    assert s1.num_parks - s0.num_parks == 25
    assert s1.num_hot_passes == 0  # time only moves while the loop sleeps: never spin there


async def test_wants_hot_keeps_polling_hot_then_gives_up() -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()  # at or before the engine's last progress (its first kick)
    engine, src = engine_with(ProgressConfig(spin_s=1e-3, hot_max_s=0.4))
    src.hot = True
    fut = src.add(10.0)
    await until(lambda: engine.num_hot_passes >= 10)
    await until(lambda: engine.num_parks >= 1)  # capped: parks at park_s
    # the first park comes only once hot_max_s of loop time has passed without progress
    assert loop.time() - start >= 0.4
    s0 = engine.statistics()
    await until(lambda: engine.num_parks >= s0.num_parks + 10)
    assert engine.statistics().num_hot_passes == s0.num_hot_passes  # it stays parked
    fut.cancel()
    engine.close()


async def test_kick_wakes_an_idle_engine() -> None:
    engine, src = engine_with()
    await asyncio.sleep(0.02)
    assert engine.statistics().num_idle_waits >= 1
    fut = src.add(0.0)
    engine.kick()
    await asyncio.wait_for(fut, 1.0)
    engine.close()


async def test_raising_source_is_removed_and_others_keep_completing(caplog) -> None:
    engine, src = engine_with()

    class Broken:
        def poll(self) -> int:
            raise RuntimeError("boom")

        def num_pending(self) -> int:
            return 1

        def wants_hot(self) -> bool:
            return False

    with caplog.at_level(logging.ERROR, logger="aioready.progress"):
        engine.add_source(Broken())
        fut = src.add(0.001)
        await asyncio.wait_for(fut, 5)
    assert "raised in poll()" in caplog.text
    assert engine.statistics().num_sources == 1
    engine.close()


def test_virtual_clock_uses_call_later_and_completes_in_virtual_time() -> None:
    async def main() -> tuple[float, str]:
        engine, src = engine_with()
        t0 = asyncio.get_running_loop().time()
        done = await src.add(0.5)
        kind = engine.statistics().timer
        engine.close()
        return done - t0, kind

    took, kind = run_virtual(main())
    assert kind == "call_later"
    assert 0.5 <= took <= 0.5 + ProgressConfig().backoff_max_s + 1e-9


class BellSource(FakeSource):
    """A FakeSource whose items arrive when `ring()` is called, as a doorbell would say."""

    def __init__(self, loop: asyncio.AbstractEventLoop, engine: ProgressEngine,
                 can_arm: bool = True) -> None:
        super().__init__(loop)
        self.engine = engine
        self.can_arm = can_arm
        self.armed = False
        self.num_armed = 0
        self.num_rung = 0
        self.num_polls = 0

    def poll(self) -> int:
        self.num_polls += 1
        return super().poll()

    def arm_doorbell(self) -> bool:
        if self.can_arm:
            self.armed = True
            self.num_armed += 1
        return self.can_arm

    def disarm_doorbell(self) -> None:
        self.armed = False

    def arrive(self, ring: bool = True, named: bool = False) -> None:
        """The item is due now; ring only if the engine armed the doorbell (as a sender does);
        `ring=False`: a sender that missed the armed doorbell; `named`: the ring names this
        source (`ring(self)`, as the MPI transport's does), so the engine may poll it at once."""
        self.items = [(self.loop.time(), f) for _, f in self.items]
        if self.armed and ring:
            self.num_rung += 1
            self.engine.ring(self if named else None)


def _bell_engine(loop: asyncio.AbstractEventLoop, **config: object
                 ) -> tuple[ProgressEngine, BellSource]:
    """An engine of `config` (ProgressConfig's fields) with one BellSource added."""
    engine = ProgressEngine(loop, ProgressConfig(**config))  # type: ignore[arg-type]
    src = BellSource(loop, engine)
    engine.add_source(src)
    return engine, src


@pytest.mark.parametrize("can_arm", [True, False], ids=["doorbell", "timer-only"])
def test_a_parked_engine_wakes_on_the_doorbell_not_the_timer(can_arm: bool) -> None:
    """In a long bubble (8 ms parks, and an 8 ms backstop on the doorbell) a source that can arm
    its doorbell is parked on it: the item is completed the instant it arrives and rings, and
    the next parks are disarmed again. A source without a doorbell waits for the next timer
    park (the plain policy)."""
    async def main() -> tuple[float, BellSource, ProgressStatistics]:
        loop = asyncio.get_running_loop()
        engine = ProgressEngine(loop, ProgressConfig(park_s=250e-6, park_window_s=20e-3,
                                                     backoff_max_s=8e-3, bell_backstop_s=8e-3))
        src = BellSource(loop, engine, can_arm)
        engine.add_source(src)
        fut = src.add(100.0)  # pending, due only when it "arrives"
        await asyncio.sleep(0.1003)  # past the park window: parks are 8 ms apart
        t0 = loop.time()
        src.arrive()
        done = await fut
        stats = engine.statistics()
        engine.close()
        return done - t0, src, stats

    took, src, stats = run_virtual(main())
    if can_arm:
        assert took == 0.0 and src.num_rung == 1, took
        assert src.num_armed >= 10 and not src.armed  # every long park armed it, then disarmed
    else:
        assert 0.0 < took <= 8e-3 + 1e-9 and src.num_rung == 0 and src.num_armed == 0, took


@pytest.mark.parametrize("busy_sleep", [True, False], ids=["busy-sleep", "busy-parks"])
def test_a_busy_engine_sleeps_through_the_task_and_polls_when_it_ends(busy_sleep: bool) -> None:
    """While a task runs (`set_waiting(False)`), with `busy_sleep`, an engine whose sources could
    arm a doorbell sleeps with only the backstop timer and asks for no rings: 0.2 s hold 4 parks
    of 50 ms, where busy timer parks (the default: 5 ms, backing off to 8) are 20-40. An item that
    arrives meanwhile rings nobody either way; with `busy_sleep` it is completed the moment the
    runtime says its task ended (`task_ended()` polls), by default at the next timer park."""
    async def main() -> tuple[float, int, ProgressEngine, BellSource]:
        loop = asyncio.get_running_loop()
        engine, src = _bell_engine(loop, busy_park_s=5e-3, bell_backstop_s=50e-3,
                                         busy_sleep=busy_sleep)
        engine.set_waiting(False)
        fut = src.add(100.0)
        await asyncio.sleep(0.0003)
        s0 = engine.statistics()
        await asyncio.sleep(0.2)
        s1 = engine.statistics()
        src.arrive()
        if busy_sleep:
            await asyncio.sleep(0.001)
            assert not fut.done()  # no ring, no timer yet: it waits for the task's end
        t0 = loop.time()
        engine.task_ended()
        done = await fut
        engine.close()
        return done - t0, s1.num_parks - s0.num_parks, engine, src

    took, parks, engine, src = run_virtual(main())
    assert src.num_rung == 0 and engine.num_rings == 0
    if busy_sleep:
        assert took == 0.0, took
        assert 3 <= parks <= 5, parks
        assert engine.num_task_parks >= parks
    else:
        assert 0.0 < took <= 8e-3 + 1e-9, took  # 5 ms parks, backing off to 8 ms
        assert 20 <= parks <= 40, parks
        assert engine.num_task_parks == 0


def test_a_missed_ring_is_found_by_the_backstop_and_counted() -> None:
    """A sender that misses the armed doorbell (the race doorbell.py bounds) costs at most the
    backstop, and the engine counts the miss (bench/oversub reports it)."""
    async def main() -> tuple[float, ProgressEngine]:
        loop = asyncio.get_running_loop()
        engine, src = _bell_engine(loop, bell_backstop_s=50e-3)
        engine.set_waiting(True)
        fut = src.add(100.0)
        await asyncio.sleep(0.1)
        t0 = loop.time()
        await asyncio.sleep(0.0203)  # not on a backstop's instant
        src.arrive(ring=False)
        done = await fut
        engine.close()
        return done - t0, engine

    took, engine = run_virtual(main())
    assert 0.0 < took <= 50e-3 + 1e-9, took
    assert engine.num_missed_rings == 1 and engine.num_rings == 0


@pytest.mark.parametrize("spin_s", [0.0, 2e-3], ids=["oversubscribed", "spin-window"])
def test_starting_to_wait_leaves_a_doorbell_park_alone_without_a_spin_window(
        spin_s: float) -> None:
    """An arbiter that starts waiting while the engine is parked on its doorbells (it parked
    there while the previous wait ended, and stayed through the task) needs no kick when there
    is no spin window to start: the next message rings anyway. The park goes on (no new poll,
    no new doorbell park), and the item that arrives then is completed at once. With a spin
    window the kick still ends the park (the engine polls again; hot polls on a real clock)."""
    async def main() -> tuple[float, int, int, ProgressEngine]:
        loop = asyncio.get_running_loop()
        engine, src = _bell_engine(loop, spin_s=spin_s, bell_backstop_s=50e-3)
        engine.set_waiting(True)
        fut = src.add(100.0)
        await asyncio.sleep(0.0203)  # parked on the doorbell by now (after any spin window)
        engine.set_waiting(False)
        assert src.armed
        parks, polls = engine.num_doorbell_parks, src.num_polls
        engine.set_waiting(True)
        await asyncio.sleep(0.001)
        parks, polls = engine.num_doorbell_parks - parks, src.num_polls - polls
        t0 = loop.time()
        src.arrive()
        done = await fut
        engine.close()
        return done - t0, parks, polls, engine

    took, parks, polls, engine = run_virtual(main())
    assert took == 0.0 and engine.num_rings == 1, took
    if spin_s:
        assert polls >= 1
    else:
        assert parks == 0 and polls == 0, (parks, polls)


@pytest.mark.parametrize("spin_s", [0.0, 2e-3], ids=["oversubscribed", "spin-window"])
@pytest.mark.parametrize("named", [True, False], ids=["ring-polls", "ring-wakes-the-task"])
def test_a_ring_that_names_its_source_delivers_in_the_callback_and_the_park_goes_on(
        named: bool, spin_s: float) -> None:
    """A waiting engine parked on its doorbell, rung by a source that names itself: the item is
    completed inside `ring()` (before the loop runs anything else), the doorbell stays armed and
    no new doorbell park starts (no wake-up of the engine's task); a second item later is
    completed the same way. With a spin window the engine's task still wakes after it (to
    spin, as before). A ring that names no source wakes the engine's task, which polls."""
    async def main() -> tuple[list[bool], int, int, bool, ProgressEngine]:
        loop = asyncio.get_running_loop()
        engine, src = _bell_engine(loop, spin_s=spin_s, bell_backstop_s=50e-3)
        engine.set_waiting(True)
        at_once = []
        for _ in range(2):
            fut = src.add(100.0)
            engine.kick()  # new work (an engine left idle by the previous item sees it)
            await asyncio.sleep(0.0103)  # parked on the doorbell (after any spin window)
            assert src.armed
            parks, polls = engine.num_doorbell_parks, src.num_polls
            src.arrive(named=named)
            at_once.append(fut.done())
            await fut
            await asyncio.sleep(0)
            parks, polls = engine.num_doorbell_parks - parks, src.num_polls - polls
        armed = src.armed
        engine.close()
        return at_once, parks, polls, armed, engine

    at_once, parks, polls, armed, engine = run_virtual(main())
    if named:
        assert at_once == [True, True] and engine.num_ring_polls == 2
        assert engine.num_rings == 0
        if not spin_s:
            assert parks == 0 and polls == 1 and armed, (parks, polls)
    else:
        assert at_once == [False, False] and engine.num_ring_polls == 0
        assert engine.num_rings == 2 and polls >= 1, polls


def test_rings_answered_in_the_callback_push_the_backstop_back() -> None:
    """A doorbell park kept alive by rings answered in the callback is not ended by its 50 ms
    backstop while they come (every 20 ms here: no poll of the engine's own, no new park), and
    the backstop still ends it 50 ms after the last one."""
    async def main() -> tuple[int, int, int, int, ProgressEngine]:
        loop = asyncio.get_running_loop()
        engine, src = _bell_engine(loop, spin_s=0.0, bell_backstop_s=50e-3)
        engine.set_waiting(True)
        src.add(1e9)  # always something pending: the engine parks, never idles
        await asyncio.sleep(0.0103)
        parks, polls = engine.num_doorbell_parks, src.num_polls
        for _ in range(10):
            fut = src.add(100.0)
            src.arrive(named=True)
            assert fut.done()
            src.add(1e9)
            await asyncio.sleep(0.020)
        parks, polls = engine.num_doorbell_parks - parks, src.num_polls - polls
        later = engine.num_doorbell_parks
        await asyncio.sleep(0.060)  # silence: the backstop ends the park, a new one begins
        later = engine.num_doorbell_parks - later
        engine.close()
        return parks, polls, later, engine.num_ring_polls, engine

    parks, polls, later, ring_polls, engine = run_virtual(main())
    assert ring_polls == 10 and engine.num_missed_rings == 0
    assert parks == 0 and polls == 10, (parks, polls)
    assert later == 1, later


@pytest.mark.parametrize("spin_s", [0.0, 2e-3], ids=["oversubscribed", "spin-window"])
def test_a_wait_starts_with_one_poll_after_arming(spin_s: float) -> None:
    """Without a spin window, an engine kicked from a busy timer park into a wait arms its
    doorbells and polls once (the doorbell park's poll), not also once before arming. With a
    spin window the wait starts hot, as before (several polls)."""
    async def main() -> tuple[int, bool, bool]:
        loop = asyncio.get_running_loop()
        engine, src = _bell_engine(loop, spin_s=spin_s, busy_park_s=5e-3, bell_backstop_s=50e-3)
        engine.set_waiting(False)
        src.add(1e9)
        await asyncio.sleep(0.0023)  # in a busy timer park
        polls = src.num_polls
        engine.set_waiting(True)
        await asyncio.sleep(0.0101)
        polls, armed = src.num_polls - polls, src.armed
        engine.close()
        return polls, armed, engine.num_doorbell_parks > 0

    polls, armed, parked = run_virtual(main())
    assert armed and parked
    assert polls == 1 if not spin_s else polls >= 1, polls


def test_a_named_ring_falls_back_to_waking_the_task() -> None:
    """The named ring's poll is only a shortcut: when it completes nothing (the message is not
    matched yet), when the source then refuses to arm (a request now needs polling), or when
    the engine is busy (a task runs), the engine's task wakes and polls as for any ring."""
    async def main() -> list[tuple[bool, int, int]]:
        loop = asyncio.get_running_loop()
        engine, src = _bell_engine(loop, spin_s=0.0, bell_backstop_s=50e-3)
        seen = []
        for case in ("nothing-yet", "needs-polling", "busy"):
            engine.set_waiting(case != "busy")
            fut = src.add(100.0)
            engine.kick()
            await asyncio.sleep(0.0103)
            if case == "busy":  # the task started while parked on the doorbell
                engine.set_waiting(True)
                await asyncio.sleep(0.0103)
                engine.set_waiting(False)
            assert src.armed
            rings, ring_polls = engine.num_rings, engine.num_ring_polls
            if case == "nothing-yet":  # rung before the item shows: the grace parks find it
                src.num_rung += 1
                engine.ring(src)
                src.arrive(ring=False)
            else:
                src.can_arm = case != "needs-polling"
                src.arrive(named=True)
            done = fut.done()
            await fut
            await asyncio.sleep(0.001)  # the engine's task ran
            src.can_arm = True
            seen.append((done, engine.num_rings - rings, engine.num_ring_polls - ring_polls))
        engine.close()
        return seen

    seen = run_virtual(main())
    assert seen[0] == (False, 1, 0), seen
    assert seen[1] == (True, 1, 0), seen  # completed by the named poll, then the task woke
    assert seen[2] == (False, 1, 0), seen


@pytest.mark.parametrize("busy_sleep", [True, False], ids=["busy-sleep", "busy-parks"])
def test_a_task_that_starts_in_a_doorbell_park_is_not_rung_with_busy_sleep(
        busy_sleep: bool) -> None:
    """The message that ends a wait is delivered by a doorbell park's poll, and the task starts
    while the engine is still parked there. With `busy_sleep` that park becomes a park through
    the task at once: the doorbell is disarmed (the task's first message rings nobody), no poll
    runs, and the item is completed when `task_ended()` polls. Without it the doorbell stays
    armed and the first message rings the busy rank (the default's behaviour, unchanged)."""
    async def main() -> tuple[int, int, bool, BellSource, ProgressEngine]:
        loop = asyncio.get_running_loop()
        engine, src = _bell_engine(loop, spin_s=0.0, bell_backstop_s=50e-3, busy_sleep=busy_sleep)
        engine.set_waiting(True)
        fut = src.add(100.0)
        await asyncio.sleep(0.002)  # parked on the doorbell
        assert src.armed
        polls = src.num_polls
        engine.set_waiting(False)  # a task starts
        armed = src.armed
        await asyncio.sleep(0.010)
        src.arrive()
        await asyncio.sleep(0.001)
        if busy_sleep:
            assert not fut.done()
            engine.task_ended()
        await fut
        polls = src.num_polls - polls
        engine.close()
        return polls, engine.num_missed_rings, armed, src, engine

    polls, missed, armed, src, engine = run_virtual(main())
    if busy_sleep:
        assert not armed and src.num_rung == 0 and engine.num_rings == 0
        assert polls == 1 and missed == 0, polls  # task_ended()'s poll, no other
    else:
        assert armed and src.num_rung == 1 and engine.num_rings == 1


@pytest.mark.parametrize("lead_s", [1e-3, 0.0], ids=["lead", "busy-parks"])
@pytest.mark.parametrize("from_doorbell", [False, True], ids=["timer-park", "doorbell-park"])
def test_a_paced_task_gets_one_poll_before_its_end(lead_s: float, from_doorbell: bool) -> None:
    """With `task_lead_s`, a busy engine told when its task ends (`task_ends_at`, from the
    paced device) parks once until `lead` before the end, polls there, and parks through to the
    end, where `task_ended()` polls: an item that arrived mid-task is completed at the lead
    poll, rung by nobody, and a 20 ms task holds 2 parks, where 5 ms busy parks are 4-5. A task
    that starts in a doorbell park (the wait's last message) re-times that park and disarms
    it. Without the knob the hint changes nothing."""
    async def main() -> tuple[float, int, BellSource, ProgressEngine]:
        loop = asyncio.get_running_loop()
        engine, src = _bell_engine(loop, spin_s=0.0, busy_park_s=5e-3, bell_backstop_s=50e-3,
                                         task_lead_s=lead_s)
        keep = BellSource(loop, engine)  # the next header, always awaited (as MPI's is)
        engine.add_source(keep)
        keep.add(1000.0)
        engine.set_waiting(from_doorbell)
        fut = src.add(100.0)
        await asyncio.sleep(0.0021)
        assert src.armed == from_doorbell
        engine.set_waiting(False)  # a task starts, and says when it ends
        start = loop.time()
        parks = engine.num_parks
        engine.task_ends_at(start + 0.020)
        assert not src.armed or not lead_s
        await asyncio.sleep(0.010)
        src.arrive()
        done = await fut
        await asyncio.sleep(start + 0.020 - loop.time())
        parks = engine.num_parks - parks
        engine.task_ended()
        engine.close()
        return done - start, parks, src, engine

    took, parks, src, engine = run_virtual(main())
    if lead_s:
        assert took == pytest.approx(0.019) and src.num_rung == 0, took
        assert parks == 2, parks
    elif from_doorbell:
        assert took == pytest.approx(0.010) and src.num_rung == 1, took  # the default: rung
    else:
        assert 0.010 < took <= 0.015 + 1e-9 and src.num_rung == 0, took
        assert 4 <= parks <= 5, parks


@pytest.mark.parametrize("disarm", [True, False], ids=["disarmed", "switch-off"])
def test_a_task_on_the_loop_thread_is_not_rung_and_its_park_goes_on(disarm: bool) -> None:
    """A task computes on the loop thread (devices/cpu.py's quiet path) while the engine is
    parked on its doorbells: nothing can answer a ring then, so the doorbells are disarmed for
    the task and a message that arrives meanwhile rings nobody; at the task's end they are
    re-armed, one poll delivers the message, and the park goes on (no new doorbell park, no
    ring counted, no wake-up of the engine's task). With the switch off the message rings the
    rank during the task: the end's poll delivers it all the same, and the ring then ends the
    park for nothing (a ring counted, and the grace parks after it)."""
    async def main() -> tuple[bool, bool, int, int, bool, BellSource, ProgressEngine]:
        loop = asyncio.get_running_loop()
        engine, src = _bell_engine(loop, spin_s=0.0, bell_backstop_s=50e-3, inline_disarm=disarm)
        engine.set_waiting(True)
        src.add(1e9)  # always something pending: the engine parks, never idles
        fut = src.add(100.0)
        await asyncio.sleep(0.002)  # parked on the doorbell
        assert src.armed
        parks, polls = engine.num_doorbell_parks, src.num_polls
        engine.set_waiting(False)  # a task starts, on the loop thread
        engine.inline_task_begins()
        src.arrive()  # its message comes during the task
        armed_during = src.armed
        engine.inline_task_ends()
        delivered = fut.done()
        await asyncio.sleep(0.001)
        parks, polls = engine.num_doorbell_parks - parks, src.num_polls - polls
        armed_after = src.armed
        engine.close()
        return armed_during, delivered, parks, polls, armed_after, src, engine

    armed_during, delivered, parks, polls, armed_after, src, engine = run_virtual(main())
    assert delivered  # the task's-end poll, either way
    if disarm:
        assert not armed_during and src.num_rung == 0 and engine.num_rings == 0
        assert armed_after and parks == 0 and polls == 2, (parks, polls)  # and a dry one
    else:
        assert armed_during and src.num_rung == 1 and engine.num_rings == 1


def test_a_park_through_loop_thread_tasks_keeps_its_backstop_back_and_yields_to_polling() -> None:
    """Tasks on the loop thread every 20 ms keep a doorbell park going: each end's poll pushes
    its 50 ms backstop back (no poll of the engine's own, no new park), and the backstop still
    ends it 50 ms after the last. A source that refuses to re-arm at a task's end (a request it
    now tracks needs polling) ends the park: the engine's task wakes and parks on a timer."""
    async def main() -> tuple[int, int, int, bool, int]:
        loop = asyncio.get_running_loop()
        engine, src = _bell_engine(loop, spin_s=0.0, bell_backstop_s=50e-3, inline_disarm=True)
        engine.set_waiting(True)
        src.add(1e9)
        await asyncio.sleep(0.0103)
        parks, polls = engine.num_doorbell_parks, src.num_polls
        for _ in range(10):
            engine.set_waiting(False)
            engine.inline_task_begins()
            engine.inline_task_ends()
            engine.set_waiting(True)
            await asyncio.sleep(0.020)
        parks, polls = engine.num_doorbell_parks - parks, src.num_polls - polls
        later = engine.num_doorbell_parks
        await asyncio.sleep(0.060)  # no task: the backstop ends the park, a new one begins
        later = engine.num_doorbell_parks - later
        engine.set_waiting(False)
        engine.inline_task_begins()
        src.can_arm = False
        engine.inline_task_ends()
        await asyncio.sleep(0.001)
        woke = not src.armed and engine.num_parks
        engine.close()
        return parks, polls, later, bool(woke), engine.num_inline_disarms

    parks, polls, later, woke, disarms = run_virtual(main())
    assert parks == 0 and polls == 10, (parks, polls)
    assert later == 1 and woke and disarms == 11, (later, disarms)


class OneAtATime(BellSource):
    """A BellSource whose poll completes one due item (a poll that matched an older message and
    missed the one that came since MPI's last call, as MPICH may)."""

    def poll(self) -> int:
        self.num_polls += 1
        now = self.loop.time()
        for i, (t, f) in enumerate(self.items):
            if t <= now:
                del self.items[i]
                f.set_result(now)
                return 1
        return 0


def test_a_loop_thread_tasks_end_polls_until_dry() -> None:
    """Messages that came during a task on the loop thread rang nobody: the task's end polls
    until a poll completes nothing, so none is left waiting for a ring that will not come (it
    waited for the 50 ms backstop: bench.e2e 1f1b/ready steps 0.83 -> 1.07 s before)."""
    async def main() -> tuple[bool, int]:
        loop = asyncio.get_running_loop()
        engine = ProgressEngine(loop, ProgressConfig(spin_s=0.0, bell_backstop_s=50e-3,
                                                     inline_disarm=True))
        src = OneAtATime(loop, engine)
        engine.add_source(src)
        engine.set_waiting(True)
        src.add(1e9)
        futs = [src.add(100.0) for _ in range(3)]
        await asyncio.sleep(0.002)
        engine.set_waiting(False)
        engine.inline_task_begins()
        src.arrive()
        polls = src.num_polls
        engine.inline_task_ends()
        done = all(f.done() for f in futs)
        polls = src.num_polls - polls
        engine.close()
        return done, polls

    done, polls = run_virtual(main())
    # four items come (arrive() makes every one due), one a poll, then a dry poll
    assert done and polls == 5, polls
