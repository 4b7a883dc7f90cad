"""aioready/sim/resample.py: resampled steps keep each (stage, kind)'s durations (dealt to the
microbatches again) and each microbatch's known size, are seeded, and a resampled trace
replays its measured steps unchanged first."""

from __future__ import annotations

import numpy as np
import pytest

from aioready.placement import Placement
from aioready.sim.resample import resampled_tables, resampled_trace
from aioready.sim.simulator import simulate
from aioready.sim.traces import Trace
from aioready.sim.variability import JitterModel


def _model(jitter: str) -> JitterModel:
    return JitterModel(jitter, seed=1, placement=Placement.linear(4), num_microbatches=8,
                       split_backward=True)


def test_copies_deal_each_stage_and_kind_again() -> None:
    model = _model("lognormal:0.5")
    table = model.table(0)
    copies = resampled_tables(table, None, 3, seed=1)
    assert len(copies) == 3
    for copy in copies:
        assert copy.shape == table.shape
        # the same durations per (stage, kind), in another order
        assert np.array_equal(np.sort(copy, axis=1), np.sort(table, axis=1))
        assert not np.array_equal(copy, table)
    assert not np.array_equal(copies[0], copies[1])
    again = resampled_tables(table, None, 3, seed=1)
    assert all(np.array_equal(a, b) for a, b in zip(copies, again))


def test_sizes_stay_with_their_microbatch() -> None:
    model = _model("multimodal:0.3:3")
    table, sizes = model.table(0), model.sizes(0)
    assert sizes is not None and sizes.max() > sizes.min()
    for copy in resampled_tables(table, sizes, 4, seed=2):
        noise, dealt = table / sizes[None, :, None], copy / sizes[None, :, None]
        assert np.allclose(np.sort(dealt, axis=1), np.sort(noise, axis=1))
        heavy = sizes > 1
        # a heavy microbatch stays heavier than the noise alone would make it
        assert np.allclose(copy[:, heavy] / dealt[:, heavy], sizes[heavy][None, :, None])


def test_trace_keeps_the_measured_steps_first() -> None:
    model = _model("multimodal:0.3:3")
    tables = np.stack([model.table(0), model.table(1)])
    sizes = np.stack([model.sizes(0), model.sizes(1)])
    trace = Trace(tables, placement=model.placement, split_backward=True, sizes=sizes)
    more = resampled_trace(trace, 2, 3, seed=5)
    assert more.num_steps == 5
    assert np.array_equal(more.table(0), tables[0]) and np.array_equal(more.table(1), tables[1])
    assert np.array_equal(more.sizes(2), sizes[0]) and np.array_equal(more.sizes(3), sizes[1])
    noise = tables[1] / sizes[1][None, :, None]
    assert np.allclose(np.sort(more.table(3) / sizes[1][None, :, None], axis=1),
                       np.sort(noise, axis=1))
    # the simulator replays it, one step per table
    run = simulate(stages=4, microbatches=8, hint="1f1b", mode="strict", trace=more, steps=5,
                   split_backward=True)
    assert len(run.per_step) == 5
    with pytest.raises(ValueError, match="copies"):
        resampled_tables(tables[0], None, -1, seed=0)
    with pytest.raises(ValueError, match="steps"):
        resampled_trace(trace, 0, 1)
