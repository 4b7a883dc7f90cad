"""Failure detection between ranks (faults.py), in one process: four Pipelines, one per rank,
each on its own endpoint of an InprocWorld, as they would be on four MPI processes."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from conftest import on_virtual_clock

from aioready import PeerLostError, ProtocolError, StageError, StallError
from aioready.runtime.faults import HEARTBEAT
from aioready.runtime.pipeline import Pipeline
from aioready.testing.helpers import make_mlp_stages, mse_loss
from aioready.transports.base import Message, MessageKind
from aioready.transports.inproc import InprocWorld

pytestmark = pytest.mark.timeout(60)


def _ranks(world: InprocWorld, stages: list[Any], **kw: Any) -> list[Pipeline]:
    return [Pipeline([stages[r]], mse_loss, microbatches=4, hint="1f1b", num_stages=4,
                     transport=world.endpoints[r], **kw) for r in range(4)]


async def _step_all(pipes: list[Pipeline], skip: int | None = None) -> list[Any]:
    x, y = torch.randn(8, 16, dtype=torch.float64), torch.randn(8, 16, dtype=torch.float64)
    coros = [p.step(x if r == 0 else None, y if r == 3 else None)
             for r, p in enumerate(pipes) if r != skip]
    return await asyncio.wait_for(asyncio.gather(*coros, return_exceptions=True), 30)


async def test_peers_step_normally() -> None:
    world = InprocWorld(4)
    stages = make_mlp_stages(4)
    pipes = _ranks(world, stages, peer_timeout=0.2)
    for _ in range(2):
        results = await _step_all(pipes)
        assert not any(isinstance(r, BaseException) for r in results), results
        await asyncio.sleep(0.3)  # between steps: heartbeats only, nobody is blamed
    for p in pipes:
        p.close()


@on_virtual_clock
async def test_stage_exception_reaches_every_rank() -> None:
    world = InprocWorld(4)
    stages = make_mlp_stages(4)

    class Boom(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("boom in stage 2")
    stages[2] = Boom()
    pipes = _ranks(world, stages, peer_timeout=5.0, device="inline")
    loop = asyncio.get_running_loop()
    start = loop.time()
    results = await _step_all(pipes)
    assert loop.time() == start  # the broadcast, at once: not the 5 s timeout
    assert isinstance(results[2], StageError) and "boom in stage 2" in str(results[2])
    assert results[2].lost_rank is None and not results[2].remote  # its own failure
    for r in (0, 1, 3):
        err = results[r]
        assert isinstance(err, StageError), err
        text = str(err)
        assert text.startswith(f"rank {r}, step 0"), text
        assert "peer failed: rank 2 of 4 on " in text and "ValueError: boom in stage 2" in text
        assert err.lost_rank == 2 and err.remote
    for p in pipes:
        p.close()


@on_virtual_clock
async def test_silent_peer_is_declared_lost() -> None:
    world = InprocWorld(4)
    stages = make_mlp_stages(4)
    pipes = _ranks(world, stages, peer_timeout=0.4, device="inline")
    world.drop = lambda src, dst, msg: src == 1 or dst == 1  # rank 1 "dies": nothing in or out
    loop = asyncio.get_running_loop()
    start = loop.time()
    results = await _step_all(pipes, skip=1)
    took = loop.time() - start
    assert took == pytest.approx(0.4), took  # the heartbeat check at the timeout, exactly
    r0, r2, r3 = results
    for err in (r0, r2):
        assert isinstance(err, PeerLostError), err
        assert err.lost_rank == 1 and not err.remote  # found by its own timeout
        assert "peer rank 1 of 4 sent nothing" in str(err)
    assert "task B0" in str(r0) and "task F0" in str(r2)  # the task each one waited on
    # rank 3 hears it from whichever of ranks 0 and 2 broadcast first, at once
    assert isinstance(r3, PeerLostError) and r3.remote and r3.lost_rank in (0, 2)
    assert f"peer failed: rank {r3.lost_rank} of 4" in str(r3)
    assert "peer rank 1 of 4 sent nothing" in str(r3)
    for p in pipes:
        p.close()


async def test_heartbeats_name_their_sender_through_the_transport() -> None:
    world = InprocWorld(4)
    pipes = _ranks(world, make_mlp_stages(4), peer_timeout=0.2)
    seen: list[Message] = []
    pipes[0].runtimes[0].add_control_handler(seen.append)  # next to the peer monitor's
    results = await _step_all(pipes)
    assert not any(isinstance(r, BaseException) for r in results), results
    await asyncio.sleep(0.2)  # heartbeats only
    assert {m.source for m in seen} == {1, 2, 3}
    assert all((m.tag, m.stage, m.microbatch, m.tensors) == (HEARTBEAT, 0, 0, ()) for m in seen)
    for p in pipes:
        p.close()


@on_virtual_clock
async def test_wait_outside_a_step_names_a_silent_peer() -> None:
    """`Pipeline.watch`: a job-wide wait (here a barrier that never completes) ends with
    PeerLostError naming the peer that stopped answering, a timeout after its last word,
    and the other peers hear of it at once; before, only `step` had a timeout."""
    world = InprocWorld(4)
    pipes = _ranks(world, make_mlp_stages(4), peer_timeout=0.4, device="inline")
    world.drop = lambda src, dst, msg: src == 1 or dst == 1
    never = asyncio.get_running_loop().create_future()
    loop = asyncio.get_running_loop()
    start = loop.time()
    results = await asyncio.wait_for(asyncio.gather(
        *(p.watch(asyncio.shield(never), what="the start barrier")
          for r, p in enumerate(pipes) if r != 1), return_exceptions=True), 30)
    assert loop.time() - start == pytest.approx(0.4)
    direct = [e for e in results if isinstance(e, PeerLostError) and not e.remote]
    assert direct, results
    for err in direct:
        assert err.lost_rank == 1 and "during the start barrier" in str(err), err
        assert "peer rank 1 of 4 sent nothing" in str(err)
    assert all(isinstance(e, PeerLostError) for e in results), results
    for p in pipes:
        p.close()


@on_virtual_clock
async def test_long_wait_with_live_peers_blames_nobody() -> None:
    world = InprocWorld(4)
    pipes = _ranks(world, make_mlp_stages(4), peer_timeout=0.4, device="inline")
    results = await asyncio.gather(*(p.watch(asyncio.sleep(2.0, r), what="a long gather")
                                     for r, p in enumerate(pipes)), return_exceptions=True)
    assert results == [0, 1, 2, 3]
    results = await _step_all(pipes)  # and the pipelines still step afterwards
    assert not any(isinstance(r, BaseException) for r in results), results
    for p in pipes:
        p.close()


@on_virtual_clock
async def test_rejected_concurrent_step_leaves_the_running_one_alone() -> None:
    """A second `step()` while one runs is refused with RuntimeError, and nothing else: the
    running step keeps its guard, its watchdogs, and its peers (it used to overwrite the guard,
    disarming the stall watchdog, and to broadcast its refusal as a failure to every peer)."""
    world = InprocWorld(4)
    pipes = _ranks(world, make_mlp_stages(4), peer_timeout=5.0, device="inline")
    x, y = torch.randn(8, 16, dtype=torch.float64), torch.randn(8, 16, dtype=torch.float64)
    running = [asyncio.ensure_future(p.step(x if r == 0 else None, y if r == 3 else None))
               for r, p in enumerate(pipes)]
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="already running"):
        await pipes[0].step(x)
    results = await asyncio.wait_for(asyncio.gather(*running, return_exceptions=True), 30)
    assert not any(isinstance(r, BaseException) for r in results), results
    for p in pipes:
        p.close()


@on_virtual_clock
async def test_rejected_concurrent_step_keeps_the_stall_watchdog() -> None:
    world = InprocWorld(4)
    pipes = _ranks(world, make_mlp_stages(4), peer_timeout=None, stall_timeout=1.0,
                   device="inline")
    world.drop = lambda src, dst, msg: src == 0 and dst == 1  # rank 1 never gets its input
    x, y = torch.randn(8, 16, dtype=torch.float64), torch.randn(8, 16, dtype=torch.float64)
    running = [asyncio.ensure_future(p.step(x if r == 0 else None, y if r == 3 else None))
               for r, p in enumerate(pipes)]
    await asyncio.sleep(0.5)
    with pytest.raises(RuntimeError, match="already running"):
        await pipes[1].step()
    results = await asyncio.wait_for(asyncio.gather(*running, return_exceptions=True), 30)
    assert isinstance(results[1], StallError), results  # not a hang
    for p in pipes:
        p.close()


@on_virtual_clock
@pytest.mark.parametrize("tag, text, what", [
    (99, None, "control message from rank 2 with an unknown tag"),
    (2, torch.zeros(5, dtype=torch.float32), "error text from rank 2 is malformed"),
    (2, torch.zeros(5000, dtype=torch.uint8), "error text from rank 2 is malformed"),
])
async def test_malformed_control_message_is_a_protocol_error(tag: int, text: Any,
                                                             what: str) -> None:
    world = InprocWorld(4)
    pipes = _ranks(world, make_mlp_stages(4), peer_timeout=5.0, device="inline")
    world.drop = lambda src, dst, msg: src == 0 and dst == 1  # rank 1 waits: a step is running
    x, y = torch.randn(8, 16, dtype=torch.float64), torch.randn(8, 16, dtype=torch.float64)
    running = [asyncio.ensure_future(p.step(x if r == 0 else None, y if r == 3 else None))
               for r, p in enumerate(pipes)]
    await asyncio.sleep(0.1)
    world.endpoints[2].send_nowait(1, Message(0, MessageKind.CONTROL, 0, 0,
                                              () if text is None else (text,), tag))
    results = await asyncio.wait_for(asyncio.gather(*running, return_exceptions=True), 30)
    assert isinstance(results[1], ProtocolError) and what in str(results[1]), results[1]
    for p in pipes:
        p.close()
