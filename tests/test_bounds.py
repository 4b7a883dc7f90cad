"""The lower bounds of telemetry/bounds.py are bounds: the placement-free one is below every
placement's bound (stages merged or not, backward split or not), and every placement's bound is
below what the simulator's schedules of it take on the same durations. bench.e2e --scale divides
torch's best step by them to say how much any schedule could gain."""

from __future__ import annotations

import numpy as np
import pytest

from aioready.placement import Placement
from aioready.sim.simulator import simulate
from aioready.sim.traces import Trace
from aioready.sim.variability import JitterModel
from aioready.tasks import Kind
from aioready.telemetry.bounds import any_placement_bound, chain_bound, lower_bound_table

R, M = 4, 8
SHAPES = [("linear", R, False), ("linear", R, True), ("interleaved", 2 * R, False),
          ("interleaved", 2 * R, True), ("v", 2 * R, True), ("v", 2 * R, False)]


def _groups(jitter: str, seed: int) -> np.ndarray:
    """A (2R groups, M, 3) table with W: the layer groups every placement is made of."""
    model = JitterModel(jitter, seed=seed, placement=Placement(2 * R, 2 * R, "linear"),
                        num_microbatches=M, split_backward=True)
    return model.table(0)


def _stages(groups: np.ndarray, stages: int, split: bool) -> np.ndarray:
    table = groups.reshape(stages, -1, M, 3).sum(axis=1)
    if not split:
        table[:, :, Kind.B] += table[:, :, Kind.W]
        table[:, :, Kind.W] = 0.0
    return table


@pytest.mark.parametrize("jitter", ["lognormal:0.5", "multimodal:0.3:3"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_any_placement_bound_is_below_every_placements(jitter: str, seed: int) -> None:
    groups = _groups(jitter, seed)
    anywhere = any_placement_bound(groups, R)
    assert anywhere >= float(groups.sum()) / R and anywhere >= chain_bound(groups, True)
    for style, stages, split in SHAPES:
        table = _stages(groups, stages, split)
        bound = lower_bound_table(Placement(stages, R, style), table, split)
        assert anywhere <= bound + 1e-9, (style, stages, split)
        assert chain_bound(table, split) >= chain_bound(groups, True) - 1e-9


@pytest.mark.parametrize("hint,style,stages,split", [
    ("1f1b", "linear", R, False), ("zb-h1", "linear", R, True), ("bfw", "linear", R, True),
    ("interleaved-1f1b", "interleaved", 2 * R, False), ("zbv", "v", 2 * R, True)])
def test_bounds_are_below_the_schedules(hint: str, style: str, stages: int, split: bool) -> None:
    groups = _groups("multimodal:0.3:3", 5)
    table = _stages(groups, stages, split)
    placement = Placement(stages, R, style)
    trace = Trace(table[None], placement=placement, split_backward=split, source="test")
    bound = lower_bound_table(placement, table, split)
    for mode in ("strict", "ready"):
        sim = simulate(stages=stages, microbatches=M, ranks=R, hint=hint, mode=mode,
                       trace=trace, split_backward=split)
        assert any_placement_bound(groups, R) <= bound <= sim.step_time + 1e-9, (hint, mode)
