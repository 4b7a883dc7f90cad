"""Greedy list scheduling of a ranking under fixed durations: the strict sequence of a rule.

A priority rule (BF, BFW) has no sequence of its own; to run one in `strict` mode, or to turn it
into an order hint (ZB-H2), we run the rule once in a small discrete-event model and record what
each rank ran. The model: zero communication latency; completions are applied one at a time in
(time, rank) order, and after each one every idle rank, in rank order, pops its best admissible
task from a ReadySet (the same class and the same entry-only gate the runtime uses), so a rank
that frees up at t may decide before it sees what a higher-numbered rank finishes at t. With the
BFW ranking and cap 2R-1 this reproduces the ZB-H2 order of docs/hints.md "Reference orders"
literally (R=4, M=8). Durations default to unit cost (F=1, B=1, W=1 split; B=2 unsplit); uniform
scaling does not change the result. Pure and deterministic: no asyncio, no torch.

We chose this over running the runtime under the virtual clock because there same-instant ties
fall out of event-loop callback order; here they are part of a written, stable model.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Sequence

from ..errors import HintError
from ..hints import HintOrder
from ..placement import Placement
from ..ready_set import ReadySet
from ..tasks import Kind, Task, step_needs

__all__ = ["ListSchedule", "list_schedule", "unit_duration", "sequence_at_caps"]

Duration = Callable[[int, Task], float]  # (stage, task) -> time


def unit_duration(split_backward: bool) -> Duration:
    """F=1, B=1, W=1 with split backward; F=1, B=2 (a full backward) without."""
    b = 1.0 if split_backward else 2.0
    return lambda stage, task: b if task.kind is Kind.B else 1.0


@dataclass(frozen=True, slots=True)
class ListSchedule:
    """What each rank ran, in order, and when the last task ended."""

    orders: tuple[tuple[Task, ...], ...]
    makespan: float
    peaks: tuple[int, ...]


def _rankings(ranking: Sequence[Sequence[Task] | Mapping[Task, int]]) -> list[Mapping[Task, int]]:
    return [r if isinstance(r, Mapping) else {t: i for i, t in enumerate(r)} for r in ranking]


def list_schedule(
    placement: Placement, num_microbatches: int, split_backward: bool,
    ranking: Sequence[Sequence[Task] | Mapping[Task, int]], caps: Sequence[int],
    duration: Duration | None = None,
) -> ListSchedule:
    """Run `ranking` (per rank: tasks best first, or task -> rank) greedily; see the module doc."""
    R, S, M = placement.num_ranks, placement.num_stages, num_microbatches
    dur = duration or unit_duration(split_backward)
    prios = _rankings(ranking)
    v = placement.num_chunks
    sets = [ReadySet(prios[r], cap=caps[r], num_chunks=v, split_backward=split_backward)
            for r in range(R)]
    needs = [step_needs(placement.stages_of(r), S, M, split_backward) for r in range(R)]
    missing = {(r, t): n for r in range(R) for t, n in needs[r].counts.items()}
    ran: list[list[Task]] = [[] for _ in range(R)]
    busy = [False] * R
    events: list[tuple[float, int, int, Task]] = []
    seq = 0
    # an idle rank whose ready set did not change since it last found nothing still finds
    # nothing: only these ranks are asked (the same decisions as asking every rank, in O(1)
    # per event instead of O(R): seconds at R=128)
    changed: set[int] = set(range(R))

    def satisfy(rank: int, task: Task) -> None:
        missing[(rank, task)] -= 1
        if missing[(rank, task)] == 0:
            sets[rank].push(task)
            changed.add(rank)

    def at(stage: int, kind: Kind, mb: int) -> tuple[int, Task]:
        rank = placement.rank_of(stage)
        return rank, Task(kind, mb, placement.chunk_of(stage))

    for m in range(M):
        satisfy(*at(0, Kind.F, m))
    now, left = 0.0, len(missing)
    while True:
        asked = sorted(changed)
        changed.clear()
        for r in asked:
            if not busy[r]:
                task = sets[r].pop_nowait()
                if task is not None:
                    busy[r] = True
                    ran[r].append(task)
                    stage = placement.stage_of(r, task.chunk)
                    heapq.heappush(events, (now + dur(stage, task), r, seq, task))
                    seq += 1
        if not events:
            break
        now, r, _, task = heapq.heappop(events)
        busy[r] = False
        changed.add(r)
        left -= 1
        sets[r].done(task)
        local = needs[r].unblocks.get(task)
        if local is not None:
            satisfy(r, local)
        stage = placement.stage_of(r, task.chunk)
        if task.kind is Kind.F and stage < S - 1:
            satisfy(*at(stage + 1, Kind.F, task.microbatch))
        elif task.kind is Kind.B and stage > 0:
            satisfy(*at(stage - 1, Kind.B, task.microbatch))
    if left:
        raise HintError("the ranking stalls under list scheduling", expected="every task run",
                        got=f"{left} tasks left at t={now}",
                        fix="raise the caps (each must be >= 1)")
    return ListSchedule(tuple(tuple(o) for o in ran), now,
                        tuple(s.peak_in_flight for s in sets))


def sequence_at_caps(hint: HintOrder, caps: Sequence[int]) -> HintOrder:
    """`hint` with the sequence its ranking runs under `caps` instead of its own caps.

    Why: ready mode's reservation (ready_set Note [reservation]) protects the hint's sequence.
    Above the hint's own peak that sequence is the wrong thing to protect: it leaves the extra
    memory to entry forwards run ahead of it, one at a time and late, and at three times the
    peak the reserving rule reached 0.81 of greedy's efficiency (docs/policy.md). The sequence
    derived here already uses the caps. It is a function of the hint and the caps alone, so
    every rank derives the same one, and the list schedule that derives it is a run of all the
    sequences together, so they run to completion and hold their caps (its peaks). Memoised on
    the hint per caps.
    """
    key = ("sequence_at_caps", tuple(caps))

    def derive() -> HintOrder:
        derived = list_schedule(hint.placement, hint.num_microbatches, hint.split_backward,
                                hint.orders, caps)
        return replace(hint, sequence=derived.orders)

    return hint.memoised(key, derive)
