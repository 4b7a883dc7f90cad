"""Simulator: the real runtime, every rank in one process, on a virtual clock.

`simulate` builds one RankRuntime per rank (the same ReadySet, arbiter, runtime and in-process
transport code as a training run; no stage modules, so nothing is computed) with a SimDevice
whose durations come from a jitter model or a trace, and runs the step(s) on
`clock.run_virtual`. Simulated time passes instantly and a run is a pure function of its
arguments: the same seed gives byte-identical `to_json()`.

Time unit: the virtual clock counts trace units, so every time here is in ms. Same-instant
events are ordered by clock.py's `wait_idle` (awaited by the arbiter): every completion and
delivery of an instant runs before any arbiter decides, so strict 1F1B and GPipe with F=1, B=2
take exactly (M+S-1)*(F+B).
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Coroutine

import numpy as np

from ..caps import CapSpec, resolve_caps
from ..clock import run_virtual
from ..devices.sim import SimDevice
from ..errors import ConfigError
from ..hints import HintOrder
from ..memory import MemorySpec, check_one_gate, format_bytes, resolve_memory
from ..runtime.autotune import parse_auto
from ..runtime.driver import run_ranks
from ..runtime.rank import MODES, RankRuntime
from ..schedulers import make_hint
from ..schedulers.order import ORDERS
from ..telemetry.bounds import lower_bound_table
from ..telemetry.metrics import peak_activations
from ..telemetry.spans import StepReport
from ..transports.inproc import InprocWorld
from .budget import gated
from .choice import choose_auto
from .cutoff import Cutoff, Exceeded
from .durations import Durations, device_duration
from .memory import bytes_model, mean_bytes
from .order import reordered
from .traces import Trace, read_trace
from .variability import BaseDurations, JitterModel, parse_jitter

__all__ = ["simulate", "SimResult", "StepStats", "resolve_caps"]


@dataclass(frozen=True, slots=True)
class StepStats:
    """One simulated step; times in ms."""

    step_time: float
    lower_bound: float
    efficiency: float
    busy_fraction: tuple[float, ...]
    bubble_fraction: float
    peak_in_flight: tuple[int, ...]
    peak_activation_bytes: tuple[int, ...] = ()
    """per rank, by the simulator's bytes model (sim/memory.py)"""
    peak_held: tuple[int, ...] = ()
    """per rank, (chunk, microbatch) activations held at once (telemetry.metrics.peak_activations)"""


