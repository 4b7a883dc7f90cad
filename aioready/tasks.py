"""Tasks of one training step and the rules that say what each one needs.

A task is a small immutable value: kind (F forward, B backward for the input gradient -- and for
the weight gradient too when backward is not split --, W weight gradient), the rank-local chunk
and the microbatch. Its one text form (`F3`, `B0`, `W7`, `F3c1` for chunk 1) is used in hint files,
logs, errors and tests, and round-trips through `Task.parse`.

Dependencies (docs/architecture.md "The task graph"), for the stage s that a chunk holds:
  F(s,m) needs the activation of F(s-1,m)            (stage 0: the microbatch itself)
  B(s,m) needs F(s,m) and the gradient of B(s+1,m)   (last stage: only its own F)
  W(s,m) needs B(s,m)
This module imports neither torch nor mpi4py.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Iterator, Sequence

from .errors import HintError

__all__ = ["Kind", "Task", "Need", "needs", "StepNeeds", "step_needs", "all_tasks", "backward_kinds"]


class Kind(enum.IntEnum):
    """The three task kinds; the integer value is what travels in message headers."""

    F = 0
    B = 1
    W = 2


_TEXT = re.compile(r"^([FBW])(\d+)(?:c(\d+))?$")


@dataclass(frozen=True, slots=True, order=True)
class Task:
    """One unit of compute of one rank: kind, microbatch, rank-local chunk."""

    kind: Kind
    microbatch: int
    chunk: int = 0
    # the generated hash, computed once: a task is a dict key ~20 times in its life (0.5 -> 0.1 us)
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.kind, self.microbatch, self.chunk)))

    def __hash__(self) -> int:
        return self._hash

    def __str__(self) -> str:
        base = f"{self.kind.name}{self.microbatch}"
        return f"{base}c{self.chunk}" if self.chunk else base

    def text(self, *, show_chunk: bool) -> str:
        """The text form; `show_chunk` writes `c0` too, for ranks that hold several chunks."""
        base = f"{self.kind.name}{self.microbatch}"
        return f"{base}c{self.chunk}" if show_chunk else base

    @classmethod
    def parse(cls, text: str) -> "Task":
        """Parse `F3`, `B0c1`, `W7`; raise HintError naming the text otherwise."""
        match = _TEXT.match(text.strip())
        if match is None:
            raise HintError(
                "cannot parse a task",
                expected="a task like F3, B0, W7 or F3c1",
                got=repr(text),
            )
        kind, mb, chunk = match.groups()
        return cls(Kind[kind], int(mb), int(chunk) if chunk else 0)


class Need(enum.Enum):
    """What a task waits for besides its local predecessor."""

    INPUT = "input"  # the microbatch (stage 0) or an activation from the stage before
    GRAD = "grad"  # the gradient from the stage after
    NOTHING = "nothing"


def backward_kinds(split_backward: bool) -> tuple[Kind, ...]:
    """The backward kinds a step has: B alone, or B and W when backward is split."""
    return (Kind.B, Kind.W) if split_backward else (Kind.B,)


def all_tasks(
    num_chunks: int, num_microbatches: int, split_backward: bool
) -> Iterator[Task]:
    """Every task of one rank in one step, in (chunk, kind, microbatch) order."""
    kinds = (Kind.F, *backward_kinds(split_backward))
    for chunk in range(num_chunks):
        for kind in kinds:
            for mb in range(num_microbatches):
                yield Task(kind, mb, chunk)


def needs(task: Task, *, is_last_stage: bool) -> tuple[Task | None, Need]:
    """The local task that must be done first, and the message-borne need, of `task`.

    F needs no local task (its input comes from the stage before, which may be local: the
    transport delivers that too). B needs its own F, and the gradient unless it is on the last
    stage. W needs its own B.
    """
    if task.kind is Kind.F:
        return None, Need.INPUT
    if task.kind is Kind.B:
        pred = Task(Kind.F, task.microbatch, task.chunk)
        return pred, (Need.NOTHING if is_last_stage else Need.GRAD)
    return Task(Kind.B, task.microbatch, task.chunk), Need.NOTHING


@dataclass(frozen=True, slots=True)
class StepNeeds:
    """`needs` tabulated for one rank's step, so a runtime counts instead of re-deriving them.

    `counts`: per task, how many needs it waits for (its local predecessor, its input or
    gradient). `unblocks`: per local predecessor, the task whose need its end satisfies.
    `messages`: the tasks whose need arrives as a message (an input past stage 0, a gradient).
    """

    counts: dict[Task, int]
    unblocks: dict[Task, Task]
    messages: dict[Task, Need]


def step_needs(
    stages: Sequence[int], num_stages: int, num_microbatches: int, split_backward: bool
) -> StepNeeds:
    """Tabulate `needs` for every task of a rank whose chunk c holds stage `stages[c]`.

    Shared, so read only: a pipeline shape's tables are built once per process, where every
    candidate of the tuner (sim/choice.py) builds a runtime per rank (at S=32, a tenth of its
    time went here)."""
    return _step_needs(tuple(stages), num_stages, num_microbatches, split_backward)


@lru_cache(maxsize=512)
def _step_needs(stages: tuple[int, ...], num_stages: int, num_microbatches: int,
                split_backward: bool) -> StepNeeds:
    last = num_stages - 1
    out = StepNeeds({}, {}, {})
    for task in all_tasks(len(stages), num_microbatches, split_backward):
        stage = stages[task.chunk]
        pred, need = needs(task, is_last_stage=stage == last)
        out.counts[task] = (pred is not None) + (need is not Need.NOTHING)
        if pred is not None:
            out.unblocks[pred] = task
        if need is Need.GRAD or (need is Need.INPUT and stage > 0):
            out.messages[task] = need
    return out
