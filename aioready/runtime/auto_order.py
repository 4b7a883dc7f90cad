"""hint="auto" chooses the microbatch order too, from each step's known costs.

The microbatch order (runtime/mb_order.py, docs/policy.md "The microbatch order") needs a cost
per microbatch known before the step: `step(costs=...)`, or in one process the inputs' bytes.
The runtime knows them, so a Pipeline with hint="auto" whose caller left `microbatch_order`
open records them with each step and hands the chooser its measured steps in the caller's
microbatch order (spans renumbered from slots back to the caller's indices) with the costs
attached (`StepReport.costs`). The chooser replays them in the given order and in both cost
orders and keeps the fastest in simulation, as `aioready.simulate(hint="auto")` does; later
steps run the chosen order through the same `cost_order` path as `microbatch_order=`.

Under MPI rank 0 chooses for all. Every rank must reorder alike, so each rank's recorded costs
are gathered to rank 0 as numbers (no pickle), which compares them before it chooses: a rank
whose costs differ ends the choice with a ConfigError on every rank (naming the rank, the step
and the microbatch) instead of pairing one microbatch's inputs with another's targets. Where
some rank has no costs (it passed none: under MPI only the first stage holds inputs), the
order stays as given.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from ..errors import ConfigError
from ..schedulers.order import check_costs
from ..telemetry.spans import StepReport
from .mb_order import input_bytes, step_order

__all__ = ["OrderChoice", "agreed", "in_caller_order"]

Record = tuple[tuple[float, ...] | None, tuple[int, ...] | None]
"""What a step ran by: the costs in the caller's order (None: unknown) and slot -> the caller's
microbatch (None: the given order)."""


def in_caller_order(report: StepReport, record: Record) -> StepReport:
    """A copy of `report` with microbatches numbered as the caller gave them, and its costs."""
    costs, slots = record
    spans = report.spans if slots is None else [
        s._replace(microbatch=slots[s.microbatch]) for s in report.spans]
    return StepReport(report.step, list(spans), report.start, report.end, report.num_ranks,
                      dict(report.peak_in_flight), dict(report.peak_activation_bytes), costs)


class OrderChoice:
    """The costs of a Pipeline's recent steps, kept while hint="auto" may choose the order."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.records: dict[int, Record] = {}  # step -> what it ran by
        self._pending: Record = (None, None)

    def step_slots(self, how: str, num_microbatches: int, inputs: list[Any] | None,
                   costs: Sequence[float] | None, *, one_process: bool,
                   stages: int | None = None, split_backward: bool = True
                   ) -> tuple[int, ...] | None:
        """`mb_order.step_order` for a step whose order auto may change: `costs=` is accepted
        under the given order too, and the step's costs are kept for the next choice."""
        known: tuple[float, ...] | None = None
        if costs is not None:
            known = tuple(check_costs(costs, num_microbatches))
        elif one_process and inputs is not None:
            known = tuple(input_bytes(mb) for mb in inputs)
        slots = None if how == "given" else step_order(
            how, num_microbatches, inputs, known if known is not None else costs,
            one_process=one_process, stages=stages, split_backward=split_backward)
        self._pending = (known, slots)
        return slots

    def finished(self, step: int) -> None:
        """The step just run: keep its record (and the last `window` only)."""
        self.records[step] = self._pending
        self._pending = (None, None)
        for old in [s for s in self.records if s <= step - self.window]:
            del self.records[old]

    def reports(self, reports: Sequence[StepReport], *, costs: bool = True
                ) -> list[StepReport]:
        """The reports in the caller's order, with costs where every step has them (and
        `costs`: under MPI, every rank had them)."""
        records = [self.records.get(r.step, (None, None)) for r in reports]
        if not costs or any(known is None for known, _ in records):
            records = [(None, slots) for _, slots in records]
        return [in_caller_order(r, rec) for r, rec in zip(reports, records)]

    def rows(self, steps: Sequence[int], num_microbatches: int) -> Any:
        """This rank's costs of `steps` as float64 rows (NaN where unknown), for the gather."""
        import numpy as np
        nan = (math.nan,) * num_microbatches
        return np.array([self.records.get(s, (None, None))[0] or nan for s in steps],
                        dtype=np.float64).reshape(len(steps), num_microbatches)


def agreed(gathered: Any, steps: Sequence[int], num_ranks: int) -> bool:
    """On rank 0: whether every rank had costs for `steps` (gathered rows, rank-major); where
    all had them, they must be the same: a ConfigError names the first rank that differs."""
    import numpy as np
    per_rank = np.asarray(gathered).reshape(num_ranks, len(steps), -1)
    if np.isnan(per_rank).any():
        return False
    for rank in range(1, num_ranks):
        differ = np.argwhere(per_rank[rank] != per_rank[0])
        if len(differ):
            i, mb = (int(v) for v in differ[0])
            raise ConfigError(
                "hint='auto' orders microbatches by their costs, which must be the same on "
                "every rank", rank=rank, step=steps[i],
                expected=f"costs[{mb}] = {float(per_rank[0, i, mb])!r} (rank 0's)",
                got=repr(float(per_rank[rank, i, mb])),
                fix="pass every rank the same step(costs=...), or fix microbatch_order")
    return True
