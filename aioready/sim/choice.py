"""Choosing a schedule by simulating the candidates: hints x modes x budgets, fastest that fits.

The candidates are every library hint valid for the pipeline's shape (stages, ranks, microbatches,
split backward; a fixed placement style when the caller fixed one), each in strict mode at its
own peak and in ready mode (every policy) at 1x, 1.5x and 2x its own peak in-flight count per
rank and at the whole budget on every rank, each cap clipped to the caller's budget (by default the peak of the hint an auto pipeline
starts from: the memory a pipeline holds without auto). Under a byte budget, each ready candidate
runs byte-gated, and also count-capped with the bytes as a backstop (sim/budget.py
`Limit.counted`; the table's form column). Each is simulated by `run` with the same
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
rank), or with a byte budget (`memory=`) the bytes passed as `memory=`, and "fits" compares the
simulated peak in-flight count, or peak activation bytes, with the caller's budget resolved the
same way. Both live in sim/budget.py (`Limit`), and nothing else here depends on the form.
"""

from __future__ import annotations

import logging
import math
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Iterator, Protocol, Sequence

from ..caps import CapSpec
from ..errors import AioreadyError, ConfigError
from ..hints import HintOrder
from ..memory import MemorySpec
from ..runtime.autotune import parse_auto, start_hint
from ..runtime.choosers import STYLES, Choice
from ..runtime.rank import MODES, POLICIES, reservation_holds
from ..schedulers import HINTS, hint_names, make_hint
from ..schedulers.order import ORDERS
from .budget import COUNTS, Limit, MeanBytes
from .cutoff import Exceeded

__all__ = ["FACTORS", "Candidate", "Row", "Tuning", "candidate_hints", "candidates",
           "choose_auto", "choose_schedule", "WHOLE"]

WHOLE = math.inf
"""A factor that stands for the whole budget on every rank (sim/budget.py `Limit.whole`)."""

FACTORS = (1.0, 1.5, 2.0, WHOLE)
"""Ready-mode budgets tried, as multiples of each hint's own peak in-flight count, and the
whole budget (a candidate's row then shows the factor that reaches it)."""

class Simulated(Protocol):
    """What the ranking reads of a simulation (a SimResult has it)."""

    @property
    def step_time(self) -> float: ...

    @property
    def efficiency(self) -> float: ...

    @property
    def peak_in_flight(self) -> Sequence[int]: ...

    @property
    def peak_activation_bytes(self) -> Sequence[int]: ...


Run = Callable[[HintOrder, str, tuple[int, ...], str, "float | None"], Simulated]
"""run(hint, mode, caps, policy, bound): one candidate simulated on the durations being tuned
for; with a bound, it may raise sim.cutoff.Exceeded once its step time is known to exceed it.
Under a byte budget it is also given `memory=` (bytes per rank), to simulate with the caps as
each byte budget's count (sim/budget.py `gated`), and read for its peak bytes;
a candidate in a cost order (`reorder=` of choose_schedule) is given `microbatch_order=`."""


@dataclass(frozen=True, slots=True)
class Candidate:
    choice: Choice
    factor: float  # the budget as a multiple of the hint's own peak (before clipping)
    order: str = "given"  # the microbatch order (schedulers/order.py ORDERS)
    counts: float | None = None  # byte budget: count-capped at this many reference peaks

    @property
    def form(self) -> str:
        """What gates it: its order alone (strict), its caps ("count"), the bytes ("bytes"), or
        under a byte budget its caps with the bytes as backstop ("count Nx", clipped to N times
        the reference's peak count)."""
        c = self.choice
        if c.mode == "strict":
            return "order"  # strict runs its order whatever the budget
        if c.memory is None:
            return "count"
        return "bytes" if self.counts is None else f"count {self.counts:g}x"

    @property
    def label(self) -> str:
        """The hint's label, with "+ascending" or "+descending" where microbatches run in that
        cost order (schedulers/order.py)."""
        return self.choice.label + ("" if self.order == "given" else f"+{self.order}")