@dataclass(frozen=True, slots=True)
class SimResult:
    """What `simulate` measured; times in ms. Aggregates are over all steps."""

    stages: int
    microbatches: int
    ranks: int
    hint: str
    mode: str
    jitter: str
    seed: int
    trace: str | None
    split_backward: bool
    cap: tuple[int, ...]
    policy: str
    per_step: tuple[StepStats, ...]
    num_tasks: int
    num_messages: int
    num_notices: int = 0
    """header-only forecast notices of the reserving policy (forecast.py), beside num_messages"""
    wall_s: float = field(default=0.0, compare=False)
    """real seconds the simulation took (not part of to_json: it is not deterministic)"""
    tuning: Any = field(default=None, compare=False)
    """hint="auto": the sim.choice.Tuning it chose from (`.table()`); None otherwise"""
    memory: tuple[str, ...] | None = None
    """the byte budget per rank as given ("2x", "8 MiB"); None: the count cap gated"""
    memory_bytes: tuple[float, ...] | None = None
    """the byte budget per rank in bytes at the end of the run ("Nx" from the model's bytes)"""
    order: str = "given"
    """the microbatch order run (schedulers.order.ORDERS): "given" unless sim/order.py reordered"""

    @property
    def step_time(self) -> float:
        """Mean step time."""
        return sum(s.step_time for s in self.per_step) / len(self.per_step)

    @property
    def lower_bound(self) -> float:
        return sum(s.lower_bound for s in self.per_step) / len(self.per_step)

    @property
    def efficiency(self) -> float:
        """Total lower bound over total step time."""
        return sum(s.lower_bound for s in self.per_step) / sum(s.step_time
                                                               for s in self.per_step)

    @property
    def busy_fraction(self) -> tuple[float, ...]:
        total = sum(s.step_time for s in self.per_step)
        return tuple(sum(s.busy_fraction[r] * s.step_time for s in self.per_step) / total
                     for r in range(self.ranks))

    @property
    def bubble_fraction(self) -> float:
        busy = self.busy_fraction
        return 1.0 - sum(busy) / len(busy)

    @property
    def peak_in_flight(self) -> tuple[int, ...]:
        return tuple(max(s.peak_in_flight[r] for s in self.per_step) for r in range(self.ranks))

    @property
    def peak_activation_bytes(self) -> tuple[int, ...]:
        """Per rank, the most activation bytes held at once over all steps (sim/memory.py)."""
        return tuple(max(s.peak_activation_bytes[r] for s in self.per_step)
                     for r in range(self.ranks))

    @property
    def peak_held(self) -> tuple[int, ...]:
        """Per rank, the most (chunk, microbatch) activations held at once over all steps."""
        return tuple(max(s.peak_held[r] for s in self.per_step) for r in range(self.ranks))

    def as_dict(self) -> dict[str, Any]:
        """Plain data; step_time, lower_bound and efficiency are lists when several steps ran."""
        several = len(self.per_step) > 1

        def value(name: str) -> Any:
            vals = [getattr(s, name) for s in self.per_step]
            return vals if several else vals[0]
        return {
            "time_unit": "ms", "stages": self.stages, "ranks": self.ranks,
            "microbatches": self.microbatches, "hint": self.hint, "mode": self.mode,
            "jitter": self.jitter, "seed": self.seed, "trace": self.trace,
            "split_backward": self.split_backward, "cap": list(self.cap),
            "policy": self.policy,
            "steps": len(self.per_step), "step_time": value("step_time"),
            "lower_bound": value("lower_bound"), "efficiency": value("efficiency"),
            "busy_fraction": list(self.busy_fraction), "bubble_fraction": self.bubble_fraction,
            "peak_in_flight": list(self.peak_in_flight), "num_tasks": self.num_tasks,
            "peak_activation_bytes": list(self.peak_activation_bytes),
            "memory": None if self.memory is None else list(self.memory),
            "memory_bytes": None if self.memory_bytes is None else list(self.memory_bytes),
            "num_messages": self.num_messages, "num_notices": self.num_notices,
            "per_step": [asdict(s) for s in self.per_step] if several else None,
        }

    def to_json(self, indent: int | None = 2) -> str:
        """Deterministic JSON (no wall-clock figures): byte-identical for the same arguments."""
        return json.dumps(self.as_dict(), indent=indent, allow_nan=False) + "\n"

    def summary(self) -> str:
        return (f"{self.hint} {self.mode}: step time {self.step_time:.4g} ms, lower bound "
                f"{self.lower_bound:.4g} ms, efficiency {self.efficiency:.3f}, bubble "
                f"{self.bubble_fraction:.3f}, peak in-flight max {max(self.peak_in_flight)}, "
                f"peak activations max {format_bytes(max(self.peak_activation_bytes))}")


