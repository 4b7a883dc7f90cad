"""Choosing a schedule by simulating the candidates: hints x modes x budgets, fastest that fits.

The candidates are every library hint valid for the pipeline's shape (stages, ranks, microbatches,
split backward; a fixed placement style when the caller fixed one), each in strict mode at its
own peak and in ready mode (both policies) at 1x, 1.5x and 2x its own peak in-flight count per
rank, each cap clipped to the caller's budget (by default the peak of the hint an auto pipeline
starts from: the memory a pipeline holds without auto). Each is simulated by `run` with the same
durations: the real runtime on the virtual clock, so the step time is exact for those durations, not a model of it.
The fastest whose peak in-flight fits the budget wins; ties go to the smaller peak, then strict
(the more predictable), then the hint's name, so the choice is a pure function of the durations.

Pruning (`prune=True`, the default): each candidate's simulation is given the best fitting step
time found so far as a bound, and stops as soon as its own is known to exceed it
(sim/cutoff.py: a lower bound from the work each rank has left). A stopped candidate could not
have won, so the choice is the one the full search makes; only its row says "more than"
instead of a step time. Candidates run most memory first, since those usually win, so the bound
is tight early.

What it leaves out: durations are the measured ones, replayed as they were (another step's
jitter differs); communication costs only what the `run` function adds; a different placement
(ranks, chunks) is never a candidate, since the stages are already where they are.

Note [budget form]: a candidate's budget is the value passed as `cap=` to `run` (one cap per
rank), and "fits" compares the simulated peak in-flight with the caller's budget resolved the
same way. Both live in `_limit`, `_caps` and `_fits` below, so a budget in bytes changes those
three and nothing else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol, Sequence

from ..caps import CapSpec, resolve_caps
from ..errors import AioreadyError, ConfigError
from ..hints import HintOrder
from ..runtime.autotune import parse_auto, start_hint
from ..runtime.choosers import STYLES, Choice
from ..runtime.rank import MODES, POLICIES, reservation_holds
from ..schedulers import HINTS, hint_names, make_hint
from .cutoff import Exceeded

__all__ = ["FACTORS", "Candidate", "Row", "Tuning", "candidate_hints", "candidates",
           "choose_auto", "choose_schedule"]

FACTORS = (1.0, 1.5, 2.0)
"""Ready-mode budgets tried, as multiples of each hint's own peak in-flight count."""

class Simulated(Protocol):
    """What the ranking reads of a simulation (a SimResult has it)."""

    @property
    def step_time(self) -> float: ...

    @property
    def efficiency(self) -> float: ...

    @property
    def peak_in_flight(self) -> Sequence[int]: ...


Run = Callable[[HintOrder, str, tuple[int, ...], str, "float | None"], Simulated]
"""run(hint, mode, caps, policy, bound): one candidate simulated on the durations being tuned
for; with a bound, it may raise sim.cutoff.Exceeded once its step time is known to exceed it."""


@dataclass(frozen=True, slots=True)
class Candidate:
    choice: Choice
    factor: float  # the budget as a multiple of the hint's own peak (before clipping)


@dataclass(frozen=True, slots=True)
class Row:
    """One simulated candidate; times in the durations' unit (ms)."""

    candidate: Candidate
    step_time: float
    efficiency: float  # lower bound / step time
    peak_in_flight: tuple[int, ...]
    fits: bool
    stopped: bool = False  # pruned: step_time is then only a lower bound, above the best's

    @property
    def key(self) -> tuple[object, ...]:
        c = self.candidate.choice
        peak = self.peak_in_flight or (0,)
        return (self.stopped, self.step_time, max(peak), sum(peak),
                0 if c.mode == "strict" else 1, POLICIES.index(c.policy), c.hint, c.placement,
                self.candidate.factor)