@dataclass(frozen=True, slots=True)
class Row:
    """One simulated candidate; times in the durations' unit (ms)."""

    candidate: Candidate
    step_time: float
    efficiency: float  # lower bound / step time
    peak_in_flight: tuple[int, ...]
    fits: bool
    stopped: bool = False  # pruned: step_time is then only a lower bound, above the best's
    peak: tuple[int, ...] = ()  # what the budget compares: peak_in_flight, or peak bytes

    @property
    def key(self) -> tuple[object, ...]:
        c = self.candidate.choice
        peak = self.peak or self.peak_in_flight or (0,)
        return (self.stopped, self.step_time, max(peak), sum(peak),
                0 if c.mode == "strict" else 1, POLICIES.index(c.policy),
                ORDERS.index(self.candidate.order), c.hint, c.placement, self.candidate.factor)


@dataclass(frozen=True, slots=True)
class Tuning:
    """What the tuner simulated, best first, and what it chose."""

    rows: tuple[Row, ...]
    limit: tuple[int, ...]  # the caller's budget per rank (counts, or bytes with `in_bytes`)
    best: Row
    in_bytes: bool = False
    held: bool = False  # the budget counts (chunk, microbatch) activations (sim/budget.py)

    @property
    def choice(self) -> Choice:
        return Choice(**{f: getattr(self.best.candidate.choice, f)
                         for f in ("hint", "placement", "mode", "cap", "policy", "memory")},
                      table=self.table(), order=self.best.candidate.order)

    def table(self) -> str:
        """The rows as text, best first; '*' marks the choice, '-' a candidate over budget.
        Where candidates ran in several microbatch orders, a column says which; under a byte
        budget, a column says what gates each (Candidate.form)."""
        base = self.best.step_time
        show = Limit(self.limit, self.in_bytes).text
        orders = any(r.candidate.order != "given" for r in self.rows)
        lines = [f"{'':1} {'hint':<20} " + (f"{'order':<11} " if orders else "") +
                 f"{'mode':<12} " + (f"{'form':<10} " if self.in_bytes else "") +
                 f"{'budget':>6} {'step ms':>10} "
                 f"{'vs best':>7} {'eff':>5}  " + ("peak bytes (budgets)" if self.in_bytes
                                                  else "peak held (caps)" if self.held
                                                  else "peak in-flight (caps)")]
        for row in self.rows:
            c = row.candidate.choice
            mark = "*" if row is self.best else (" " if row.fits or row.stopped else "-")
            name = f"{c.label:<20} {row.candidate.order:<11} " if orders else \
                f"{row.candidate.label:<20} "
            form = f"{row.candidate.form:<10} " if self.in_bytes else ""
            head = f"{mark:1} {name}{c.how:<12} {form}{row.candidate.factor:>5g}x "
            given = "strict: none" if self.in_bytes and c.memory is None else show(
                c.memory if self.in_bytes else c.cap)  # type: ignore[arg-type]
            if row.candidate.counts is not None:
                given = f"caps {list(c.cap)}, {given}"
            if row.stopped:
                lines.append(head + f"{'>' + format(row.step_time, '.4g'):>10} "
                             f"{'>' + format(row.step_time / base, '.3f'):>7} {'-':>5}  "
                             f"stopped ({given})")
                continue
            lines.append(head + f"{row.step_time:>10.4g} {row.step_time / base:>7.3f} "
                         f"{row.efficiency:>5.3f}  {show(row.peak or row.peak_in_flight)} "
                         f"({given})")
        stopped = sum(r.stopped for r in self.rows)
        if stopped:
            lines.append(f"stopped: {stopped} of {len(self.rows)} candidates, as soon as they "
                         "were known to be slower than the best (their step time is a lower "
                         "bound)")
        lines.append(f"budget per rank: {show(self.limit)}; chosen: {self.best.candidate.label} "
                     f"{self.best.candidate.choice.how} at {self.best.candidate.factor:g}x"
                     + (f" ({self.best.candidate.form})" if self.in_bytes else ""))
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


