"""The "middle" microbatch order: heavy microbatches between two runs of light ones, the light
tail 3S/2 long (schedulers/order.py), and hint="auto" simulating it beside the other orders."""

from __future__ import annotations

import math

import pytest

import aioready
from aioready.errors import ConfigError
from aioready.schedulers.order import ORDERS, TAIL, cost_order


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
    bound); a light tail after them reaches 0.99 (docs/policy.md "The microbatch order")."""
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
