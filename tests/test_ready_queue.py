"""Every ready queue the arbiter may be handed conforms to arbiter.ReadyQueue: the ReadySet in
both modes, and a tensor-parallel group's leader and member queues (tp/coordination.py)."""

from __future__ import annotations

import pytest

from aioready.arbiter import ReadyQueue, Wakeup
from aioready.ready_set import ReadySet
from aioready.schedulers import make_hint
from aioready.tasks import Kind, Task
from aioready.tp.coordination import Coordinator, decode_decision, encode_decision
from aioready.transports.base import Message
from aioready.transports.inproc import InprocWorld

F0, B0 = Task(Kind.F, 0), Task(Kind.B, 0)


def _ready_set(mode: str) -> ReadySet:
    hint = make_hint("1f1b", num_stages=2, num_microbatches=4)
    return ReadySet(hint.priority(1), cap=2, num_chunks=1, split_backward=False,
                    strict_order=hint.strict_order(1) if mode == "strict" else None)


def _wrapped(tp_rank: int, mode: str = "ready") -> tuple[ReadySet, ReadyQueue, Coordinator]:
    coord = Coordinator(InprocWorld(2).endpoint(tp_rank))
    inner = _ready_set(mode)
    errors: list[BaseException] = []
    queue = coord.wrap(inner, step=0, mode=mode, wakeup=Wakeup(), fail=errors.append)
    assert not errors
    return inner, queue, coord


@pytest.mark.parametrize("mode", ["ready", "strict"])
def test_ready_set_is_a_ready_queue(mode: str) -> None:
    assert isinstance(_ready_set(mode), ReadyQueue)


async def test_tp_leader_and_member_queues_are_ready_queues() -> None:
    for tp_rank in (0, 1):
        inner, queue, _ = _wrapped(tp_rank)
        assert isinstance(queue, ReadyQueue) and not isinstance(queue, ReadySet)
    inner, queue, _ = _wrapped(1, mode="strict")  # every member follows the hint itself
    assert queue is inner


async def test_member_reports_the_microbatches_in_flight_and_the_leaders_next_decision() -> None:
    _, member, coord = _wrapped(1)
    coord._deliver(encode_decision(0, 0, F0).received_from(0))
    coord._deliver(encode_decision(0, 1, B0).received_from(0))
    assert member.next_in_order == F0 and member.pop_nowait() is None  # F0's input not here
    member.push(F0)
    assert member.ready_tasks() == [F0] and member.pop_nowait() == F0
    assert member.in_flight_microbatches == [0] and member.next_in_order == B0
    member.done(F0)
    member.push(B0)
    assert member.pop_nowait() == B0
    member.done(B0)
    assert member.in_flight_microbatches == [] and member.peak_in_flight == 1
    assert member.statistics().peak_in_flight == 1 and member.next_in_order is None


async def test_leader_reports_its_ready_sets_state() -> None:
    world = InprocWorld(2)
    decided: list[Message] = []
    world.endpoint(1).open(decided.append)
    coord = Coordinator(world.endpoint(0), follow_in_strict=True)
    inner = _ready_set("strict")
    errors: list[BaseException] = []
    leader = coord.wrap(inner, step=0, mode="strict", wakeup=Wakeup(), fail=errors.append)
    assert isinstance(leader, ReadyQueue) and leader is not inner
    assert leader.next_in_order == inner.next_in_order == F0
    leader.push(F0)
    assert leader.pop_nowait() == F0
    assert leader.in_flight_microbatches == inner.in_flight_microbatches == [0]
    assert leader.next_in_order == inner.next_in_order == B0
    await world.endpoint(0).wait_sent()
    assert [(m.source, decode_decision(m)) for m in decided] == [(0, (0, F0))] and not errors
