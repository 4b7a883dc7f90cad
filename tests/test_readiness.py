"""`ready` mode runs other ready work while the hint's next task waits, and finishes sooner.

Scenario: microbatch 0's backward is slow at stage 1 (8 units instead of 2), S=4, M=8, F=1, B=2,
on the virtual clock (times are exact, not wall clock).
"""

from __future__ import annotations

from typing import Sequence

import pytest

import aioready
from aioready.clock import run_virtual
from aioready.devices.base import TaskInfo
from aioready.devices.sim import SimDevice
from aioready.schedulers.listsched import sequence_at_caps
from aioready.tasks import Kind, Task


def slow_b0_at_stage1(info: TaskInfo) -> float:
    if info.stage == 1 and info.microbatch == 0 and info.kind is Kind.B:
        return 8.0
    return {Kind.F: 1.0, Kind.B: 2.0, Kind.W: 1.0}[info.kind]


def run(mode: str, hint: str, cap: int | None = None, split: bool = False,
        policy: str = "reserve") -> aioready.Pipeline:
    async def main() -> aioready.Pipeline:
        pipe = aioready.Pipeline([None] * 4, None, microbatches=8, hint=hint, mode=mode,
                                 cap=cap, split_backward=split, policy=policy,
                                 device=SimDevice(slow_b0_at_stage1, run_compute=False))
        await pipe.step()
        return pipe
    return run_virtual(main())


def overtakes(pipe: aioready.Pipeline, orders: Sequence[Sequence[Task]] | None = None
              ) -> list[tuple[int, str, str]]:
    """(rank, task run, next task of `orders`) wherever a rank ran a task ahead of the next one
    of its order because that one was not ready yet. `orders`: the hint's (greedy, strict), or
    the sequence the reservation protects."""
    found = []
    report = pipe.last_step
    for rank in range(4):
        hint_order = [str(t) for t in (orders or pipe.hint.orders)[rank]]
        spans = {s.label: s for s in report.spans if s.rank == rank}
        done: set[str] = set()
        for label in report.order(rank):
            nxt = next(t for t in hint_order if t not in done)
            if label != nxt:
                assert spans[nxt].ready > spans[label].start, (
                    f"rank {rank} ran {label} although the hint's next task {nxt} was ready")
                found.append((rank, label, nxt))
            done.add(label)
    return found


@pytest.mark.parametrize("split", [False, True], ids=["full", "split"])
@pytest.mark.parametrize("policy", ["reserve", "greedy"])
def test_ready_runs_other_work_first_and_finishes_sooner(split: bool, policy: str) -> None:
    """1F1B hint; ready mode gets memory slack (cap 8 instead of 1F1B's 4..1) to use it. Greedy
    never passes over a ready task the hint ranks higher; the reservation never passes over a
    ready task of the sequence it protects, which above the hint's peak is the sequence the
    hint runs at those caps (listsched.sequence_at_caps)."""
    strict = run("strict", "1f1b", split=split)
    ready = run("ready", "1f1b", cap=8, split=split, policy=policy)
    assert overtakes(strict) == []
    if policy == "greedy":
        assert overtakes(ready), "ready mode never ran ahead of the hint"
    else:
        protected = sequence_at_caps(ready.hint, [8] * 4).sequence
        assert protected is not None
        overtakes(ready, protected)  # asserts it never passed over a ready protected task
        ran = [ready.last_step.order(rank) for rank in range(4)]
        assert ran != [[str(t) for t in order] for order in ready.hint.orders], (
            "ready mode ran the hint's own order: the memory above its peak went unused")
    assert ready.last_step.step_time < strict.last_step.step_time
    if not split:
        assert strict.last_step.step_time == 39.0  # (M+S-1)*(F+B) = 33, plus 6 extra units


def test_with_the_hints_own_cap_greedy_gains_nothing_here() -> None:
    """The honest counterpart (docs/policy_measurements.md "Where the gains come from"): at the
    1F1B cap there is no slack to use."""
    assert run("ready", "1f1b").last_step.step_time >= run("strict", "1f1b").last_step.step_time


def test_strict_mode_runs_exactly_the_hint_order() -> None:
    for hint in ("gpipe", "1f1b"):
        pipe = run("strict", hint)
        for rank in range(4):
            assert pipe.last_step.order(rank) == [str(t) for t in pipe.hint.orders[rank]]


def test_ready_mode_with_the_hints_cap_never_exceeds_it() -> None:
    pipe = run("ready", "1f1b")
    assert pipe.last_step.peak_in_flight == {r: 4 - r for r in range(4)}
    assert Task(Kind.F, 0) == Task.parse("F0")
