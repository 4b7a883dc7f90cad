"""hint="auto" in a Pipeline: run the first steps, ask a chooser, switch, re-check every N steps.

The choosing itself simulates candidate schedules on the measured durations, and the simulator
(aioready.sim) sits above the runtime: the runtime may not import it, not even lazily. So the
runtime defines what it needs from a chooser (runtime/choosers.py: reports in, a `Choice`
out) and looks the default one up in `CHOOSERS`, which the root package fills with the
simulator's tuner. A caller may pass any other chooser through `AutoHint(chooser=...)`.

Every rank must switch identically at the same step, or two ranks would run one step under
different orders. In one process the reports of every rank are at hand. Under MPI the step
reports are gathered to rank 0 as numbers (telemetry/gather.py), rank 0 chooses, and the choice
crosses to the others as a few integers (hint, placement, mode, policy, microbatch order, one
cap and one byte budget per rank; under a byte budget each forward's measured bytes are
gathered beside the spans): no pickle, and no rank decides from data another lacks. Where auto
chooses the microbatch order too, each step's costs travel with its spans
(runtime/auto_order.py).

A switch happens between steps, so a step runs wholly under one hint: gradients stay those of
the unsplit model (tests/test_autotune.py checks them across switches).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Sequence

from ..caps import CapSpec
from ..clock import virtual_clock
from ..errors import ConfigError
from ..hints import HintOrder
from ..memory import Budget, MemorySpec
from ..schedulers import HINTS, hint_names
from ..telemetry.spans import StepReport, merge_reports
from .auto_order import OrderChoice, agreed
from .choosers import CHOOSERS, Choice, Chooser
from .mb_order import step_order

__all__ = ["AutoHint", "AutoTuning", "parse_auto", "start_hint"]

log = logging.getLogger(__name__)

def parse_auto(hint: object) -> str | HintOrder | None:
    """For "auto" (or "auto:<hint>", which names the hint to start from and so the placement):
    the start hint's name (AutoHint: its name or order), "" when none is named; None for any
    other hint."""
    if isinstance(hint, AutoHint):
        return hint.start or ""
    if not isinstance(hint, str):
        return None
    head, _, start = hint.partition(":")
    return start.strip() if head.strip().lower() == "auto" else None


def start_hint(style: str, split_backward: bool) -> str:
    """The hint an auto pipeline of this placement style starts from (and measures under)."""
    if style == "linear":
        return "1f1b"
    if style == "interleaved":
        return "interleaved-zb" if split_backward else "interleaved-1f1b"
    return "zbv" if split_backward else "bf"


@dataclass(frozen=True, slots=True)
class AutoHint:
    """`Pipeline(hint=AutoHint(...))`; the text "auto" is AutoHint() and "auto:zbv" is
    AutoHint(start="zbv")."""

    start: str | HintOrder | None = None  # the hint of the first steps (fixes the placement
    # style; an order: a rule on a placement of its choice, as sim/start.py chooses)
    retune_every: int = 50  # steps between re-checks after the first choice; 0: choose once
    window: int = 1  # the last steps whose spans a choice is made from (also the warm-up)
    chooser: Chooser | None = None  # None: CHOOSERS["simulate"]
    comm: Any = None  # under MPI: the communicator the ranks agree over (None: COMM_WORLD)

    def __post_init__(self) -> None:
        for name, least in (("retune_every", 0), ("window", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ConfigError(f"AutoHint {name}", expected=f"an integer >= {least}",
                                  got=repr(value))


class AutoTuning:
    """The per-pipeline state of hint="auto": when to choose, and the choices made."""

    def __init__(self, auto: AutoHint, budget: CapSpec, memory: MemorySpec = None) -> None:
        self.auto = auto
        self.budget = budget
        self.memory = memory  # a byte budget instead of `budget`
        self.choices: list[tuple[int, Choice]] = []  # (first step it ran, choice)
        self.reference: HintOrder | None = None  # the start hint: relative budgets measure it
        self.orders: OrderChoice | None = None  # set where auto chooses the microbatch order
        chooser = auto.chooser
        if chooser is None:
            if "simulate" not in CHOOSERS:
                raise ConfigError("hint='auto' has no chooser", expected="import aioready "
                                  "(it registers the simulator's)", got="none registered")
            chooser = CHOOSERS["simulate"]()
        self.chooser = chooser

    @classmethod
    def for_pipeline(cls, hint: str | AutoHint, *, budget: CapSpec, num_stages: int,
                     world_size: int | None, split_backward: bool, coordinator: Any = None,
                     choose_order: bool = False, memory: MemorySpec = None
                     ) -> tuple[AutoTuning, str]:
        """The tuning state of a Pipeline given `hint` "auto", and the hint it starts with;
        `choose_order`: it chooses the microbatch order too (runtime/auto_order.py); `memory`:
        it chooses within that byte budget instead of `budget` (the module's note)."""
        if coordinator is not None:
            raise ConfigError("hint='auto' with a tensor-parallel coordinator",
                              expected="a named hint", got=repr(hint))
        auto = hint if isinstance(hint, AutoHint) else AutoHint(start=parse_auto(hint) or None)
        start = auto.start
        if start is None:
            chunks = 1 if world_size is None else num_stages // world_size
            if chunks != 1:
                raise ConfigError(f"hint='auto' with {chunks} stages per rank: the placement "
                                  "is not known", expected="'auto:interleaved-1f1b', "
                                  "'auto:zbv' or another 'auto:<hint>'", got=repr(hint))
            start = start_hint("linear", split_backward)
        tuning = cls(auto, budget, memory)
        if choose_order and memory is None:
            tuning.orders = OrderChoice(auto.window)
        return tuning, start

    @classmethod
    def for_policy(cls, hint: object, *, budget: CapSpec, coordinator: Any = None,
                   memory: MemorySpec = None) -> AutoTuning:
        """The tuning state of `policy="auto"`: the pipeline keeps its hint and cap, and after
        the first step runs whichever ready-mode policy the measured durations run faster
        (docs/policy.md "Choosing the policy"), re-checked every `retune_every` steps."""
        if coordinator is not None:
            raise ConfigError("policy='auto' with a tensor-parallel coordinator",
                              expected="policy 'reserve' or 'greedy'", got="'auto'")
        name = hint.name if isinstance(hint, HintOrder) else hint
        if not isinstance(name, str) or name not in HINTS:
            raise ConfigError("policy='auto' switches between library schedules by name",
                              expected=f"a library hint ({', '.join(hint_names())})",
                              got=repr(name), fix="or choose policy='reserve' or 'greedy'")
        if "policy" not in CHOOSERS:
            raise ConfigError("policy='auto' has no chooser", expected="import aioready "
                              "(it registers the simulator's)", got="none registered")
        return cls(AutoHint(start=name, chooser=CHOOSERS["policy"]()), budget, memory)

    def due(self, steps_done: int) -> bool:
        """After `steps_done` steps: the first choice after the warm-up window, then every
        `retune_every` steps."""
        first = self.auto.window
        if steps_done < first:
            return False
        if steps_done == first:
            return True
        every = self.auto.retune_every
        return every > 0 and (steps_done - first) % every == 0

    def step_order(self, how: str, num_microbatches: int, inputs: list[Any] | None,
                   costs: Sequence[float] | None, *, one_process: bool,
                   stages: int | None = None, split_backward: bool = True
                   ) -> tuple[int, ...] | None:
        """A step's slot order (mb_order.step_order), its costs kept where auto chooses it."""
        if self.orders is None:
            return step_order(how, num_microbatches, inputs, costs, one_process=one_process,
                              stages=stages, split_backward=split_backward)
        return self.orders.step_slots(how, num_microbatches, inputs, costs,
                                      one_process=one_process, stages=stages,
                                      split_backward=split_backward)

    async def after_step(self, pipe: Any) -> None:
        if self.reference is None:
            self.reference = pipe.hint
        if self.orders is not None:
            self.orders.finished(pipe.step_index - 1)
        if not self.due(len(pipe.history)):
            return
        choice = await self._agree(pipe)
        if self.orders is None:  # the caller fixed the order (or policy="auto")
            choice = replace(choice, order=pipe.microbatch_order)
        order = choice.build(num_stages=pipe.hint.placement.num_stages,
                             num_ranks=pipe.hint.num_ranks,
                             num_microbatches=pipe.microbatches,
                             split_backward=pipe.hint.split_backward)
        _check_every_rank(choice, order)
        budgets = pipe.memory if self.memory is None else _budgets(choice)
        before = [(rt.hint, rt.mode, rt.cap, rt._caps, rt._policy, rt.memory)
                  for rt in pipe.runtimes]
        try:
            for rt in pipe.runtimes:
                rt.reschedule(order, choice.mode, choice.cap[rt.rank], caps=choice.cap,
                              policy=choice.policy,
                              memory=None if budgets is None else budgets[rt.rank])
        except Exception:  # all ranks of this process switch, or none
            for rt, (hint, mode, cap, caps, policy, memory) in zip(pipe.runtimes, before):
                rt.reschedule(hint, mode, cap, caps=caps, policy=policy, memory=memory)
            raise
        pipe.hint, pipe.mode, pipe.microbatch_order = order, choice.mode, choice.order
        pipe.memory = budgets
        self.choices.append((pipe.step_index, choice))
        if choice.table:
            log.info("hint=auto after step %d: %s %s, caps %s, microbatch order %s\n%s",
                     pipe.step_index - 1, choice.label, choice.how, list(choice.cap),
                     choice.order, choice.table)

    async def _agree(self, pipe: Any) -> Choice:
        recent = pipe.history[-self.auto.window:]
        transport = pipe.transport
        if transport is None or transport.world_size == 1:
            reports = [merge_reports(r) for r in recent]
            if self.orders is not None:
                reports = self.orders.reports(reports)
            return await self._choose(reports, pipe)
        return await self._agree_mpi(pipe, [r[0] for r in recent])

    async def _choose(self, reports: list[StepReport], pipe: Any) -> Choice:
        """On a real loop in a worker thread: simulating the candidates takes a while, and the
        loop must keep serving (heartbeats to peers, a service's requests) meanwhile. A virtual
        clock cannot wait for a thread (it would see nothing scheduled): there, inline."""
        assert self.reference is not None
        virtual = virtual_clock(asyncio.get_running_loop()) is not None
        extra = {} if self.memory is None else {"memory": self.memory}
        choose = partial(self.chooser.choose, reports, hint=self.reference, budget=self.budget,
                         unit_ms=1.0 if virtual else 1000.0, **extra)
        return choose() if virtual else await asyncio.to_thread(choose)

    async def _agree_mpi(self, pipe: Any, mine: list[StepReport]) -> Choice:
        from ..telemetry.gather import gather_reports, root_decides
        comm = self.auto.comm
        if comm is None:
            from mpi4py import MPI
            comm = MPI.COMM_WORLD
        if comm.Get_size() != pipe.hint.num_ranks:
            raise ConfigError("hint='auto' agrees over a communicator of the pipeline's ranks",
                              expected=f"{pipe.hint.num_ranks} ranks",
                              got=f"{comm.Get_size()}", fix="pass AutoHint(comm=...)")
        gathered = await gather_reports(mine, comm, activations=self.memory is not None)
        reports = None if gathered is None else [report for report, _ in gathered]
        orders, steps, costs = self.orders, [r.step for r in mine], None
        if orders is not None:  # every rank's costs, compared on the root (auto_order.py)
            from ..telemetry.gather import gather_rows
            costs = await gather_rows(comm, orders.rows(steps, pipe.microbatches),
                                      pipe.microbatches)

        async def decide() -> Choice:  # the root decides
            assert reports is not None
            if orders is None:
                return await self._choose(reports, pipe)
            known = agreed(costs, steps, comm.Get_size())
            return await self._choose(orders.reports(reports, costs=known), pipe)
        return await root_decides(comm, None if reports is None else decide,
                                  Choice.width(pipe.hint.num_ranks),
                                  encode=Choice.encode, decode=Choice.decode,
                                  what="schedule to switch to")


def _budgets(choice: Choice) -> list[Budget] | None:
    """Each rank's byte gate for a choice made within a byte budget: its bytes with its caps as
    the count (a byte-gated choice's caps are the microbatch count, which never binds; a strict
    choice runs its order, ungated), as sim/budget.py `gated` simulated it."""
    if choice.memory is None:
        return None
    return [Budget(bytes=int(m), count=int(c)) for m, c in zip(choice.memory, choice.cap)]


def _check_every_rank(choice: Choice, order: HintOrder) -> None:
    """Refuse a choice that some rank could not run, on every rank alike (under MPI a process
    checks all ranks' caps, not only its own, so no rank switches while another fails)."""
    n = order.num_ranks
    if len(choice.cap) != n or min(choice.cap) < 1:
        raise ConfigError("hint='auto': a choice needs one cap >= 1 per rank",
                          expected=f"{n} caps >= 1", got=f"{list(choice.cap)}")
    if choice.mode == "strict":
        low = [r for r in range(n) if choice.cap[r] < order.peak(r)]
        if low:
            raise ConfigError(f"strict mode cannot run hint {order.name!r} under this cap",
                              rank=low[0], expected=f"cap >= the hint's peak in-flight "
                              f"({order.peak(low[0])})", got=choice.cap[low[0]],
                              fix="a chooser must pick ready mode under a cap below the peak")
