"""The leader decides, members follow: torch-free runs on the virtual clock."""

import random

import pytest
from tp_grid import Grid

from aioready.arbiter import Wakeup
from aioready.clock import run_virtual
from aioready.devices.sim import SimDevice
from aioready.errors import CoordinationError, ProtocolError
from aioready.ready_set import ReadySet
from aioready.schedulers import make_hint
from aioready.tasks import Kind, Task
from aioready.tp.coordination import Coordinator, decode_decision, encode_decision
from aioready.transports.base import Message, MessageKind
from aioready.transports.inproc import InprocWorld

BASE = {Kind.F: 1.0, Kind.B: 2.0, Kind.W: 1.0}


def jittery(p: int, t: int, seed: int = 0) -> SimDevice:
    """Durations differ per TP rank: unsynchronised members would see readiness differently."""
    def duration(info):
        rng = random.Random(hash((seed, p, t, info.step, info.stage, info.microbatch, info.kind)))
        return BASE[info.kind] * rng.uniform(0.3, 3.0)
    return SimDevice(duration, run_compute=False)


def run_grid(*, pp=2, tp=2, mode="ready", coordinate=True, cap=4, hint="1f1b", M=8, steps=2,
             split=False, **options):
    h = make_hint(hint, num_stages=pp, num_microbatches=M, split_backward=split)
    grid = Grid(h, tp, mode=mode, cap=cap, device=jittery, coordinate=coordinate, **options)

    async def main():
        for step in range(steps):
            await grid.step(step)
    run_virtual(main())
    return grid


@pytest.mark.parametrize("pp, tp, split", [(2, 2, False), (3, 2, True), (2, 4, False)])
def test_members_run_the_leaders_sequence(pp, tp, split):
    grid = run_grid(pp=pp, tp=tp, split=split)
    per_step = 8 * (3 if split else 2)
    for p in range(pp):
        for step in (0, 1):
            lead = grid.order(p, 0, step)
            assert len(lead) == per_step
            for t in range(1, tp):
                assert grid.order(p, t, step) == lead
                # a member's in-flight bookkeeping mirrors the leader's ReadySet
                assert (grid.runtimes[p][t].reports[step].peak_in_flight
                        == grid.runtimes[p][0].reports[step].peak_in_flight)
        assert grid.coordinators[p][0].num_decisions_sent == 2 * per_step * (tp - 1)
        assert all(grid.coordinators[p][t].num_decisions_received == 2 * per_step
                   for t in range(1, tp))
    assert grid.num_decision_messages == pp * 2 * per_step * (tp - 1)


def test_without_coordination_members_diverge():
    """The scenario the coordinator exists for: the same jitter, no leader, different orders."""
    grid = run_grid(coordinate=False)
    assert any(grid.order(p, 0, s) != grid.order(p, 1, s) for p in range(2) for s in (0, 1))
    assert grid.num_decision_messages == 0


def test_strict_mode_sends_no_decisions():
    grid = run_grid(mode="strict", cap=None)
    assert grid.num_decision_messages == 0
    for p in range(2):
        assert grid.order(p, 0) == grid.order(p, 1) == [str(t) for t in grid.runtimes[p][0]
                                                        .hint.strict_order(p)]


def test_following_in_strict_mode_is_a_benchmark_control():
    """follow_in_strict: members follow the leader's (strict) order through decisions."""
    grid = run_grid(mode="strict", cap=None, follow_in_strict=True, record=True)
    assert grid.num_decision_messages == 2 * 2 * 16
    for p in range(2):
        assert grid.order(p, 0) == grid.order(p, 1) == [str(t) for t in grid.runtimes[p][0]
                                                        .hint.strict_order(p)]
        member = grid.coordinators[p][1]
        assert len(member.waits) == len(member.times) == 2 * 16
        leader = grid.coordinators[p][0]
        # every decision arrives once, in the order sent, and never before it was sent
        assert [(s, q) for s, q, _ in member.times] == [(s, q) for s, q, _ in leader.times]
        assert all(got >= sent for (_, _, got), (_, _, sent) in zip(member.times, leader.times))


def test_decision_round_trip():
    for task in (Task(Kind.F, 3), Task(Kind.B, 0, 1), Task(Kind.W, 7, 2)):
        msg = encode_decision(5, 11, task)
        assert msg.kind is MessageKind.DECISION and msg.step == 5
        assert decode_decision(msg) == (11, task)
    with pytest.raises(ProtocolError, match="decisions only"):
        decode_decision(Message(0, MessageKind.ACTIVATION, 0, 0))
    with pytest.raises(ProtocolError, match="unknown task kind"):
        decode_decision(Message(0, MessageKind.DECISION, 0, 0, tag=3))


def _follower():
    world = InprocWorld(2)
    coord = Coordinator(world.endpoint(1))
    errors = []
    h = make_hint("1f1b", num_stages=2, num_microbatches=4)
    rs = ReadySet(h.priority(1), cap=2, num_chunks=1, split_backward=False)
    return coord, errors, rs


async def test_out_of_sequence_decision_is_an_error():
    coord, errors, rs = _follower()
    chooser = coord.wrap(rs, step=0, mode='ready', wakeup=Wakeup(), fail=errors.append)
    coord._deliver(encode_decision(0, 0, Task(Kind.F, 0)))
    coord._deliver(encode_decision(0, 2, Task(Kind.F, 1)))
    assert isinstance(errors[0], CoordinationError)
    assert "expected decision 1, got decision 2" in str(errors[0])
    chooser.push(Task(Kind.F, 1))
    assert chooser.pop_nowait() is None  # F0 decided first, its input has not arrived
    chooser.push(Task(Kind.F, 0))
    assert chooser.pop_nowait() == Task(Kind.F, 0)


async def test_stale_step_and_repeated_task_are_errors():
    coord, errors, rs = _follower()
    chooser = coord.wrap(rs, step=3, mode='ready', wakeup=Wakeup(), fail=errors.append)
    coord._deliver(encode_decision(1, 0, Task(Kind.F, 0)))
    assert "not running" in str(errors[-1]) and "got step 1" in str(errors[-1])
    coord._deliver(encode_decision(3, 0, Task(Kind.F, 0)))
    coord._deliver(encode_decision(3, 1, Task(Kind.F, 0)))
    chooser.push(Task(Kind.F, 0))
    assert chooser.pop_nowait() == Task(Kind.F, 0)
    with pytest.raises(CoordinationError, match="already ran"):
        chooser.pop_nowait()


async def test_decisions_for_the_next_step_wait_for_it():
    coord, errors, rs = _follower()
    coord.wrap(rs, step=0, mode='ready', wakeup=Wakeup(), fail=errors.append)
    coord._deliver(encode_decision(1, 0, Task(Kind.F, 2)))
    assert not errors
    nxt = coord.wrap(rs, step=1, mode='ready', wakeup=Wakeup(), fail=errors.append)
    nxt.push(Task(Kind.F, 2))
    assert nxt.next_in_order == Task(Kind.F, 2) and nxt.pop_nowait() == Task(Kind.F, 2)
