"""The tuner: from measured durations (a trace file, or the spans of a run's last steps) to the
fastest schedule within a budget, by simulating the candidates (sim/choice.py).

`tune` is `aioready tune` and the library call; `SimChooser` is the chooser a Pipeline with
hint="auto" uses (runtime/autotune.py defines what it must do; the root package registers this
one, since the runtime may not import the simulator).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from ..caps import CapSpec
from ..errors import ConfigError
from ..hints import HintOrder
from ..memory import MemorySpec
from ..runtime.choosers import Choice
from ..runtime.rank import MODES
from ..telemetry.spans import StepReport
from .budget import gated
from .choice import FACTORS, WHOLE, Run, Tuning, candidate_hints, choose_auto, choose_schedule
from .memory import mean_bytes
from .order import orders_differ
from .simulator import SimResult, simulate
from .traces import Trace, read_trace, trace_from_reports

__all__ = ["tune", "SimChooser", "policy_chooser"]


def _runner(trace: Trace, jitter: str) -> Run:
    stages, split = trace.placement.num_stages, trace.split_backward

    def run(order: HintOrder, mode: str, caps: tuple[int, ...], policy: str,
            bound: float | None = None, memory: tuple[int, ...] | None = None,
            microbatch_order: str = "given") -> SimResult:
        return simulate(stages=stages, microbatches=trace.num_microbatches, hint=order,
                        mode=mode, trace=trace, jitter=jitter,
                        **gated(caps, memory),
                        split_backward=split, steps=trace.num_steps, policy=policy,
                        stop_after=bound, order=microbatch_order)
    return run


def tune(trace: str | Path | Trace, *, hint: str = "auto", stages: int | None = None,
         microbatches: int | None = None, budget: CapSpec = None, jitter: str = "none",
         modes: Sequence[str] = MODES, factors: Sequence[float] = FACTORS,
         memory: MemorySpec = None) -> Tuning:
    """Rank the candidate schedules on the durations of `trace` (every step of it, replayed).

    `hint`: "auto" (any placement style for the trace's ranks) or "auto:<hint>" (that hint's
    placement, and a relative budget measured against its peak); `stages`, `microbatches`:
    checked against the trace when given; `budget`: any form of aioready.caps (None: the start hint's own peak);
    `jitter`: comm terms only ('comm:0.1'), added to every candidate alike; `memory`: a byte
    budget instead of `budget` (any form of aioready.memory, in the bytes of sim/memory.py's
    model: "Nx" is N times the start hint's own peak bytes).
    """
    loaded = trace if isinstance(trace, Trace) else read_trace(trace)
    place = loaded.placement
    for name, given, got in (("stages", stages, place.num_stages),
                             ("microbatches", microbatches, loaded.num_microbatches)):
        if given is not None and given != got:
            raise ConfigError(f"{loaded.source}: the trace is for another {name}",
                              expected=f"{name}={given}", got=f"{name}={got} in the trace")
    return choose_auto(_runner(loaded, jitter), hint, num_stages=place.num_stages,
                       num_ranks=place.num_ranks, num_microbatches=loaded.num_microbatches,
                       split_backward=loaded.split_backward, budget=budget, modes=modes,
                       factors=factors, memory=memory,
                       mean_bytes=lambda o: mean_bytes(loaded, o.placement, loaded.num_steps))


class SimChooser:
    """The default chooser of hint="auto": the pipeline's last steps replayed as a trace, every
    candidate of its placement simulated on them; where the steps carry their microbatches'
    costs (runtime/auto_order.py), each also in both cost orders."""

    def __init__(self, *, modes: Sequence[str] = MODES,
                 factors: Sequence[float] = FACTORS, same_hint: bool = False,
                 activations: int | None = None) -> None:
        self.modes = tuple(modes)
        self.factors = tuple(factors)
        self.same_hint = same_hint  # policy="auto": only the pipeline's own hint is a candidate
        self.activations = activations  # a budget of held activations instead of `budget`
        self.last: Tuning | None = None  # the latest table, for whoever wants to look

    def choose(self, reports: Sequence[StepReport], *, hint: HintOrder, budget: CapSpec,
               unit_ms: float, memory: MemorySpec = None) -> Choice:
        """`memory`: a byte budget instead of `budget`, in the bytes the reports' stages
        measured (sim/memory.py replays them; "Nx": N times the start hint's strict peak on
        them)."""
        trace = trace_from_reports(reports, placement=hint.placement,
                                   num_microbatches=hint.num_microbatches,
                                   split_backward=hint.split_backward, unit_ms=unit_ms)
        if memory is not None and trace.measured_bytes is None:
            raise ConfigError("hint='auto' under memory= chooses on the bytes the stages "
                              "measured", expected="every forward's activation bytes in the "
                              "step reports (stages that measure them: held_bytes)",
                              got="steps without them")
        orders = [hint] if self.same_hint else candidate_hints(
            num_stages=hint.placement.num_stages, num_ranks=hint.num_ranks,
            num_microbatches=hint.num_microbatches, split_backward=hint.split_backward,
            placement=hint.placement.style)
        moves = orders_differ(trace, trace.num_steps)
        self.last = choose_schedule(_runner(trace, "none"), orders, budget=budget,
                                    reference=hint, modes=self.modes, factors=self.factors,
                                    activations=self.activations, memory=memory,
                                    mean_bytes=lambda o: mean_bytes(trace, o.placement,
                                                                    trace.num_steps),
                                    reorder=(lambda _: True) if moves else None)
        return self.last.choice


def policy_chooser() -> SimChooser:
    """The chooser of `policy="auto"`: the pipeline's own hint and cap, ready mode, each policy
    simulated on the measured durations (docs/policy.md "Choosing the policy"). The budget it
    is given is the pipeline's cap, so the whole budget is that cap on every rank (1x of the
    hint's peak would drop a raised cap, "2x", to the peak)."""
    return SimChooser(modes=("ready",), factors=(WHOLE,), same_hint=True)
