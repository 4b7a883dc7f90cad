"""TP x PP in one process: threads as TP members, exactness against the unsplit model."""

import asyncio
import random

import pytest
import torch

from aioready.devices.cpu import CPUDevice
from aioready.devices.delayed import DelayedDevice
from aioready.errors import CoordinationError
from aioready.schedulers import make_hint
from aioready.stage import StageExecutor
from aioready.testing import mse_loss, reference_step
from aioready.tp import make_tp_mlp_stages, max_tp_grad_diff
from aioready.tp_comm import TPDevice, ThreadTPGroup

from tp_grid import Grid

M, WIDTH = 4, 8


def data(seed=1):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(2, WIDTH, generator=g, dtype=torch.float64) for _ in range(M)]
    ys = [torch.randn(2, WIDTH, generator=g, dtype=torch.float64) for _ in range(M)]
    return xs, ys


def build(pp, tp, *, mode, coordinate=True, split=False, cap=None, verify=True, timeout=10.0):
    hint = make_hint("1f1b", num_stages=pp, num_microbatches=M, split_backward=split)
    groups = [ThreadTPGroup(tp, timeout=timeout) for _ in range(pp)]
    comms = [[groups[p].member(t, verify=verify) for t in range(tp)] for p in range(pp)]
    full, shards = None, {}
    for p in range(pp):
        for t in range(tp):
            f, s = make_tp_mlp_stages(pp, comms[p][t], width=WIDTH, hidden=8, seed=3)
            full, shards[p, t] = f, s

    def executors(p, t):
        return [StageExecutor(shards[p, t][p], stage=p, num_stages=pp, loss_fn=mse_loss,
                              num_microbatches=M)]

    def device(p, t):
        rng = random.Random(1000 * p + t)  # different delays on each TP member
        return TPDevice(DelayedDevice(CPUDevice(f"tp{p}.{t}"), lambda i: rng.uniform(0, 0.01)),
                        comms[p][t], on_error=lambda: [g.abort() for g in groups])

    grid = Grid(hint, tp, mode=mode, cap=cap, device=device, executors=executors,
                coordinate=coordinate)
    return grid, full, shards, comms


def close(grid):
    for row in grid.runtimes:
        for rt in row:
            rt.device.close()


@pytest.mark.parametrize("mode, split", [("ready", False), ("strict", False), ("ready", True)])
async def test_tp_pipeline_matches_the_unsplit_model(mode, split):
    grid, full, shards, comms = build(2, 2, mode=mode, split=split,
                                      cap=M if mode == "ready" else None)
    xs, ys = data()
    try:
        losses = await grid.step(0, xs, ys)
    finally:
        close(grid)
    ref_loss, ref = reference_step(full, mse_loss, xs, ys)
    for t in range(2):
        assert abs(float(losses[-1][t]) - float(ref_loss)) <= 1e-10
        for p in range(2):
            assert max_tp_grad_diff([ref[p]], [shards[p, t][p]], comms[p][t]) <= 1e-10
            assert comms[p][t].num_collectives > 0
            assert grid.order(p, t) == grid.order(p, 0)
    assert all(ex.num_split_fallbacks == 0 for row in grid.runtimes for rt in row
               for ex in rt.executors)
    if mode == "strict":
        assert grid.num_decision_messages == 0
    else:
        assert grid.num_decision_messages == 2 * M * (3 if split else 2)


async def test_without_coordination_the_mismatch_is_a_coordination_error():
    grid, *_ = build(2, 2, mode="ready", coordinate=False, cap=M, timeout=5.0)
    xs, ys = data()
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        with pytest.raises(CoordinationError) as info:
            await grid.step(0, xs, ys)
    finally:
        close(grid)
    assert loop.time() - start < 5.0 * 2
    text = str(info.value)
    assert "different collectives" in text or "did not complete" in text
    assert "Coordinator" in text

