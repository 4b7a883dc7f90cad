"""The "middle" microbatch order: heavy microbatches between two runs of light ones, the light
tail 3S/2 long with a split backward and 7S/4 with an unsplit one (schedulers/order.py), and
hint="auto" simulating it beside the other orders."""

from __future__ import annotations

import math

import pytest
import torch

import aioready
from aioready.clock import run_virtual
from aioready.devices.sim import SimDevice
from aioready.errors import ConfigError
from aioready.schedulers.order import ORDERS, TAIL, TAIL_UNSPLIT, cost_order
from aioready.testing.helpers import make_mlp_stages, max_grad_diff, mse_loss, reference_step


def test_heavy_ones_sit_between_two_light_runs() -> None:
    costs = [3.0 if m % 3 == 1 else 1.0 + m / 100 for m in range(24)]  # 8 heavy, 16 light
    S = 4
    slots = cost_order(costs, "middle", S)
    assert sorted(slots) == list(range(24))
    tail = math.ceil(TAIL * S)
    heavy = [i for i, m in enumerate(slots) if costs[m] == 3.0]
    assert heavy == list(range(24 - tail - 8, 24 - tail))  # one block, just before the tail
    assert slots[-1] == min(range(24), key=costs.__getitem__)  # the lightest ends the step
    assert [costs[m] for m in slots[-tail:]] == sorted(costs)[:tail][::-1]
    assert [costs[m] for m in slots[:24 - tail]] == sorted(costs)[tail:]  # lightest first
    # "ascending" is the same shape with a tail of one
    assert cost_order(costs, "ascending") == (*sorted(range(24), key=costs.__getitem__)[1:],
                                              slots[-1])


def test_short_steps_and_equal_costs() -> None:
    assert cost_order([2.0] * 6, "middle", 8) == tuple(range(6))  # nothing to order by
    assert cost_order([3.0, 1.0, 2.0], "middle", 8) == (0, 2, 1)  # tail clipped to M - 1
    assert cost_order([3.0, 1.0], "middle", 8) == (0, 1)


@pytest.mark.parametrize("stages", [None, 0, 1.5, "4"])
def test_middle_needs_the_number_of_stages(stages: object) -> None:
    with pytest.raises(ConfigError, match="number of stages"):
        cost_order([3.0, 1.0, 2.0, 1.0], "middle", stages)  # type: ignore[arg-type]


def test_auto_tries_middle_and_it_wins_where_the_drain_waits() -> None:
    """S=8, M=32, multimodal, split, 2S on every rank, seed 0: the given, ascending and
    descending orders leave the drain waiting on the heavy microbatches (best 0.95 of the lower
    bound); a light tail after them reaches 0.99 (docs/policy_measurements.md "The microbatch
    order")."""
    kw = dict(stages=8, microbatches=32, hint="auto", jitter="multimodal:0.3:3", seed=0,
              split_backward=True, cap=16)
    run = aioready.simulate(**kw)
    assert {r.candidate.order for r in run.tuning.rows} == set(ORDERS)
    assert run.order == "middle" and run.hint.endswith("+middle")
    others = [r for r in run.tuning.rows if r.candidate.order != "middle" and r.fits]
    assert all(r.step_time > run.step_time for r in others)  # stopped ones: a lower bound
    fixed = aioready.simulate(**{**kw, "hint": run.tuning.best.candidate.choice.hint,
                                 "cap": list(run.cap)},
                              mode="ready", policy=run.policy, order="middle")
    assert fixed.step_time == run.step_time  # the row is the run
    assert max(fixed.peak_in_flight) <= 16
    assert run.efficiency > 0.98


def test_the_light_tail_shortens_the_drain() -> None:
    """bench.drain's reading of the same case: the time ranks wait after their last forward
    is what the light tail wins back; every idle share is a real stretch of time."""
    from bench.drain import _run, idle_split
    S, caps = 8, [16] * 8
    shares = {}
    for how in ("ascending", "middle"):
        result, report = _run(S, 0, caps, how)
        shares[how] = idle_split(report, S)
        busy = sum(s.end - s.start for s in report.spans) / S
        assert all(x >= -1e-9 for x in shares[how])
        assert sum(shares[how]) + busy == pytest.approx(report.end - report.start)
    assert shares["middle"][2] < 0.5 * shares["ascending"][2]


def test_an_unsplit_backward_gets_the_longer_tail() -> None:
    costs = [3.0 if m % 4 == 1 else 1.0 for m in range(48)]  # 12 heavy, 36 light
    S = 8
    split, unsplit = cost_order(costs, "middle", S), cost_order(costs, "middle", S, False)
    assert split == cost_order(costs, "middle", S, True)  # the default is the split tail
    for slots, per_stage in ((split, TAIL), (unsplit, TAIL_UNSPLIT)):
        tail = math.ceil(per_stage * S)
        heavy = [i for i, m in enumerate(slots) if costs[m] == 3.0]
        assert heavy == list(range(48 - tail - 12, 48 - tail))
        assert sorted(slots) == list(range(48))
    assert math.ceil(TAIL_UNSPLIT * S) > math.ceil(TAIL * S)  # 14 light after them, not 12
    assert cost_order(costs, "ascending", S, False) == cost_order(costs, "ascending", S)


def test_an_unsplit_pipeline_runs_the_unsplit_tail_exactly() -> None:
    """Pipeline(microbatch_order="middle") with an unsplit backward runs the 7S/4 tail (the
    order its simulated choice was made in) and loss and gradients match the unsplit model."""
    S, M = 4, 16
    gen = torch.Generator().manual_seed(4)
    rows = [3 if m % 3 == 0 else 1 for m in range(M)]  # 6 heavy microbatches, 10 light
    xs = [torch.randn(n, 8, generator=gen, dtype=torch.float64) for n in rows]
    ys = [torch.randn(n, 8, generator=gen, dtype=torch.float64) for n in rows]
    stages = make_mlp_stages(S, width=8, hidden=8, blocks_per_stage=1)
    ref_loss, ref = reference_step(stages, mse_loss, xs, ys)

    async def main() -> tuple[torch.Tensor, tuple[int, ...] | None]:
        pipe = aioready.Pipeline(stages, mse_loss, microbatches=M, hint="1f1b", mode="ready",
                                 split_backward=False, cap="2x", microbatch_order="middle",
                                 device=SimDevice(lambda info: 1.0, run_compute=True))
        try:
            loss = await pipe.step(xs, ys, costs=rows)
            return loss, pipe.microbatch_slots
        finally:
            pipe.close()
    loss, slots = run_virtual(main())
    assert slots == cost_order(rows, "middle", S, False) != cost_order(rows, "middle", S)
    assert [rows[m] for m in slots[-7:]] == [1] * 7  # ceil(7/4 * 4) light ones end the step
    assert abs(float(loss) - float(ref_loss)) <= 1e-10
    assert max_grad_diff(stages, ref) <= 1e-10