def candidates(orders: Iterable[HintOrder], limit: Limit | tuple[int, ...],
               modes: Sequence[str] = MODES, factors: Sequence[float] = FACTORS
               ) -> list[tuple[HintOrder, Candidate]]:
    """Each hint in strict mode at its own peak (where the budget allows it) and in ready mode at
    each factor under each policy (the reserving default, and greedy: with memory to spare it
    can gain more, docs/policy.md); candidates whose caps come out equal are simulated once,
    and so is `reserve` where the reservation cannot hold (a cap below the hint's peak on some
    rank, rank.reservation_holds): every rank then runs greedy, the same schedule; `drain`
    only with a split backward (without W it decides as greedy)."""
    gate = limit if isinstance(limit, Limit) else Limit(tuple(limit))
    out: list[tuple[HintOrder, Candidate]] = []
    seen: set[Choice] = set()
    for order in orders:
        for mode in modes:
            for factor in ((1.0,) if mode == "strict" else factors):
                if factor == WHOLE:
                    factor = gate.whole(order)
                given = gate.gate(order, mode, factor)
                if given is None:
                    continue  # strict cannot run under a cap below its own peak
                caps, memory = given
                for policy in (("reserve",) if mode == "strict" else POLICIES):
                    if (mode, policy) == ("ready", "reserve") and not reservation_holds(
                            order, caps):
                        continue  # greedy, the candidate next to it
                    if policy == "drain" and not order.split_backward:
                        continue  # no W to hold back: greedy's schedule
                    choice = Choice(order.name, order.placement.style, mode, caps, policy,
                                    memory)
                    if choice not in seen:
                        seen.add(choice)
                        out.append((order, Candidate(choice, factor)))
        if gate.in_bytes and "ready" in modes:
            out += _counted(order, gate, factors, seen)
    return out


def _counted(order: HintOrder, gate: Limit, factors: Sequence[float], seen: set[Choice]
             ) -> list[tuple[HintOrder, Candidate]]:
    """Under a byte budget, `order`'s count-capped ready candidates (sim/budget.py COUNTS)."""
    out = []
    for counts in COUNTS:
        for factor in factors:
            if factor == WHOLE:
                factor = Limit(tuple(max(1, int(counts * p)) for p in gate.reference)).whole(
                    order)
            caps, memory = gate.counted(order, factor, counts)
            for policy in POLICIES:
                if policy == "reserve" and not reservation_holds(order, caps):
                    continue
                choice = Choice(order.name, order.placement.style, "ready", caps, policy, memory)
                if choice not in seen:
                    seen.add(choice)
                    out.append((order, Candidate(choice, factor, counts=counts)))
    return out


PROMISING = ("zb-h2", "zb-h1", "interleaved-zb", "zbv", "bfw", "gpipe")
"""Hints that most often won in bench.policy (they defer W, or run every F early), tried first
among candidates of equal memory: only the order of the search, never its answer."""


def _promise(item: tuple[HintOrder, Candidate]) -> tuple[object, ...]:
    """Simulation order under pruning: the most memory first (it usually wins, and the first
    fast candidate sets a tight bound for the rest), ready before strict, greedy before
    reserve, PROMISING hints first; then the stable order of `candidates`."""
    c = item[1].choice
    rank = PROMISING.index(c.hint) if c.hint in PROMISING else len(PROMISING)
    return (-sum(c.memory or c.cap), item[1].counts is not None, c.mode == "strict",
            c.policy != "greedy", rank)


def choose_auto(run: Run, hint: object, *, num_stages: int, num_ranks: int | None,
                num_microbatches: int, split_backward: bool, budget: CapSpec = None,
                modes: Sequence[str] = MODES, factors: Sequence[float] = FACTORS,
                prune: bool = True, memory: MemorySpec = None,
                mean_bytes: MeanBytes | None = None, activations: int | None = None,
                reorder: Callable[[HintOrder], bool] | None = None) -> Tuning:
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
                           factors=factors, prune=prune, memory=memory, mean_bytes=mean_bytes,
                           activations=activations, reorder=reorder)