@dataclass(frozen=True, slots=True)
class Tuning:
    """What the tuner simulated, best first, and what it chose."""

    rows: tuple[Row, ...]
    limit: tuple[int, ...]  # the caller's budget per rank
    best: Row

    @property
    def choice(self) -> Choice:
        return Choice(**{f: getattr(self.best.candidate.choice, f)
                         for f in ("hint", "placement", "mode", "cap", "policy")},
                      table=self.table())

    def table(self) -> str:
        """The rows as text, best first; '*' marks the choice, '-' a candidate over budget."""
        base = self.best.step_time
        lines = [f"{'':1} {'hint':<20} {'mode':<12} {'budget':>6} {'step ms':>10} "
                 f"{'vs best':>7} {'eff':>5}  peak in-flight (caps)"]
        for row in self.rows:
            c = row.candidate.choice
            mark = "*" if row is self.best else (" " if row.fits or row.stopped else "-")
            head = f"{mark:1} {c.label:<20} {c.how:<12} {row.candidate.factor:>5g}x "
            if row.stopped:
                lines.append(head + f"{'>' + format(row.step_time, '.4g'):>10} "
                             f"{'>' + format(row.step_time / base, '.3f'):>7} {'-':>5}  "
                             f"stopped ({list(c.cap)})")
                continue
            lines.append(head + f"{row.step_time:>10.4g} {row.step_time / base:>7.3f} "
                         f"{row.efficiency:>5.3f}  {list(row.peak_in_flight)} "
                         f"({list(c.cap)})")
        stopped = sum(r.stopped for r in self.rows)
        if stopped:
            lines.append(f"stopped: {stopped} of {len(self.rows)} candidates, as soon as they "
                         "were known to be slower than the best (their step time is a lower "
                         "bound)")
        lines.append(f"budget per rank: {list(self.limit)}; chosen: {self.best.candidate.choice.label} "
                     f"{self.best.candidate.choice.how} at {self.best.candidate.factor:g}x")
        return "\n".join(lines)


def candidate_hints(*, num_stages: int, num_ranks: int, num_microbatches: int,
                    split_backward: bool, placement: str | None = None) -> list[HintOrder]:
    """Every library hint for this shape (each rule on every placement style that fits the
    chunks per rank), sorted by name and style; `placement` keeps one style only."""
    chunks = num_stages // num_ranks if num_ranks else 0
    fitting = {"linear": chunks == 1, "interleaved": chunks >= 2, "v": chunks == 2}
    styles = [s for s in ([placement] if placement is not None else STYLES) if fitting[s]]
    out = []
    for name in hint_names():
        spec = HINTS[name]
        for style in styles if spec.rule else [spec.style]:
            if style not in styles:
                continue
            try:
                order = make_hint(name, num_stages=num_stages, num_ranks=num_ranks,
                                  num_microbatches=num_microbatches,
                                  split_backward=split_backward, placement=style)
            except AioreadyError:
                continue  # not valid for this shape (split, chunks per rank)
            if order.placement.style == style and order.num_ranks == num_ranks:
                out.append(order)
    return out


def _limit(budget: CapSpec, reference: HintOrder) -> tuple[int, ...]:
    """The caller's budget per rank, relative to `reference` like a Pipeline's `cap`: None is
    its own peak (what the pipeline would hold without auto), 'Nx' N times that."""
    return tuple(resolve_caps(budget, reference))


def _caps(order: HintOrder, factor: float, limit: tuple[int, ...]) -> tuple[int, ...]:
    own = resolve_caps(f"{factor:g}x", order)
    return tuple(min(c, m) for c, m in zip(own, limit))


def _fits(peak: Sequence[int], limit: tuple[int, ...]) -> bool:
    return all(p <= m for p, m in zip(peak, limit))


def candidates(orders: Iterable[HintOrder], limit: tuple[int, ...],
               modes: Sequence[str] = MODES, factors: Sequence[float] = FACTORS
               ) -> list[tuple[HintOrder, Candidate]]:
    """Each hint in strict mode at its own peak (where the budget allows it) and in ready mode at
    each factor under each policy (the reserving default, and greedy: with memory to spare it
    can gain more, docs/policy.md); candidates whose caps come out equal are simulated once,
    and so is `reserve` where the reservation cannot hold (a cap below the hint's peak on some
    rank, rank.reservation_holds): every rank then runs greedy, the same schedule."""
    out: list[tuple[HintOrder, Candidate]] = []
    seen: set[Choice] = set()
    for order in orders:
        for mode in modes:
            for factor in ((1.0,) if mode == "strict" else factors):
                caps = _caps(order, factor, limit)
                if mode == "strict" and any(c < order.peak(r) for r, c in enumerate(caps)):
                    continue  # strict cannot run under a cap below its own peak
                for policy in (("reserve",) if mode == "strict" else POLICIES):
                    if (mode, policy) == ("ready", "reserve") and not reservation_holds(
                            order, caps):
                        continue  # greedy, the candidate next to it
                    choice = Choice(order.name, order.placement.style, mode, caps, policy)
                    if choice not in seen:
                        seen.add(choice)
                        out.append((order, Candidate(choice, factor)))
    return out


