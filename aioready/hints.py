"""HintOrder: a per-rank ranking of that rank's tasks, used by the arbiter as a hint.

Two kinds of hint reduce to the same value (DESIGN.md "Hint orders"): an *order* (rank = position
in a list: 1F1B, ZB-H1, an imported torch order) and a *priority rule* (rank computed from the
task: BF, BFW). Both are stored as one list per rank, sorted by rank. An order is also a valid
sequence to run in `strict` mode; a rule is not (its sorted list ignores dependencies), so
`is_sequence` is False for rules and strict mode refuses them unless the scheduler derived a
sequence for them.

The default cap of a rank is the hint's own peak in-flight count on that rank: walking the order
in sequence, a microbatch enters at the F of the rank's entry chunk (chunk 0) and leaves when its
last local backward piece (B unsplit, W split, over every chunk) is done.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from .errors import HintError
from .placement import Placement
from .tasks import Kind, Task, all_tasks, needs

__all__ = ["HintOrder", "peak_in_flight", "first_dependency_violation"]


def peak_in_flight(order: Sequence[Task], *, num_chunks: int, split_backward: bool) -> int:
    """Largest number of microbatches in flight on a rank that runs `order` in sequence."""
    pieces = num_chunks  # one last-kind piece (B unsplit, W split) per chunk
    last_kind = Kind.W if split_backward else Kind.B
    left: dict[int, int] = {}
    now = peak = 0
    for task in order:
        if task.kind is Kind.F and task.chunk == 0:
            left[task.microbatch] = pieces
            now += 1
            peak = max(peak, now)
        elif task.kind is last_kind:
            left[task.microbatch] -= 1
            if left[task.microbatch] == 0:
                now -= 1
    return peak


def first_dependency_violation(
    order: Sequence[Task], placement: Placement, rank: int, split_backward: bool
) -> Task | None:
    """The first task of `order` that comes before a local task it needs, or None.

    Only dependencies between tasks of the same rank are checked: F(s) after F(s-1) when both
    stages are local (V placement), B after its F and after the local B of the next stage, W after
    its B.
    """
    stages = placement.stages_of(rank)
    last = placement.num_stages - 1
    seen: set[Task] = set()
    for task in order:
        stage = stages[task.chunk]
        pred, _ = needs(task, is_last_stage=stage == last)
        local: list[Task] = [pred] if pred is not None else []
        if task.kind is Kind.F and stage > 0 and placement.rank_of(stage - 1) == rank:
            local.append(Task(Kind.F, task.microbatch, placement.chunk_of(stage - 1)))
        if task.kind is Kind.B and stage < last and placement.rank_of(stage + 1) == rank:
            local.append(Task(Kind.B, task.microbatch, placement.chunk_of(stage + 1)))
        if any(dep not in seen for dep in local):
            return task
        seen.add(task)
    return None


@dataclass(frozen=True, slots=True)
class HintOrder:
    """One ranking per rank; `orders[r][i]` has hint rank i on rank r."""

    name: str
    placement: Placement
    num_microbatches: int
    split_backward: bool
    orders: tuple[tuple[Task, ...], ...]
    is_sequence: bool = True
    default_caps: tuple[int, ...] | None = None
    source: str = ""
    _priority: tuple[dict[Task, int], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        orders = tuple(tuple(o) for o in self.orders)
        object.__setattr__(self, "orders", orders)
        self._validate_tasks()
        object.__setattr__(
            self, "_priority", tuple({t: i for i, t in enumerate(o)} for o in orders)
        )
        if self.default_caps is None:
            caps = tuple(
                peak_in_flight(o, num_chunks=self.placement.num_chunks,
                               split_backward=self.split_backward)
                if self.is_sequence else self.num_microbatches
                for o in orders
            )
            object.__setattr__(self, "default_caps", caps)

    def _validate_tasks(self) -> None:
        R = self.placement.num_ranks
        if len(self.orders) != R:
            raise HintError(
                f"hint {self.name!r} has the wrong number of ranks",
                expected=R, got=len(self.orders),
            )
        expected = set(
            all_tasks(self.placement.num_chunks, self.num_microbatches, self.split_backward)
        )
        for rank, order in enumerate(self.orders):
            seen: set[Task] = set()
            for task in order:
                if task in seen:
                    raise HintError(f"hint {self.name!r} lists a task twice",
                                    rank=rank, task=task, expected="each task once", got="twice")
                if task not in expected:
                    raise HintError(
                        f"hint {self.name!r} lists a task that is not part of this step",
                        rank=rank, task=task,
                        expected=f"tasks of {self.placement.num_chunks} chunk(s), "
                        f"{self.num_microbatches} microbatches, "
                        f"{'split' if self.split_backward else 'unsplit'} backward",
                        got=str(task),
                    )
                seen.add(task)
            if len(seen) != len(expected):
                missing = sorted(expected - seen)
                raise HintError(
                    f"hint {self.name!r} misses tasks", rank=rank,
                    expected=f"{len(expected)} tasks", got=f"{len(seen)}; first missing {missing[0]}",
                )

    @property
    def num_ranks(self) -> int:
        return self.placement.num_ranks

    def priority(self, rank: int) -> dict[Task, int]:
        """Task -> hint rank (smaller runs first) on `rank`."""
        return self._priority[rank]

    def peak(self, rank: int) -> int:
        """Peak in-flight microbatches of this rank when the order runs in sequence."""
        return peak_in_flight(self.orders[rank], num_chunks=self.placement.num_chunks,
                              split_backward=self.split_backward)

    def check_sequence(self) -> None:
        """Refuse an order that breaks a local dependency (what strict mode needs)."""
        if not self.is_sequence:
            raise HintError(
                f"hint {self.name!r} is a priority rule, not a sequence",
                expected="an order hint for strict mode", got="a priority rule",
                fix="use mode='ready' or an order hint such as 1f1b",
            )
        for rank, order in enumerate(self.orders):
            bad = first_dependency_violation(order, self.placement, rank, self.split_backward)
            if bad is not None:
                raise HintError(
                    f"hint {self.name!r} runs a task before a local task it needs",
                    rank=rank, task=bad, expected="dependencies in order",
                    got=f"{bad} too early",
                )

    def dumps(self) -> str:
        """The plain text form: a header comment, then one line per rank."""
        multi = self.placement.num_chunks > 1
        lines = [
            f"# aioready hint {self.name}: stages={self.placement.num_stages} "
            f"ranks={self.num_ranks} microbatches={self.num_microbatches} "
            f"placement={self.placement.style} split_backward={str(self.split_backward).lower()}"
        ]
        for order in self.orders:
            lines.append(" ".join(t.text(show_chunk=multi) for t in order))
        return "\n".join(lines) + "\n"

    @classmethod
    def loads(cls, text: str, *, name: str = "file", placement: str | None = None) -> "HintOrder":
        """Parse the text form. Comment lines start with '#'; the header comment is optional."""
        style = placement
        rows: list[tuple[int, list[Task]]] = []
        for lineno, raw in enumerate(text.splitlines(), start=1):
            line = raw.strip()
            if not line:
                continue
            if line.startswith("#"):
                found = re.search(r"placement=(\w+)", line)
                if found and style is None:
                    style = found.group(1)
                continue
            tasks = []
            for word in line.split():
                try:
                    tasks.append(Task.parse(word))
                except HintError as exc:
                    raise HintError(f"{name}, line {lineno}: cannot parse task {word!r}",
                                    expected=exc.expected, got=exc.got) from None
            rows.append((lineno, tasks))
        if not rows:
            raise HintError(f"{name}: no rank lines", expected="one line of tasks per rank",
                            got="nothing")
        every = [t for _, ts in rows for t in ts]
        chunks = 1 + max(t.chunk for t in every)
        mbs = 1 + max(t.microbatch for t in every)
        split = any(t.kind is Kind.W for t in every)
        style = style or ("linear" if chunks == 1 else "interleaved")
        place = Placement(len(rows) * chunks, len(rows), style)
        try:
            return cls(name, place, mbs, split, tuple(tuple(ts) for _, ts in rows), source=name)
        except HintError as exc:
            line = rows[exc.rank][0] if exc.rank is not None and exc.rank < len(rows) else None
            where = f"{name}, line {line}" if line else name
            raise HintError(f"{where}: {exc.what}", rank=exc.rank, task=exc.task,
                            expected=exc.expected, got=exc.got) from None

    @classmethod
    def load(cls, path: str | Path, **kw: object) -> "HintOrder":
        p = Path(path)
        return cls.loads(p.read_text(), name=str(p), **kw)  # type: ignore[arg-type]

    @classmethod
    def from_orders(
        cls, name: str, placement: Placement, num_microbatches: int, split_backward: bool,
        orders: Iterable[Iterable[Task]], **kw: object,
    ) -> "HintOrder":
        return cls(name, placement, num_microbatches, split_backward,
                   tuple(tuple(o) for o in orders), **kw)  # type: ignore[arg-type]