def choose_schedule(run: Run, orders: Sequence[HintOrder], *, budget: CapSpec = None,
                    reference: HintOrder | None = None, modes: Sequence[str] = MODES,
                    factors: Sequence[float] = FACTORS, prune: bool = True,
                    memory: MemorySpec = None, mean_bytes: MeanBytes | None = None,
                    activations: int | None = None,
                    reorder: Callable[[HintOrder], bool] | None = None) -> Tuning:
    """Simulate every candidate with `run` and return them ranked, the fastest that fits first.

    `prune`: stop a candidate once it is known to be slower than the best so far (the module's
    note); the choice is the same either way.

    `reference`: the hint a relative budget ('2x') is measured against (default: the first of
    `orders` that an auto pipeline of that placement starts from, else the first).
    `memory`: a byte budget instead of `budget` (any form of aioready.memory; sim/budget.py),
    with `mean_bytes` the bytes per microbatch of the durations.
    `activations`: instead of both, (chunk, microbatch) activations each rank may hold
    (sim/budget.py, "held activations").
    `reorder(hint)`: True where the durations carry known microbatch sizes that `cost_order`
    would change; each candidate is then also simulated with its microbatches in each cost order
    (`run(..., microbatch_order=how)`, schedulers/order.py ORDERS), and wins only by its simulated step
    time.
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
    ref = reference

    def reference_peak() -> Sequence[int]:
        return run(ref, "strict", tuple(ref.default_caps), "reserve",  # type: ignore[arg-type]
                   None).peak_activation_bytes
    limit = (Limit((activations,) * ref.num_ranks, held=True) if activations is not None
             else Limit.resolve(budget, memory, reference, mean_bytes, reference_peak))
    rows = []
    bound: float | None = None
    with _quiet():
        todo = candidates(orders, limit, modes, factors)
        if reorder is not None:
            todo += [(o, replace(c, order=how)) for o, c in todo if reorder(o)
                     for how in ORDERS[1:]]
        for order, cand in sorted(todo, key=_promise):
            _one(run, order, cand, limit, rows, bound if prune else None)
            done = rows[-1]
            if done.fits and (bound is None or done.step_time < bound):
                bound = done.step_time
    rows.sort(key=lambda r: r.key)
    best = next((r for r in rows if r.fits), None)
    if best is None:
        tried = ", ".join(sorted({f"{r.candidate.choice.label} {r.candidate.choice.how}"
                                  for r in rows})) or "nothing (no mode allowed under it)"
        raise ConfigError("no candidate schedule fits the budget",
                          expected=f"{limit.what} <= {limit.text(limit.per_rank)} per rank",
                          got=f"every candidate over it; tried {tried}",
                          fix="raise the budget, or allow mode 'ready' (it runs under any cap)")
    return Tuning(tuple(rows), limit.per_rank, best, limit.in_bytes, limit.held)



def _one(run: Run, order: HintOrder, cand: Candidate, limit: Limit, rows: list[Row],
         bound: float | None) -> None:
    """Simulate one candidate (stopped past `bound`) and append its row."""
    c = cand.choice
    extra: dict[str, object] = {} if c.memory is None else {"memory": c.memory}
    if cand.order != "given":
        extra["microbatch_order"] = cand.order
    try:
        result = run(order, c.mode, c.cap, c.policy, bound, **extra)
    except Exceeded as stop:
        rows.append(Row(cand, stop.at_least, math.nan, (), False, stopped=True))
        return
    peak = limit.peak(result.peak_in_flight,
                      result.peak_activation_bytes if limit.in_bytes else (), order, c.mode)
    rows.append(Row(cand, result.step_time, result.efficiency, tuple(result.peak_in_flight),
                    limit.fits(peak), peak=peak))


class _NotAlone(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "alone is predicted" not in record.getMessage()


@contextmanager
def _quiet() -> Iterator[None]:
    """Candidates under small byte budgets warn that a microbatch alone exceeds them; the table
    shows their peaks, so the tuner keeps those warnings out of the log."""
    held = logging.getLogger("aioready.held_bytes")
    quiet = _NotAlone()
    held.addFilter(quiet)
    try:
        yield
    finally:
        held.removeFilter(quiet)
