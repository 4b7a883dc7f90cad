"""telemetry.bounds.in_order_bound: a true bound for every hint and policy, tighter than the
lower bound where a slow microbatch leads (multimodal)."""

from __future__ import annotations

import pytest

from aioready.schedulers import make_hint
from aioready.sim.simulator import simulate
from aioready.sim.variability import JitterModel
from aioready.telemetry.bounds import in_order_bound, lower_bound_table


def _bounds(hint: str, S: int, M: int, split: bool, jitter: str, seed: int
            ) -> tuple[float, float]:
    order = make_hint(hint, num_stages=S, num_microbatches=M, split_backward=split)
    table = JitterModel(jitter, seed=seed, placement=order.placement, num_microbatches=M,
                        split_backward=split).table(0)
    return (lower_bound_table(order.placement, table, split),
            in_order_bound(order.placement, table, split))


def test_equal_durations_leave_the_lower_bound_as_it_is() -> None:
    low, ordered = _bounds("1f1b", 4, 8, False, "none", 0)
    assert ordered == pytest.approx(low)
    assert simulate(stages=4, microbatches=8, hint="1f1b", mode="strict").step_time == \
        pytest.approx(ordered)


def test_a_slow_microbatch_in_front_raises_it() -> None:
    low, ordered = _bounds("1f1b", 8, 32, True, "multimodal:0.3:3", 0)
    assert ordered > 1.03 * low


@pytest.mark.parametrize("hint,split,cap", [
    ("1f1b", False, None), ("bf", False, "2x"), ("gpipe", False, None),
    ("bfw", True, "2x"), ("zb-h2", True, None), ("zbv", True, "2x"),
    ("interleaved-1f1b", False, None), ("interleaved-zb", True, "2x")])
@pytest.mark.parametrize("jitter", ["multimodal:0.3:3", "lognormal:0.5"])
def test_no_run_beats_it(hint: str, split: bool, cap: str | None, jitter: str) -> None:
    S, M = 8, 16
    low, ordered = _bounds(hint, S, M, split, jitter, 3)
    assert ordered >= low
    for mode, policy in (("strict", "reserve"), ("ready", "reserve"), ("ready", "greedy")):
        r = simulate(stages=S, microbatches=M, hint=hint, mode=mode, policy=policy,
                     jitter=jitter, seed=3, split_backward=split,
                     cap=None if mode == "strict" else cap)
        assert r.lower_bound == pytest.approx(low)  # the same durations as the simulator's
        assert r.step_time >= ordered * (1 - 1e-9), (mode, policy)
