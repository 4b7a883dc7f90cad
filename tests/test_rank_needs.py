"""The runtime's dependencies come from tasks.needs: the tabulated form agrees with the rule, and a
rank on a V placement waits for, accepts and refuses messages exactly as the rule says."""

from __future__ import annotations

import asyncio

import pytest

from aioready.clock import run_virtual
from aioready.devices.sim import SimDevice
from aioready.errors import ProtocolError
from aioready.runtime.rank import RankRuntime
from aioready.schedulers import make_hint
from aioready.tasks import Kind, Need, Task, all_tasks, needs, step_needs
from aioready.transports.base import Message, MessageKind
from aioready.transports.inproc import InprocWorld


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("stages,num_stages", [((0,), 1), ((0,), 4), ((3,), 4), ((1, 6), 8)])
def test_the_table_is_the_rule(stages: tuple[int, ...], num_stages: int, split: bool) -> None:
    table = step_needs(stages, num_stages, 3, split)
    tasks = list(all_tasks(len(stages), 3, split))
    assert list(table.counts) == tasks
    for task in tasks:
        stage = stages[task.chunk]
        pred, need = needs(task, is_last_stage=stage == num_stages - 1)
        assert table.counts[task] == (pred is not None) + (need is not Need.NOTHING)
        if pred is not None:
            assert table.unblocks[pred] == task
        by_message = need is Need.GRAD or (need is Need.INPUT and stage > 0)
        assert table.messages.get(task) == (need if by_message else None)
    heirs = {Kind.F: Kind.B, Kind.B: Kind.W} if split else {Kind.F: Kind.B}
    assert {t.kind: u.kind for t, u in table.unblocks.items()} == heirs


def test_a_v_rank_waits_for_and_refuses_messages_by_the_rule() -> None:
    """Rank 0 of a V placement (S=4, R=2) holds stages 0 and 3: it waits for the activation of
    stage 2 and the gradient of stage 1, both from rank 1, and never for a gradient of stage 3."""
    hint = make_hint("zbv", num_stages=4, num_microbatches=2, split_backward=True)
    assert hint.placement.stages_of(0) == (0, 3)

    async def main() -> None:
        world = InprocWorld(2)
        sent_to_1: list[Message] = []
        world.endpoints[1].open(sent_to_1.append)
        rt = RankRuntime(rank=0, hint=hint, mode="ready", cap=None, executors=None,
                         device=SimDevice(lambda info: 1.0, run_compute=False),
                         transport=world.endpoints[0])
        step = asyncio.ensure_future(rt.run_step(0))
        await asyncio.sleep(10.0)  # virtual seconds: rank 0 ran both F of stage 0, now waits
        assert [(m.kind, m.stage) for m in sent_to_1] == [(MessageKind.ACTIVATION, 1)] * 2
        waiting = {(str(t), r) for t, r in rt.pending_receives()}
        assert waiting == {("F0c1", 1), ("F1c1", 1), ("B0", 1), ("B1", 1)}
        peer = world.endpoints[1]
        peer.send_nowait(0, Message(0, MessageKind.ACTIVATION, 3, 0))
        await asyncio.sleep(0.5)  # F0c1 runs; its B needs nothing more (stage 3 is the last)
        assert Task(Kind.F, 0, 1) not in {t for t, _ in rt.pending_receives()}
        peer.send_nowait(0, Message(0, MessageKind.GRADIENT, 3, 1))
        with pytest.raises(ProtocolError, match="never receives") as info:
            await step
        assert info.value.rank == 0 and "gradient for stage 3" in str(info.value)

    run_virtual(main())


def test_a_duplicate_message_is_refused() -> None:
    hint = make_hint("1f1b", num_stages=2, num_microbatches=2)

    async def main() -> None:
        world = InprocWorld(2)
        world.endpoints[0].open(lambda msg: None)
        rt = RankRuntime(rank=1, hint=hint, mode="ready", cap=None, executors=None,
                         device=SimDevice(lambda info: 5.0, run_compute=False),
                         transport=world.endpoints[1])
        step = asyncio.ensure_future(rt.run_step(0))
        for _ in range(2):
            world.endpoints[0].send_nowait(1, Message(0, MessageKind.ACTIVATION, 1, 1))
        with pytest.raises(ProtocolError, match="duplicate message"):
            await step

    run_virtual(main())