def _promise(item: tuple[HintOrder, Candidate]) -> tuple[object, ...]:
    """Simulation order under pruning: the most memory first (it usually wins, and the first
    fast candidate sets a tight bound for the rest), ready before strict, greedy before
    reserve; then the stable order of `candidates`."""
    c = item[1].choice
    return (-sum(c.cap), c.mode == "strict", c.policy != "greedy")


def choose_auto(run: Run, hint: object, *, num_stages: int, num_ranks: int | None,
                num_microbatches: int, split_backward: bool, budget: CapSpec = None,
                modes: Sequence[str] = MODES, factors: Sequence[float] = FACTORS,
                prune: bool = True) -> Tuning:
    """`choose_schedule` over the candidates of a shape; `hint` is "auto" (any placement style
    for `num_ranks`, default one rank per stage) or "auto:<hint>" (that hint's placement, and
    relative budgets measured against it)."""
    start = parse_auto(hint) or None
    style = reference = None
    if start is not None:
        reference = make_hint(start, num_stages=num_stages, num_ranks=num_ranks,
                              num_microbatches=num_microbatches, split_backward=split_backward)
        style, num_ranks = reference.placement.style, reference.num_ranks
    orders = candidate_hints(num_stages=num_stages, num_ranks=num_ranks or num_stages,
                             num_microbatches=num_microbatches, split_backward=split_backward,
                             placement=style)
    return choose_schedule(run, orders, budget=budget, reference=reference, modes=modes,
                           factors=factors, prune=prune)


def choose_schedule(run: Run, orders: Sequence[HintOrder], *, budget: CapSpec = None,
                    reference: HintOrder | None = None, modes: Sequence[str] = MODES,
                    factors: Sequence[float] = FACTORS, prune: bool = True) -> Tuning:
    """Simulate every candidate with `run` and return them ranked, the fastest that fits first.

    `prune`: stop a candidate once it is known to be slower than the best so far (the module's
    note); the choice is the same either way.

    `reference`: the hint a relative budget ('2x') is measured against (default: the first of
    `orders` that an auto pipeline of that placement starts from, else the first).
    Raises ConfigError when no candidate fits the budget.
    """
    if not orders:
        raise ConfigError("no candidate hint for this pipeline shape", expected="at least one "
                          "library hint valid for the stages, ranks and split", got="none")
    for mode in modes:
        if mode not in MODES:
            raise ConfigError("mode", expected=" | ".join(MODES), got=repr(mode))
    if reference is None:
        first = orders[0]
        want = start_hint(first.placement.style, first.split_backward)
        reference = next((o for o in orders if o.name == want), first)
    limit = _limit(budget, reference)
    rows = []
    bound: float | None = None
    for order, cand in sorted(candidates(orders, limit, modes, factors), key=_promise):
        c = cand.choice
        try:
            result = run(order, c.mode, c.cap, c.policy, bound if prune else None)
        except Exceeded as stop:
            rows.append(Row(cand, stop.at_least, math.nan, (), False, stopped=True))
            continue
        peak = tuple(result.peak_in_flight)
        row = Row(cand, result.step_time, result.efficiency, peak, _fits(peak, limit))
        rows.append(row)
        if row.fits and (bound is None or row.step_time < bound):
            bound = row.step_time
    rows.sort(key=lambda r: r.key)
    best = next((r for r in rows if r.fits), None)
    if best is None:
        tried = ", ".join(sorted({f"{r.candidate.choice.label} {r.candidate.choice.how}"
                                  for r in rows})) or "nothing (no mode allowed under it)"
        raise ConfigError("no candidate schedule fits the budget",
                          expected=f"peak in-flight <= {list(limit)} per rank",
                          got=f"every candidate over it; tried {tried}",
                          fix="raise the budget, or allow mode 'ready' (it runs under any cap)")
    return Tuning(tuple(rows), limit, best)

