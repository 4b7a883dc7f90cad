"""TP x PP in one process: threads as TP members, exactness against the unsplit model."""

import random

import pytest
import torch
from tp_grid import Grid

from aioready.devices.cpu import CPUDevice
from aioready.devices.delayed import DelayedDevice
from aioready.errors import ConfigError, CoordinationError
from aioready.runtime.stage import StageExecutor
from aioready.schedulers import make_hint
from aioready.tasks import Kind
from aioready.testing.helpers import mse_loss, reference_step
from aioready.tp.collectives import ThreadTPGroup, TPDevice
from aioready.tp.layers import make_tp_mlp_stages, max_tp_grad_diff

M, WIDTH = 4, 8


def data(seed=1, M=M):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(2, WIDTH, generator=g, dtype=torch.float64) for _ in range(M)]
    ys = [torch.randn(2, WIDTH, generator=g, dtype=torch.float64) for _ in range(M)]
    return xs, ys


def random_delays(p, t):
    rng = random.Random(1000 * p + t)  # different delays on each TP member
    return lambda info: rng.uniform(0, 0.01)


def straggler(p, t, *, pp=2):
    """Every task 10 ms; the last stage's TP rank 1 holds each gradient 60 ms longer, so stage 0's
    members see the same gradient at different times (the case coordination exists for)."""
    extra = 0.06 if (p, t) == (pp - 1, 1) else 0.0
    return lambda info: 0.01 + (extra if info.kind is Kind.B else 0.0)


def build(pp, tp, *, mode, coordinate=True, split=False, cap=None, verify="exchange",
          timeout=10.0, delays=random_delays, M=M):
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
        return TPDevice(DelayedDevice(CPUDevice(f"tp{p}.{t}"), delays(p, t)),
                        comms[p][t], on_error=lambda: [g.abort() for g in groups])

    grid = Grid(hint, tp, mode=mode, cap=cap, device=device, executors=executors,
                coordinate=coordinate)
    return grid, full, shards, comms


def close(grid):
    for row in grid.runtimes:
        for rt in row:
            rt.device.close()


@pytest.mark.parametrize("mode, split, verify", [("ready", False, "exchange"),
                                                  ("strict", False, "inline"),
                                                  ("ready", True, "off")])
async def test_tp_pipeline_matches_the_unsplit_model(mode, split, verify):
    grid, full, shards, comms = build(2, 2, mode=mode, split=split, verify=verify,
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


async def test_coordinated_members_wait_for_a_straggler_and_stay_exact():
    grid, full, shards, comms = build(2, 2, mode="ready", cap=8, delays=straggler, M=8)
    xs, ys = data(M=8)
    try:
        await grid.step(0, xs, ys)
    finally:
        close(grid)
    _, ref = reference_step(full, mse_loss, xs, ys)
    for p in range(2):
        assert grid.order(p, 1) == grid.order(p, 0)
        for t in range(2):
            assert max_tp_grad_diff([ref[p]], [shards[p, t][p]], comms[p][t]) <= 1e-10


@pytest.mark.parametrize("verify", ["exchange", "inline"])
async def test_without_coordination_the_mismatch_is_a_coordination_error(verify):
    grid, *_ = build(2, 2, mode="ready", coordinate=False, cap=8, timeout=5.0, verify=verify,
                     delays=straggler, M=8)
    xs, ys = data(M=8)
    try:
        with pytest.raises(CoordinationError) as info:
            await grid.step(0, xs, ys)
    finally:
        close(grid)
    text = str(info.value)
    assert "different collectives" in text or "did not complete" in text
    assert "Coordinator" in text



def test_inline_check_catches_any_difference_and_passes_equal_tags():
    group = ThreadTPGroup(3, timeout=5.0)
    members = [group.member(t, verify="inline") for t in range(3)]
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from aioready.devices.base import TaskInfo

    def run(t, mb):
        members[t].begin_task(TaskInfo(0, t, 1, 0, mb, Kind.F))
        x = np.full(4, float(t))
        try:
            members[t].allreduce_(x)
            return x
        except CoordinationError as exc:
            return exc

    with ThreadPoolExecutor(3) as pool:
        same = list(pool.map(run, range(3), [5, 5, 5]))
        assert all((x == 3.0).all() for x in same)
        mixed = list(pool.map(run, range(3), [5, 5, 6]))
    assert all(isinstance(x, CoordinationError) for x in mixed)
    assert "inline tag check" in str(mixed[0])
    with pytest.raises(ConfigError, match="float64"):
        members[0].allreduce_(np.zeros(2, dtype=np.float32))
    with pytest.raises(ConfigError, match="exchange | inline | off"):
        group.member(0, verify="yes")
