"""Choosing a schedule by simulating the candidates: hints x modes x budgets, fastest that fits.

The candidates are every library hint valid for the pipeline's shape (stages, ranks, microbatches,
split backward; a fixed placement style when the caller fixed one), each in strict mode at its
own peak and in ready mode (both policies) at 1x, 1.5x and 2x its own peak in-flight count per
rank, each cap clipped to the caller's budget (by default the peak of the hint an auto pipeline
starts from: the memory a pipeline holds without auto). Each is simulated by `run` with the same
durations: the real runtime on the virtual clock, so the step time is exact for those durations, not a model of it.
The fastest whose peak in-flight fits the budget wins; ties go to the smaller peak, then strict
(the more predictable), then the hint's name, so the choice is a pure function of the durations.

What it leaves out: durations are the measured ones, replayed as they were (another step's
jitter differs); communication costs only what the `run` function adds; a different placement
(ranks, chunks) is never a candidate, since the stages are already where they are.

Note [budget form]: a candidate's budget is the value passed as `cap=` to `run` (one cap per
rank), and "fits" compares the simulated peak in-flight with the caller's budget resolved the
same way. Both live in `_limit`, `_caps` and `_fits` below, so a budget in bytes changes those
three and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Protocol, Sequence

from ..caps import CapSpec, resolve_caps
from ..errors import AioreadyError, ConfigError
from ..hints import HintOrder
from ..runtime.autotune import parse_auto, start_hint
from ..runtime.choosers import STYLES, Choice
from ..runtime.rank import MODES, POLICIES
from ..schedulers import HINTS, hint_names, make_hint

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


Run = Callable[[HintOrder, str, tuple[int, ...], str], Simulated]
"""run(hint, mode, caps, policy): one candidate simulated on the durations being tuned for."""


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

    @property
    def key(self) -> tuple[object, ...]:
        c = self.candidate.choice
        return (self.step_time, max(self.peak_in_flight), sum(self.peak_in_flight),
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
            mark = "*" if row is self.best else (" " if row.fits else "-")
            lines.append(f"{mark:1} {c.label:<20} {c.how:<12} {row.candidate.factor:>5g}x "
                         f"{row.step_time:>10.4g} {row.step_time / base:>7.3f} "
                         f"{row.efficiency:>5.3f}  {list(row.peak_in_flight)} "
                         f"({list(c.cap)})")
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
    can gain more, docs/policy.md); candidates whose caps come out equal are simulated once."""
    out: list[tuple[HintOrder, Candidate]] = []
    seen: set[Choice] = set()
    for order in orders:
        for mode in modes:
            for factor in ((1.0,) if mode == "strict" else factors):
                caps = _caps(order, factor, limit)
                if mode == "strict" and any(c < order.peak(r) for r, c in enumerate(caps)):
                    continue  # strict cannot run under a cap below its own peak
                for policy in (("reserve",) if mode == "strict" else POLICIES):
                    choice = Choice(order.name, order.placement.style, mode, caps, policy)
                    if choice not in seen:
                        seen.add(choice)
                        out.append((order, Candidate(choice, factor)))
    return out


def choose_auto(run: Run, hint: object, *, num_stages: int, num_ranks: int | None,
                num_microbatches: int, split_backward: bool, budget: CapSpec = None,
                modes: Sequence[str] = MODES, factors: Sequence[float] = FACTORS) -> Tuning:
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
                           factors=factors)


def choose_schedule(run: Run, orders: Sequence[HintOrder], *, budget: CapSpec = None,
                    reference: HintOrder | None = None, modes: Sequence[str] = MODES,
                    factors: Sequence[float] = FACTORS) -> Tuning:
    """Simulate every candidate with `run` and return them ranked, the fastest that fits first.

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
    for order, cand in candidates(orders, limit, modes, factors):
        result = run(order, cand.choice.mode, cand.choice.cap, cand.choice.policy)
        peak = tuple(result.peak_in_flight)
        rows.append(Row(cand, result.step_time, result.efficiency, peak, _fits(peak, limit)))
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

