"""The completion engine: one polling coroutine per event loop completes every MPI request and
CUDA event of the rank (docs/async.md "The completion engine").

MPI has no file descriptor to wait on, and a helper thread blocked in `MPI_Waitany` spins a core
and fights MPICH's global lock (docs/async.md "Why polling on the loop thread"), so completion is
polled on the loop thread. Every completion source (MPI requests, CUDA events, fakes in the
simulator) sits behind one small protocol, `CompletionSource`; the engine only decides *when* to
poll:

- **hot** (`await asyncio.sleep(0)`, ~1 us per pass on uvloop) while a source says a transfer needs
  progress (`wants_hot()`: a rendezvous-size message is in flight), for `spin_s` after the last
  completion or `kick()`, or until a deadline set with `stay_hot()`. A 2 ms window, not 200 us:
  shorter windows let two ranks drift into missing each other by one sleep (docs/async.md "Spin,
  park, back off"). The window must also have been spent on a CPU (thread time), so a preempted
  poller does not park before it ever looked; `wants_hot()` alone keeps it hot for at most
  `hot_max_s`. Optionally (`yield_every`, off by default) the poller calls `sched_yield()` every so
  many hot passes, for ranks forced to share a core; measured here it hurt more than it helped once
  the ranks were bound to their own cores (it hands the core to unrelated processes): bind instead.
- **parked** on a timerfd registered with `loop.add_reader` otherwise: `park_s` (250 us) for
  `park_window_s` after the last progress, then longer, growing with the quiet time up to
  `backoff_max_s`, for long bubbles (~1-4 % CPU here, bench/results/transport.md). When every
  source with something pending has a doorbell (the MPI transport with all ranks on one host,
  transports/doorbell.py), a waiting park arms them and sleeps until one rings, with
  `bell_backstop_s` (50 ms) as a backstop only: the message wakes the rank, not a timer sweep
  (bench/results/oversub.md: 8 and 16 ranks on 2 cores). While the arbiter waits, a ring that
  names its source (`ring(source)`) is answered in the loop's reader callback: the source is
  polled there and the park goes on (docs/hot_path_measurements.md "The idle wake-up
  traced").
  Not `asyncio.sleep`: uvloop turns sub-millisecond sleeps into 0 (a spin) and the default loop
  stretches them to ~1.1 ms. Without a timerfd (non-Linux, or a loop without `add_reader` such as
  the virtual clock) the engine falls back to `loop.call_later` with at least `min_sleep_s` (1 ms);
  on the virtual clock it never spins (time only moves while the loop sleeps) and parks exactly.
- **idle** on a future (0 % CPU) when no source has anything pending; `kick()` wakes it.

The runtime tells the engine whether its arbiter is *waiting* (nothing ready: the next message
is on the critical path) or *busy* (a task is running: arrivals only matter when it ends), via
`set_waiting()`. Waiting: the spin window and `park_s` apply and the park never backs off.
Busy: no spin window (a spinning loop thread steals the CPU and the GIL from the task it waits
for) and parks of `busy_park_s`, unless a large transfer needs progress (`wants_hot`); where the
sources have doorbells and nothing is tracked, `busy_sleep` (off by default) has a busy engine
sleep through the task instead, with no rings and only the backstop, and the runtime's
`task_ended()` poll before the arbiter decides (`_park_through_task`); `task_lead_s` (off by
default) is the middle way for a paced task, whose end is known (`task_ends_at`): one poll that
long before the end, then through to it (docs/hot_path_measurements.md "A task's end").
Measured in
bench/e2e (4 ranks on 2 cores, 20 ms tasks): with the plain policy a rank waiting through a long
bubble backed off to 8 ms parks and each such wake-up added milliseconds to the critical path.
When more ranks share the host than it has cores (`oversubscribed`), spinning only takes time
from the other ranks, so `spin_s` defaults to 0 there.

Knobs live in `ProgressConfig` and are read once from `AIOREADY_*` environment variables.
This module imports neither mpi4py nor torch.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
import types
import weakref
from dataclasses import dataclass, fields
from typing import Generator, Protocol, runtime_checkable

from .clock import clock_of, virtual_clock
from .errors import ConfigError
from .timerfd import TimerFd

__all__ = ["CompletionSource", "ProgressConfig", "ProgressEngine", "ProgressStatistics"]

log = logging.getLogger(__name__)


@runtime_checkable
class CompletionSource(Protocol):
    """The whole surface the engine needs from a source of completions.

    - `poll()`: complete what has finished (resolve futures, call handlers); return how many.
      Runs on the loop thread and must not block.
    - `num_pending()`: items still outstanding; 0 lets the engine sleep until `kick()`.
    - `wants_hot()`: True while an outstanding item only moves when polled (MPI rendezvous).

    Optional: `arm_doorbell() -> bool` and `disarm_doorbell()`, for a source that can wake the
    engine itself (it calls `ring()`) while it is parked: see `ProgressEngine._arm_doorbells`.
    """

    def poll(self) -> int: ...

    def num_pending(self) -> int: ...

    def wants_hot(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class ProgressConfig:
    """Polling policy knobs (seconds); env: AIOREADY_SPIN_US, AIOREADY_PARK_US, ..."""

    spin_s: float = 2e-3  # AIOREADY_SPIN_US: stay hot this long after progress or a kick
    park_s: float = 250e-6  # AIOREADY_PARK_US: timerfd period once the spin window is over
    park_window_s: float = 50e-3  # AIOREADY_PARK_WINDOW_MS: how long to park at park_s
    backoff_max_s: float = 8e-3  # AIOREADY_BACKOFF_MAX_MS: longest park in a long bubble
    hot_max_s: float = 0.25  # AIOREADY_HOT_MAX_MS: cap on spinning for wants_hot() alone
    min_sleep_s: float = 1e-3  # AIOREADY_MIN_SLEEP_MS: shortest park without a timerfd
    busy_park_s: float = 5e-3  # AIOREADY_BUSY_PARK_US: timerfd period while a task runs
    bell_backstop_s: float = 50e-3  # AIOREADY_BELL_BACKSTOP_MS: longest park on a doorbell
    busy_sleep: bool = False  # AIOREADY_BUSY_SLEEP=1: sleep through tasks (_park_through_task)
    task_lead_s: float = 0.0  # AIOREADY_TASK_LEAD_US: one poll this long before a known end
    inline_disarm: bool = False  # AIOREADY_INLINE_DISARM=1: no rings into a loop-thread task
    yield_every: int = 0  # AIOREADY_YIELD_EVERY: hot passes between sched_yield() (0: never)
    timer: str = "auto"  # AIOREADY_TIMER: auto | timerfd | call_later

    _ENV = {"spin_s": ("AIOREADY_SPIN_US", 1e-6), "park_s": ("AIOREADY_PARK_US", 1e-6),
            "park_window_s": ("AIOREADY_PARK_WINDOW_MS", 1e-3),
            "backoff_max_s": ("AIOREADY_BACKOFF_MAX_MS", 1e-3),
            "hot_max_s": ("AIOREADY_HOT_MAX_MS", 1e-3),
            "min_sleep_s": ("AIOREADY_MIN_SLEEP_MS", 1e-3),
            "busy_park_s": ("AIOREADY_BUSY_PARK_US", 1e-6),
            "bell_backstop_s": ("AIOREADY_BELL_BACKSTOP_MS", 1e-3),
            "task_lead_s": ("AIOREADY_TASK_LEAD_US", 1e-6)}

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and not value >= 0:
                raise ConfigError(f"progress knob {f.name} must be >= 0", expected=">= 0",
                                  got=value)
        if self.timer not in ("auto", "timerfd", "call_later"):
            raise ConfigError("progress knob timer", expected="auto | timerfd | call_later",
                              got=repr(self.timer))

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, *,
                 oversubscribed: bool = False) -> "ProgressConfig":
        """Defaults overridden by AIOREADY_* variables (units in the variable name); an
        oversubscribed host (more local ranks than cores) defaults to no spin window."""
        env = os.environ if environ is None else environ
        kwargs: dict[str, object] = {"spin_s": 0.0} if oversubscribed else {}
        for name, (var, unit) in cls._ENV.items():  # type: ignore[attr-defined]
            if var in env:
                try:
                    kwargs[name] = float(env[var]) * unit
                except ValueError:
                    raise ConfigError(f"{var} is not a number", expected="a number",
                                      got=repr(env[var])) from None
        if "AIOREADY_YIELD_EVERY" in env:
            try:
                kwargs["yield_every"] = int(env["AIOREADY_YIELD_EVERY"])
            except ValueError:
                raise ConfigError("AIOREADY_YIELD_EVERY is not an integer", expected="an "
                                  "integer", got=repr(env["AIOREADY_YIELD_EVERY"])) from None
        if "AIOREADY_TIMER" in env:
            kwargs["timer"] = env["AIOREADY_TIMER"]
        if "AIOREADY_BUSY_SLEEP" in env:
            kwargs["busy_sleep"] = env["AIOREADY_BUSY_SLEEP"] not in ("", "0")
        if "AIOREADY_INLINE_DISARM" in env:
            kwargs["inline_disarm"] = env["AIOREADY_INLINE_DISARM"] not in ("", "0")
        return cls(**kwargs)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class ProgressStatistics:
    """Counters since the engine started (for benches and stall dumps)."""

    num_sources: int
    num_pending: int
    num_completed: int
    num_hot_passes: int
    num_parks: int
    num_idle_waits: int
    timer: str


_BELL_GRACE = 8  # timer parks after a doorbell woke the engine (see _park_on_doorbells)
_DRY_POLLS = 8  # polls at most after a task on the loop thread (_poll_dry)

_ENGINES: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, ProgressEngine]" = (
    weakref.WeakKeyDictionary())


class ProgressEngine:
    """The one completion engine of an event loop; get it with `ProgressEngine.for_loop()`."""

    def __init__(self, loop: asyncio.AbstractEventLoop,
                 config: ProgressConfig | None = None) -> None:
        self.loop = loop
        self.config = config or ProgressConfig.from_env()
        self._sources: tuple[CompletionSource, ...] = ()  # a tuple: each pass polls a snapshot
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Future[None] | None = None
        self._last_progress = loop.time()
        self._cpu_mark: float | None = None  # thread CPU time at the first hot pass after it
        self._hot_until = 0.0
        self._timer: TimerFd | None = None
        self._timer_registered = False  # the timerfd is watched by the loop (from the first park)
        # a virtual clock only moves while the loop sleeps: never spin there, park exactly
        self.virtual = virtual_clock(loop) is not None
        self._timer_kind = self._choose_timer()
        self._waiting: bool | None = None  # None: no runtime hint, the plain policy
        self.num_completed = self.num_hot_passes = self.num_parks = self.num_idle_waits = 0
        self.num_doorbell_parks = 0
        self.num_rings = 0  # doorbell parks ended by a ring
        self.num_ring_polls = 0  # rings whose message was delivered in the callback (ring())
        # the last poll that kept this doorbell park going: such a ring, or the end of a task on
        # the loop thread (inline_task_ends); 0: none. Its backstop counts from here.
        self._ring_polled_at = 0.0
        self._handle: asyncio.TimerHandle | None = None  # a park's call_later (no timerfd)
        self.num_missed_rings = 0  # doorbell parks ended by the backstop that found something
        self._bell_grace = 0  # short timer parks left before arming the doorbells again
        self._rung = False  # a doorbell rang since the last doorbell park began
        self._through_task = False  # parked through a running task: task_ended() polls
        self._task_end: float | None = None  # when a paced task ends (task_ends_at)
        self._clock = clock_of(loop)  # the clock of task spans and paced deadlines
        self.num_task_parks = 0
        self._armed: list[CompletionSource] = []  # sources whose doorbell is armed (a park)
        self._inline_disarmed = False  # inline_task_begins() disarmed the park's doorbells
        self._hushed: list[CompletionSource] = []  # ... or hushed them for notices
        self.num_inline_disarms = 0
        self.num_inline_hushes = 0  # loop-thread tasks whose notices rang nobody

    @classmethod
    def for_loop(cls, loop: asyncio.AbstractEventLoop | None = None) -> "ProgressEngine":
        """The engine of `loop` (default: the running loop), created on first use."""
        loop = loop or asyncio.get_running_loop()
        engine = _ENGINES.get(loop)
        if engine is None:
            engine = _ENGINES[loop] = cls(loop)
        return engine

    @classmethod
    def existing(cls, loop: asyncio.AbstractEventLoop | None = None) -> "ProgressEngine | None":
        """The engine of `loop` if some transport or device created one, else None."""
        return _ENGINES.get(loop or asyncio.get_running_loop())

    def _choose_timer(self) -> str:
        kind = self.config.timer
        if kind == "call_later":
            return kind
        usable = sys.platform.startswith("linux") and not self.virtual
        if usable:
            try:
                self._timer = TimerFd()
                return "timerfd"
            except (OSError, AttributeError):
                usable = False
        if kind == "timerfd":
            raise ConfigError("no timerfd on this platform or loop", expected="Linux and a "
                              "real-time loop", got=f"{sys.platform}, {type(self.loop).__name__}",
                              fix="set AIOREADY_TIMER=call_later")
        return "call_later"

    # -- the surface used by transports and devices -----------------------------------------
    def add_source(self, source: CompletionSource) -> None:
        """Poll `source` from now on (until `remove_source`)."""
        if source not in self._sources:
            self._sources += (source,)
        self.kick()

    def remove_source(self, source: CompletionSource) -> None:
        self._sources = tuple(src for src in self._sources if src is not source)

    def kick(self) -> None:
        """New work was started: poll soon, and stay hot for the spin window."""
        self._last_progress = self.loop.time()
        self._cpu_mark = None
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)
        if self._task is None or self._task.done():
            self._task = self.loop.create_task(self._run(), name="aioready-progress")

    def ring(self, source: CompletionSource | None = None) -> None:
        """A source's doorbell rang: a message is there (see `_park_on_doorbells`).

        Given the `source` that rang, while the engine is parked on its doorbells and no task
        runs, the source is polled here, in the loop's reader callback: the message reaches
        its awaiting coroutine in this loop pass, and when nothing now needs polling (its
        `arm_doorbell()` still says yes) the park goes on, doorbells armed: no wake-up of the
        engine's task, no second poll, no re-arm (docs/hot_path_measurements.md "What wakes a
        rank"). Else
        (nothing matched yet, a request to poll, a busy rank, a ring outside a park) the
        engine's task wakes and polls, with grace parks after it; with a spin window, it wakes
        to spin after the message as it did."""
        if source is not None and self._waiting is not False and source in self._armed:
            if self.poll(source) and source.arm_doorbell():  # type: ignore[attr-defined]
                self.num_ring_polls += 1
                self._ring_polled_at = self.loop.time()  # the backstop counts from here
                if self.config.spin_s:
                    self.kick()
                return
        self._rung = True
        self.kick()

    def set_waiting(self, waiting: bool) -> None:
        """The arbiter is waiting for a task to become ready (True) or running one (False).

        Starting to wait kicks the engine (a spin window, or a doorbell park instead of a busy
        timer park), unless it is parked on its doorbells already and has no spin window to
        start (an oversubscribed host): the next message rings it anyway, and a kick would
        only poll, re-arm and park again (about one wait in four in bench.oversub)."""
        if waiting and not self._waiting:
            self._waiting = True
            if not (self._armed and self.config.spin_s == 0):
                self.kick()
            return
        if not waiting and self._armed and self.config.busy_sleep:
            self._through_armed_park()
        self._waiting = waiting

    def _through_armed_park(self) -> None:
        """A task starts while the engine is parked on its doorbells (the message that ended
        the wait was delivered by that park's poll): with `busy_sleep` the park becomes a park
        through the task, doorbells disarmed, so the task's first message does not ring a busy
        rank; `task_ended()` polls instead. No wake-up: the park's timer stays the backstop."""
        for src in self._armed:
            src.disarm_doorbell()
        self._armed = []
        self._through_task = True

    def reconfigure(self, config: ProgressConfig) -> None:
        """Replace the policy knobs (a transport that learned the host is oversubscribed)."""
        self.config = config

    def stay_hot(self, seconds: float) -> None:
        """A completion is expected within `seconds` (from the schedule): keep polling hot."""
        self._hot_until = max(self._hot_until, self.loop.time() + seconds)
        self.kick()

    def poll(self, only: CompletionSource | None = None) -> int:
        """Poll every source once, now (the arbiter may call this between task launches);
        `only`: that one source (the one whose doorbell rang, `ring()`)."""
        done = 0
        for src in self._sources if only is None else (only,):
            try:
                done += src.poll()
            except Exception:  # a source must report its own errors; never kill the poller
                log.exception("completion source %r raised in poll(); removing it", src)
                self.remove_source(src)
        if done:
            self._progressed(done)
        return done

    def _progressed(self, done: int) -> None:
        self.num_completed += done
        self._last_progress = self.loop.time()
        self._cpu_mark = None
        self._bell_grace = 0

    def statistics(self) -> ProgressStatistics:
        return ProgressStatistics(len(self._sources), self._num_pending(), self.num_completed,
                                  self.num_hot_passes, self.num_parks, self.num_idle_waits,
                                  self._timer_kind)

    # -- the poller ----------------------------------------------------------------------
    def _num_pending(self) -> int:
        n = 0
        for src in self._sources:  # a loop, not sum(genexpr): this runs every hot pass
            n += src.num_pending()
        return n

    def wants_hot(self) -> bool:
        """Whether a source has a transfer in flight that moves only when polled (a
        rendezvous-size message): who would block the loop asks this first (devices/cpu.py)."""
        for src in self._sources:
            if src.wants_hot():
                return True
        return False

    async def _run(self) -> None:
        cfg = self.config
        loop = self.loop
        yield_every = cfg.yield_every if hasattr(os, "sched_yield") else 0
        while True:
            if cfg is not self.config:  # reconfigure() was called
                cfg = self.config
                yield_every = cfg.yield_every if hasattr(os, "sched_yield") else 0
            if (self._waiting and not cfg.spin_s and not self._bell_grace
                    and loop.time() >= self._hot_until and not self.wants_hot()
                    and self._arm_doorbells()):
                # waiting with no spin window (oversubscribed): straight to the doorbells, whose
                # park polls once armed; a poll before arming found nothing more (one pass, two
                # polls, at each wait's start: docs/hot_path_measurements.md "What wakes a
                # rank")
                self.num_parks += 1
                await self._park_on_doorbells(cfg.bell_backstop_s)
                continue
            done = self.poll()
            if not self._num_pending():
                self.num_idle_waits += 1
                await self._wait(None)
                continue
            if done and cfg.spin_s and self._waiting is not False and not self.virtual:
                # progress just now, not busy: inside the spin window, as the rules below find
                # (`_progressed` reset the window and its CPU mark); not asked again on the
                # pass that hands a message to its awaiting coroutine
                # (docs/hot_path_measurements.md "The message path, second round")
                hot = True
            else:
                now = loop.time()
                quiet = now - self._last_progress
                busy = self._waiting is False
                spin = not busy and (quiet < cfg.spin_s or self._spun() < cfg.spin_s)
                hot = not self.virtual and (spin or now < self._hot_until
                                            or (quiet < cfg.hot_max_s and self.wants_hot()))
            if hot:
                self.num_hot_passes += 1
                if yield_every and self.num_hot_passes % yield_every == 0:
                    os.sched_yield()  # let a peer rank sharing this core run (see above)
                await _pass()
                continue
            if self.wants_hot() or self._waiting or quiet < cfg.park_window_s:
                delay = cfg.busy_park_s if busy and not self.wants_hot() else cfg.park_s
            else:  # a long bubble: back off, growing with the time spent quiet
                delay = min(cfg.backoff_max_s, max(cfg.park_s, (quiet - cfg.park_window_s)))
            self.num_parks += 1
            if self._bell_grace:  # just rung: the message may need a few polls to show
                self._bell_grace -= 1
            elif (busy and self._task_end is not None and cfg.task_lead_s
                  and self._arm_doorbells(ring=False)):
                left = self._task_end - cfg.task_lead_s - self._clock()
                if left > 0:
                    await self._wait(left)
                else:
                    await self._park_through_task(cfg.bell_backstop_s)
                continue
            elif busy and cfg.busy_sleep and self._arm_doorbells(ring=False):
                await self._park_through_task(cfg.bell_backstop_s)
                continue
            elif not busy and self._arm_doorbells():
                await self._park_on_doorbells(cfg.bell_backstop_s)
                continue
            await self._wait(delay)

    def _arm_doorbells(self, ring: bool = True) -> bool:
        """Whether every source with something pending can wake the engine itself (a source's
        optional `arm_doorbell()`, transports/doorbell.py): then a park needs no short timer.
        `ring=False` only asks (the doorbells are disarmed again): nothing there needs polling
        until the engine looks again."""
        armed = []
        for src in self._sources:
            if not src.num_pending():
                continue
            arm = getattr(src, "arm_doorbell", None)
            if arm is None or not arm():
                for other in armed:
                    other.disarm_doorbell()
                return False
            armed.append(src)
        if ring:
            self._armed = armed
        else:
            for src in armed:
                src.disarm_doorbell()
        return bool(armed)

    async def _park_through_task(self, backstop: float) -> None:
        """A task runs and nothing outstanding needs polling (what `_arm_doorbells` asks): sleep
        through it with only the backstop timer, and ask for no rings either. A message that
        arrives meanwhile waits in MPI's queue until the task ends, when `task_ended()` polls
        before the arbiter decides, or until the arbiter waits (`set_waiting(True)` kicks).
        Measured with 8 and 16 ranks on 2 cores (bench/results/oversub.md): ringing a busy rank
        for each message woke it for nothing and preempted the sender; sleeping through saves
        the timer parks' ~100 wake-ups a second (0.7 % of a core a rank at 8 ranks), but the
        median task overran 1.1 against 0.7 ms at 8 ranks and 2.8 against 0.7 ms at 16, as the
        scheduler (Linux EEVDF, a loaded host) gives a long sleeper a core later, and a notice
        read at the task's end dates its forecast from then: so it is off by default. Measured
        again with precise task ends and no ring at a task's start
        (docs/hot_path_measurements.md "A task's end"): 13-18 % less CPU per task at 16 ranks,
        overrun p90 1.3-1.4x."""
        self._through_task = True
        self.num_task_parks += 1
        try:
            await self._wait(backstop)
        finally:
            self._through_task = False

    def task_ended(self) -> None:
        """The runtime's task ended and its arbiter decides next: if the engine slept through
        the task (`_park_through_task`), poll now so the decision sees what arrived meanwhile."""
        self._task_end = None
        if self._through_task:
            self.poll()

    def inline_task_begins(self) -> None:
        """A task is about to compute on the loop thread (devices/cpu.py's quiet path): no
        callback of this loop runs until `inline_task_ends()`. A doorbell park under way could
        not answer a ring meanwhile, so its doorbells are disarmed: a peer's message rings
        nobody, where it cost the sender a datagram and this rank, after the task, a reader
        callback whose poll found the message gone (the task's-end poll had delivered it), a
        wake-up of the engine's task and its grace parks (docs/hot_path_measurements.md "The
        quiet path's doorbells"). The park itself goes on. Off by default
        (`AIOREADY_INLINE_DISARM=1`): less CPU a task, but bench.e2e's steps were 2-8 % longer
        (docs/hot_path.md). By
        default only notices ring nobody (a source's `hush_doorbell`, which the MPI transport
        has: `AIOREADY_HUSH_NOTICES`): the end's poll reads them, where the ring that a notice
        cost was answered after the task anyway; a data message still rings."""
        if self._armed and self.config.inline_disarm:
            for src in self._armed:
                src.disarm_doorbell()
            self._inline_disarmed = True
            self.num_inline_disarms += 1
        elif self._armed:  # notices ring no more (MPITransport.hush_doorbell); data still do
            self._hushed = [src for src in self._armed
                            if getattr(src, "hush_doorbell", _no_hush)()]
            self.num_inline_hushes += bool(self._hushed)

    def _poll_dry(self) -> None:
        """Poll until a poll completes nothing (at most `_DRY_POLLS`): messages that arrived
        during a task on the loop thread rang nobody, so none may be left for a later ring, and
        a poll that matches an older message can miss one that arrived since MPI's last call
        (MPICH matches it only on a later call; an empty poll probes twice)."""
        for _ in range(_DRY_POLLS):
            if not self.poll():
                return

    def inline_task_ends(self) -> None:
        """The loop-thread task ended: poll once, so the next decision sees what arrived during
        it (hushed sources: un-hushed first; a source hushes only if its poll leaves nothing
        that came before it, as MPITransport's probing again after a match does). A park that
        `inline_task_begins()` disarmed is re-armed first (arm, then poll, as a doorbell park
        begins) and its backstop counts from here; a source that refuses to arm after that
        poll (a request it now tracks needs polling) ends the park: the engine's task wakes,
        as a ring in that state wakes it."""
        if not self._inline_disarmed:
            if self._hushed:  # notices ring again, then the poll reads what did not ring
                for src in self._hushed:
                    src.hush_doorbell(False)  # type: ignore[attr-defined]
                self._hushed = []
            self.poll()
            return
        self._inline_disarmed = False
        armed = self._armed
        for src in armed:
            src.arm_doorbell()  # type: ignore[attr-defined]
        self._poll_dry()
        for src in armed:
            if not src.arm_doorbell():  # type: ignore[attr-defined]
                for other in armed:
                    other.disarm_doorbell()  # type: ignore[attr-defined]
                self._armed = []
                self.kick()
                return
        self._ring_polled_at = self.loop.time()
        if self._timer_registered and self._wake is not None:  # the backstop from here, not
            self._timer.arm(self.config.bell_backstop_s)  # type: ignore[union-attr]  # woken

    def task_ends_at(self, deadline: float) -> None:
        """The running task ends at `deadline` (on `clock_of(loop)`: a paced task's sleep). With
        `task_lead_s`, the busy engine's timer parks give way to one park that ends that long
        before the deadline (a poll there), then a park through to the end (`task_ended()`
        polls): two wake-ups a task, the task's end one of them. A park under way is re-timed
        in place (a doorbell park is disarmed, as a task's start with `busy_sleep` does)."""
        if not self.config.task_lead_s or self._waiting is not False:
            return
        self._task_end = deadline
        if self._wake is None:
            return
        if self._armed:
            self._through_armed_park()
        if self._timer is None:  # a call_later park: end it, the next one fits the task
            self.kick()
        else:
            self._timer.arm(max(deadline - self.config.task_lead_s - self._clock(), 1e-6))

    async def _park_on_doorbells(self, backstop: float) -> None:
        """Park until a doorbell rings (the source calls `ring()`), something kicks the engine,
        or the backstop timer; one poll after arming finds what arrived before the doorbells
        could be rung.

        A rung rank's first poll may not see the message yet (MPICH
        matches a message that arrived since its last call only on a later one, see
        MPITransport._probe), and with no spin window (an oversubscribed host) the engine would
        park again at once, on the doorbell, until the backstop. So after a ring the next
        `_BELL_GRACE` parks are short timer parks (`park_s`), and progress ends them early.
        A park the backstop ended that then finds a message counts as a missed ring."""
        try:
            self._rung = False
            self._ring_polled_at = 0.0
            if not self.poll():
                self.num_doorbell_parks += 1
                start = self.loop.time()
                await self._wait(backstop)
                if self._rung:
                    self.num_rings += 1
                    self._bell_grace = _BELL_GRACE
                elif (self._armed and self.loop.time() - start >= backstop / 2
                      and self.poll()):  # (disarmed by _through_armed_park: not a miss)
                    self.num_missed_rings += 1
        finally:
            for src in self._armed:
                src.disarm_doorbell()
            self._armed = []
            self._through_task = False  # set by _through_armed_park

    def _spun(self) -> float:
        """CPU time this thread spent polling since the last progress.

        The spin window must be spent on a CPU, not in the run queue: on an oversubscribed
        machine a preempted poller would otherwise park before it ever looked for the reply, and
        two ranks lock into missing each other by one (slow) wake-up.
        """
        now = time.thread_time()
        if self._cpu_mark is None:
            self._cpu_mark = now
        return now - self._cpu_mark

    async def _wait(self, delay: float | None) -> None:
        """Sleep until `delay` passed (None: forever) or kick() is called.

        The timerfd stays registered with the loop for the engine's life: a park is one
        timerfd_settime, not an add_reader/remove_reader pair (two epoll_ctl calls) as well. A
        timer left armed by a park that kick() ended early is re-armed by the next park, or at
        worst wakes an idle wait once, which polls and goes back to sleep.
        """
        loop = self.loop
        wake = self._wake = loop.create_future()
        self._handle = None
        try:
            if delay is not None:
                if self._timer is not None:
                    if not self._timer_registered:
                        loop.add_reader(self._timer.fd, self._on_timer)
                        self._timer_registered = True
                    self._timer.arm(delay)
                else:
                    if not self.virtual:
                        delay = max(delay, self.config.min_sleep_s)
                    self._handle = loop.call_later(delay, self._on_deadline)
            await wake
        finally:
            self._wake = None
            if self._handle is not None:
                self._handle.cancel()
                self._handle = None

    def _on_timer(self) -> None:
        assert self._timer is not None
        self._timer.drain()
        left = self._kept_for()
        if left > 0:
            self._timer.arm(left)
            return
        wake = self._wake
        if wake is not None:
            _resolve(wake)

    def _on_deadline(self) -> None:
        """`_on_timer` of a park on `loop.call_later` (no timerfd)."""
        left = self._kept_for()
        if left > 0:
            self._handle = self.loop.call_later(left, self._on_deadline)
            return
        wake = self._wake
        if wake is not None:
            _resolve(wake)

    def _kept_for(self) -> float:
        """How much longer a doorbell park goes on whose rings `ring()` answered in the reader
        callback: its backstop counts from the last of them, as a park that each ring ended
        and began again did (<= 0: it ends now). So a park kept alive by its rings is not
        woken by a backstop every 50 ms that polls for nothing, nor counts as missed a ring
        whose callback was about to run."""
        if not (self._armed and self._ring_polled_at):
            return 0.0
        return self._ring_polled_at + self.config.bell_backstop_s - self.loop.time()

    def close(self) -> None:
        """Stop polling and release the timerfd (the loop is closing)."""
        if self._task is not None:
            self._task.cancel()
        if self._timer is not None:
            if self._timer_registered and not self.loop.is_closed():
                self.loop.remove_reader(self._timer.fd)
            self._timer_registered = False
            self._timer.close()
            self._timer = None
        _ENGINES.pop(self.loop, None)

    def __repr__(self) -> str:
        return (f"<ProgressEngine sources={len(self._sources)} pending={self._num_pending()} "
                f"timer={self._timer_kind}>")


def _no_hush(_: bool = True) -> bool:
    """`hush_doorbell` of a source without one: nothing hushed."""
    return False


@types.coroutine
def _pass() -> Generator[None, None, None]:
    """One loop pass: `asyncio.sleep(0)` without its own coroutine frame
    (docs/hot_path_measurements.md "The message path, second round")."""
    yield


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