def _check_int(name: str, value: Any, least: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ConfigError(f"{name} must be an integer >= {least}", expected=f">= {least}",
                          got=repr(value))
    return value


def _durations(trace: str | Path | Trace | None, jitter: str, seed: int, hint: HintOrder,
               base: BaseDurations | None, steps: int) -> tuple[Durations, JitterModel]:
    spec = parse_jitter(jitter)
    model = JitterModel(spec, seed=seed, placement=hint.placement,
                        num_microbatches=hint.num_microbatches,
                        split_backward=hint.split_backward, base=base)
    if trace is None:
        return model, model
    if spec.has_compute:
        raise ConfigError("a trace gives the task durations; jitter may only add comm terms",
                          expected="jitter 'none' or 'comm:...'", got=str(spec))
    loaded = trace if isinstance(trace, Trace) else read_trace(trace, placement=hint.placement)
    loaded.check(hint.placement, hint.num_microbatches, hint.split_backward, steps)
    return loaded, model


async def _run_steps(runtimes: list[RankRuntime], steps: int, cutoff: Cutoff | None = None
                     ) -> None:
    if cutoff is None:
        for step in range(steps):
            await run_ranks(runtimes, step)
        return
    loop = asyncio.get_running_loop()
    cutoff.now = loop.time
    done = 0.0
    for step in range(steps):  # in a task the cutoff may cancel (sim/cutoff.py)
        cutoff.begin_step(step, loop.time(), done)
        cutoff.task = asyncio.ensure_future(run_ranks(runtimes, step))
        try:
            await cutoff.task
        except asyncio.CancelledError:
            if cutoff.stopped:
                return
            raise
        reports = [rt.reports[step] for rt in runtimes]
        done += max(r.end for r in reports) - min(r.start for r in reports)


def _run_blocking(main: Coroutine[Any, Any, None]) -> None:
    """Run on a fresh virtual-clock loop; from inside a running loop (a notebook, async code),
    in a helper thread, since a thread can run one loop at a time. The caller waits."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        run_virtual(main)
        return
    with ThreadPoolExecutor(1, thread_name_prefix="aioready-sim") as pool:
        pool.submit(run_virtual, main).result()


def _step_stats(reports: list[StepReport], table: np.ndarray, hint: HintOrder) -> StepStats:
    start = min(r.start for r in reports)
    end = max(r.end for r in reports)
    total = end - start
    busy = [0.0] * hint.num_ranks
    peak = [0] * hint.num_ranks
    held = [0] * hint.num_ranks
    for report in reports:
        for rank, value in report.peak_activation_bytes.items():
            held[rank] = value
        for span in report.spans:
            busy[span.rank] += span.end - span.start
        for rank, value in report.peak_in_flight.items():
            peak[rank] = value
    fraction = tuple(b / total if total > 0 else 0.0 for b in busy)
    lb = lower_bound_table(hint.placement, table, hint.split_backward)
    spans = [s for report in reports for s in report.spans]
    return StepStats(total, lb, lb / total if total > 0 else 1.0, fraction,
                     1.0 - sum(fraction) / len(fraction), tuple(peak), tuple(held),
                     tuple(peak_activations(spans, r) for r in range(hint.num_ranks)))


def simulate(*, stages: int, microbatches: int, hint: str | HintOrder = "1f1b",
             mode: str = "ready", jitter: str = "none", seed: int = 0,
             trace: str | Path | Trace | None = None,
             cap: CapSpec = None, split_backward: bool = False,
             steps: int = 1, ranks: int | None = None,
             base: BaseDurations | None = None, policy: str = "reserve",
             memory: MemorySpec = None, stop_after: float | None = None,
             activations: int | None = None, order: str | None = None) -> SimResult:
    """Simulate `steps` steps of a pipeline with the real runtime on a virtual clock.

    Durations come from `trace` (a CSV path or a Trace; `jitter` may then add only comm terms)
    or from the seeded `jitter` model over `base` durations. `cap`: any form of aioready.caps
    (None: the hint's peak per rank, an int, 'Nx' N times that, one per rank). `hint="auto"`
    (or "auto:<hint>", which fixes the placement) simulates the candidate hints, modes and caps
    within `cap` and returns the fastest, named "auto:<hint>", with `.tuning` (the table it
    chose from; `mode` is then chosen too, see sim/choice.py). `memory`: a byte budget per rank
    instead of `cap` (any form of aioready.memory; bytes from the model of sim/memory.py), also
    with "auto" (then "Nx" is N times the start hint's own peak bytes, sim/budget.py). It
    runs its own
    virtual-clock loop and blocks until done (from async code: in a helper thread).
    `stop_after`: the tuner's bound; raise sim.cutoff.Exceeded as soon as the mean step time is
    known to exceed it (sim/cutoff.py). `activations`: with "auto", the budget in (chunk,
    microbatch) activations per rank instead (sim/budget.py). `order`: "ascending" or
    "descending" runs each step's microbatches in `schedulers.order.cost_order` of their known
    sizes (sim/order.py), "given" (None, the default) as drawn; with "auto", None simulates each
    candidate in every order of schedulers.order.ORDERS.
    """
    _check_int("stages", stages)
    _check_int("microbatches", microbatches)
    _check_int("steps", steps)
    _check_int("seed", seed, 0)
    check_one_gate(cap, memory)
    if order is not None and order not in ORDERS:
        raise ConfigError("order", expected=" | ".join(ORDERS), got=repr(order))
    mb_order = order
    if parse_auto(hint) is not None:  # choose by simulating the candidates (sim/choice.py)
        done: dict[tuple[object, ...], SimResult] = {}

        fixed = order or "given"

        def run(hint_order: HintOrder, mode: str, caps: tuple[int, ...], policy: str,
                bound: float | None = None, memory: tuple[int, ...] | None = None,
                microbatch_order: str = fixed) -> SimResult:
            result = simulate(stages=stages, microbatches=microbatches, hint=hint_order,
                              jitter=jitter, seed=seed, trace=trace,
                              **gated(caps, memory),
                              split_backward=split_backward, steps=steps, base=base,
                              mode=mode, policy=policy, stop_after=bound,
                              order=microbatch_order)
            done[(hint_order.name, hint_order.placement.style, mode, caps, policy, memory,
                  microbatch_order)] = result
            return result

        def per_microbatch(order: HintOrder) -> list[float]:
            durations, _ = _durations(trace, jitter, seed, order, base, steps)
            return mean_bytes(durations, order.placement, steps)

        def reorder_helps(order: HintOrder) -> bool:
            durations, model = _durations(trace, jitter, seed, order, base, steps)
            return reordered(durations, model, "ascending") is not None
        tuning = choose_auto(run, hint, num_stages=stages, num_ranks=ranks,
                             num_microbatches=microbatches, split_backward=split_backward,
                             budget=cap, memory=memory, mean_bytes=per_microbatch,
                             activations=activations,
                             reorder=reorder_helps if order is None else None)
        best = tuning.best.candidate.choice
        chosen = done[(best.hint, best.placement, best.mode, best.cap, best.policy,
                       best.memory, tuning.best.candidate.order if order is None else fixed)]
        return replace(chosen, hint=f"auto:{tuning.best.candidate.label}", tuning=tuning)
    if mode not in MODES:
        raise ConfigError("mode", expected=" | ".join(MODES), got=repr(mode))
    order = make_hint(hint, num_stages=stages, num_ranks=ranks, num_microbatches=microbatches,
                      split_backward=split_backward)
    if (order.placement.num_stages, order.num_microbatches, order.split_backward) != (
            stages, microbatches, split_backward):
        raise ConfigError(f"hint {order.name!r} was built for another pipeline shape",
                          expected=f"stages={stages}, microbatches={microbatches}, "
                          f"split_backward={split_backward}",
                          got=f"stages={order.placement.num_stages}, microbatches="
                          f"{order.num_microbatches}, split_backward={order.split_backward}")
    durations, model = _durations(trace, jitter, seed, order, base, steps)
    moved = reordered(durations, model, mb_order or "given")
    delay = model.delay(scale=1.0) if moved is None else moved.delay(scale=1.0)
    durations = durations if moved is None else moved
    world = InprocWorld(order.num_ranks, delay=delay)
    cutoff = None if stop_after is None else Cutoff(order, durations, steps, stop_after)
    timing = device_duration(durations, scale=1.0)
    device = SimDevice(timing if cutoff is None else cutoff.wrap(timing), run_compute=False)
    caps = resolve_caps(cap, order)
    budgets = resolve_memory(memory, order.num_ranks)
    if budgets is not None:  # the byte gate instead of the count (ready_set Note [byte gate])
        caps = [microbatches] * order.num_ranks
    model = bytes_model(durations)
    runtimes = [RankRuntime(rank=r, hint=order, mode=mode, cap=caps[r], executors=None,
                            device=device, transport=world.endpoints[r], policy=policy,
                            caps=caps, memory=None if budgets is None else budgets[r],
                            bytes_model=model)
                for r in range(order.num_ranks)]
    began = time.perf_counter()
    _run_blocking(_run_steps(runtimes, steps, cutoff))
    if cutoff is not None and cutoff.stopped:
        raise Exceeded(stop_after, cutoff.at_least)  # type: ignore[arg-type]
    wall = time.perf_counter() - began
    per_step = tuple(_step_stats([rt.reports[i] for rt in runtimes], durations.table(i), order)
                     for i in range(steps))
    source = trace.source if isinstance(trace, Trace) else None if trace is None else str(trace)
    return SimResult(
        stages=stages, microbatches=microbatches, ranks=order.num_ranks, hint=order.name,
        mode=mode, jitter=str(parse_jitter(jitter)), seed=seed,
        trace=source, split_backward=split_backward, policy=policy if mode == "ready" else "-",
        cap=tuple(rt.cap for rt in runtimes), per_step=per_step,
        order="given" if moved is None else mb_order,  # type: ignore[arg-type]
        num_tasks=sum(len(rt.reports[0].spans) for rt in runtimes) * steps,
        num_messages=world.num_messages, num_notices=world.num_notices, wall_s=wall,
        memory=None if budgets is None else tuple(str(b) for b in budgets),
        memory_bytes=None if budgets is None else tuple(
            float(rt.held.budget_bytes() or 0.0) for rt in runtimes))  # type: ignore[union-attr]
