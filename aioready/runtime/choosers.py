"""Choosers: what hint="auto" asks for a schedule, the `Choice` it gets back, and the registry
of the default chooser.

The choosing simulates candidate schedules, and the simulator (aioready.sim) sits above the
runtime, which may not import it, not even lazily. So the runtime names the surface it needs
(`Chooser`) and looks the default up here by name; the root package registers the simulator's
(aioready/__init__.py), so any import of aioready fills it. This module imports only the
hint library at load time, so registering costs `import aioready` next to nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

from ..schedulers import HINTS, hint_names, make_hint
from ..schedulers.order import ORDERS

if TYPE_CHECKING:
    from ..caps import CapSpec
    from ..hints import HintOrder
    from ..telemetry.spans import StepReport

__all__ = ["Chooser", "Choice", "CHOOSERS", "STYLES"]

STYLES = ("linear", "interleaved", "v")
"""Placement styles, in the order their index crosses ranks."""


@dataclass(frozen=True, slots=True)
class Choice:
    """One schedule: a library hint on a placement style, a mode, one cap per rank, the
    ready-mode policy (rank.POLICIES; ignored by strict) and the microbatch order
    (schedulers.order.ORDERS; runtime/auto_order.py)."""

    hint: str  # a name of schedulers.HINTS
    placement: str  # one of STYLES
    mode: str
    cap: tuple[int, ...]  # per rank; the budget the candidate ran under
    policy: str = "reserve"
    memory: tuple[int, ...] | None = None  # per rank, bytes: the byte gate instead of the caps
    table: str = field(default="", compare=False, repr=False)  # what it was chosen from
    order: str = "given"  # the microbatch order

    @property
    def label(self) -> str:
        home = HINTS[self.hint].style
        return self.hint if self.placement == home else f"{self.hint}@{self.placement}"

    @property
    def how(self) -> str:
        """The mode, with the policy where it is not the default ("ready/greedy")."""
        return self.mode if self.mode == "strict" or self.policy == "reserve" else \
            f"{self.mode}/{self.policy}"

    def build(self, *, num_stages: int, num_ranks: int, num_microbatches: int,
              split_backward: bool) -> HintOrder:
        return make_hint(self.hint, num_stages=num_stages, num_ranks=num_ranks,
                         num_microbatches=num_microbatches, split_backward=split_backward,
                         placement=self.placement)

    def encode(self) -> list[int]:
        """Integers that cross ranks (no pickle): hint, placement, mode, policy, microbatch
        order, then the caps, then the byte budgets (zeros for none; `width` in all)."""
        from .rank import MODES, POLICIES
        return [hint_names().index(self.hint), STYLES.index(self.placement),
                MODES.index(self.mode), POLICIES.index(self.policy), ORDERS.index(self.order),
                *self.cap, *(self.memory or (0,) * len(self.cap))]

    @staticmethod
    def width(num_ranks: int) -> int:
        """How many integers `encode` gives for a pipeline of `num_ranks` ranks."""
        return 5 + 2 * num_ranks

    @classmethod
    def decode(cls, values: Sequence[int]) -> Choice:
        from .rank import MODES, POLICIES
        n = (len(values) - 5) // 2
        memory = tuple(int(v) for v in values[5 + n:])
        return cls(hint_names()[values[0]], STYLES[values[1]], MODES[values[2]],
                   tuple(int(v) for v in values[5:5 + n]), POLICIES[values[3]],
                   memory=memory if any(memory) else None, order=ORDERS[values[4]])




class Chooser(Protocol):
    """The whole surface a Pipeline needs to tune itself: measured steps in, a schedule out.

    `reports`: merged step reports (every rank's spans) of the last steps, times on the loop
    clock (`unit_ms` ms per unit); `hint`: the hint the pipeline started from (its placement
    is fixed; a relative budget like '2x' is measured against its peak); `budget`: the
    caller's limit, any form of aioready.caps (None: the start hint's own peak, the memory
    the pipeline would hold without auto).
    """

    def choose(self, reports: Sequence[StepReport], *, hint: HintOrder, budget: CapSpec,
               unit_ms: float) -> Choice: ...


CHOOSERS: dict[str, Callable[[], Chooser]] = {}
"""Named chooser factories; "simulate" is the default (registered by aioready/__init__.py)."""
