"""bench.policy's held-out auto rows: chosen on another draw, run on the scored durations.

A held-out row must be what a fresh computation gives: `aioready.simulate(hint="auto")` on the
choice draw (bench/policy_held.py), its chosen configuration then simulated on the scored
durations; the unit's memo must not change that. Since the hindsight row picks the fastest
fitting candidate of the same set on the scored durations, a held-out row can never be faster,
and on a known case it is slower.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import bench.policy as policy
from aioready.clock import run_virtual
from aioready.devices import SimDevice
from aioready.placement import Placement
from aioready.runtime.autotune import AutoHint
from aioready.runtime.pipeline import Pipeline
from aioready.sim.budget import gated
from aioready.sim.durations import device_duration
from aioready.sim.simulator import simulate
from aioready.sim.tune import SimChooser
from aioready.sim.variability import JitterModel
from bench.policy_held import HELD_STEP, RESAMPLE, WINDOW, choice_draw

S, M = 4, 16


class _Lazy(dict):
    """A (jitter, shape)'s unit computed when a test first asks for it (up to 30 s of CPU
    each), so that the heavy-only cases cost make test nothing."""

    def __init__(self, keep: Any) -> None:
        super().__init__()
        self.keep = keep

    def __missing__(self, key: tuple[str, str | None]) -> dict:
        jitter, shape = key
        self[key] = _unit(lambda c: self.keep(c) and _of(c, shape), jitter)
        return self[key]


def _unit(keep: Any, jitter: str) -> dict:
    autos = [c for c in policy.CONFIGS if c.hint == "auto" and keep(c)]
    saved = policy.CONFIGS[:]
    policy.CONFIGS[:] = [policy.Config("zb-h2"), *autos]
    try:
        return policy.sim_unit(S, jitter, 0)
    finally:
        policy.CONFIGS[:] = saved


def _hindsight(c: policy.Config) -> str:
    """The name of the hindsight row a held-out row is read against (its shape)."""
    return c.name.split(", held-out")[0]


def _of(c: policy.Config, shape: str | None) -> bool:
    """Whether a row is of `shape` (its hindsight row's name), or any shape for None."""
    return shape is None or _hindsight(c) == shape


# make test: multimodal (it has microbatch sizes, so the order is chosen too, and seed 0's
# 2S-each choice moves) on the 2S-each rows alone; every shape, and lognormal too, `heavy`
ONE = "auto split, 2S each"
CASES = [pytest.param(("lognormal:0.5", None), marks=pytest.mark.heavy, id="lognormal-all"),
         pytest.param(("multimodal:0.3:3", None), marks=pytest.mark.heavy, id="multimodal-all"),
         pytest.param(("multimodal:0.3:3", ONE), id="multimodal-2S-each")]
JITTERS = [pytest.param("lognormal:0.5", marks=pytest.mark.heavy), "multimodal:0.3:3"]


@pytest.fixture(scope="module")
def units() -> dict[tuple[str, str | None], dict]:
    return _Lazy(_tested)


@pytest.fixture(scope="module")
def resample_units() -> dict[tuple[str, str | None], dict]:
    """The resampled rows beside the hindsight ones (apart: each simulates 8 steps)."""
    return _Lazy(lambda c: "copies" in dict(c.kwargs) or dict(c.kwargs) in ({}, {
        "uniform": True}))


def _held_rows(shape: str | None = None) -> list[policy.Config]:
    """The count rows held out on one step (the byte rows': tests/test_policy_bytes.py)."""
    return [c for c in policy.CONFIGS if c.hint == "auto" and "held" in dict(c.kwargs)
            and not {"window", "copies", "bytes"} & set(dict(c.kwargs)) and _of(c, shape)]


def _tested(c: policy.Config) -> bool:
    """The rows a unit here needs: the held-out and window rows and their hindsight twins
    (the given-order and byte rows are read elsewhere and would only add to its time)."""
    kw = dict(c.kwargs)
    return not {"bytes", "order", "copies"} & set(kw)


def _resample_rows() -> list[policy.Config]:
    return [c for c in policy.CONFIGS if c.hint == "auto" and "copies" in dict(c.kwargs)]


def _window_rows(shape: str | None = None) -> list[policy.Config]:
    return [c for c in policy.CONFIGS if c.hint == "auto" and "window" in dict(c.kwargs)
            and _of(c, shape)]


@pytest.mark.parametrize("case", CASES)
def test_a_held_out_row_is_a_fresh_choice_on_the_other_draw_run_on_the_scored_one(
        units: dict[tuple[str, str | None], dict], case: tuple[str, str | None]) -> None:
    jitter, shape = case
    rows = _held_rows(shape)
    assert {dict(c.kwargs)["held"] for c in rows} == {"sizes", "step"}
    for cfg in rows:
        row = units[case]["rows"][f"{cfg.name}|2x"]
        split = cfg.split_backward
        gate = policy.auto_gate(cfg, S, M, policy.BUDGETS["2x"], lambda: simulate(
            stages=S, microbatches=M, hint="1f1b", mode="strict", jitter=jitter, seed=0,
            split_backward=split).peak_activation_bytes)
        draw = choice_draw(jitter, 0, S, M, split, dict(cfg.kwargs)["held"])
        chosen = simulate(stages=S, microbatches=M, hint="auto", trace=draw,
                          split_backward=split, **gate)
        best = chosen.tuning.best
        c = best.candidate.choice
        scored = simulate(stages=S, microbatches=M, hint=c.hint, mode=c.mode, policy=c.policy,
                          jitter=jitter, seed=0, split_backward=split,
                          order=best.candidate.order,
                          **gated(c.cap, c.memory))
        assert (row["chosen"], row["t_chosen_on"], row["t"], row["eff"], row["cap0"],
                row["peak"]) == (chosen.hint, chosen.step_time, scored.step_time,
                                 scored.efficiency, c.cap[0], max(scored.peak_in_flight)), \
            cfg.name
        assert row["candidates"] == len(chosen.tuning.rows), cfg.name
        assert row["pkb"] == list(scored.peak_activation_bytes), cfg.name


@pytest.mark.parametrize("case", CASES)
def test_held_out_is_never_faster_than_hindsight_and_slower_where_the_choice_moved(
        units: dict[tuple[str, str | None], dict], case: tuple[str, str | None]) -> None:
    jitter, shape = case
    rows = units[case]["rows"]
    # (count rows only: a byte row's candidates carry bytes from the mean of the durations
    # chosen on, so its held-out set is not the hindsight one: tests/test_policy_bytes.py)
    for cfg in _held_rows(shape):
        hindsight = rows[f"{_hindsight(cfg)}|2x"]
        held = rows[f"{cfg.name}|2x"]
        # the same candidates and budget: hindsight's best on the scored durations is the
        # fastest fitting one of them, and the held-out choice is one of them that fits
        assert held["t"] >= hindsight["t"], cfg.name
        assert held["candidates"] == hindsight["candidates"], cfg.name
    if jitter.startswith("multimodal"):  # seed 0: the 2S-each choice moves, and loses
        moved = rows["auto split, 2S each, held-out|2x"]
        known = rows["auto split, 2S each|2x"]
        assert moved["chosen"] != known["chosen"] and moved["t"] > known["t"]


@pytest.mark.parametrize("jitter", ["lognormal:0.5", "multimodal:0.3:3"])
def test_the_choice_draw_differs_only_in_per_task_noise_and_step_zero_is_the_scored_one(
        jitter: str) -> None:
    model = JitterModel(jitter, seed=3, placement=Placement.linear(S), num_microbatches=M,
                        split_backward=True)
    draw = choice_draw(jitter, 3, S, M, True, "sizes")
    assert not np.allclose(draw.table(0), model.table(0))  # new per-task noise
    if model.sizes(0) is not None:
        assert np.array_equal(draw.sizes(0), model.sizes(0))  # the scored step's sizes
        assert not np.array_equal(model.sizes(HELD_STEP), model.sizes(0))
        assert np.array_equal(choice_draw(jitter, 3, S, M, True, "step").sizes(0),
                              model.sizes(HELD_STEP))
    # chosen on step 0 itself, through the trace, auto is the hindsight choice exactly
    same = choice_draw(jitter, 3, S, M, True, "sizes", step=0)
    assert np.array_equal(same.table(0), model.table(0))
    via_trace = simulate(stages=S, microbatches=M, hint="auto", trace=same, split_backward=True,
                         cap="2x")
    direct = simulate(stages=S, microbatches=M, hint="auto", jitter=jitter, seed=3,
                      split_backward=True, cap="2x")
    assert (via_trace.hint, via_trace.step_time) == (direct.hint, direct.step_time)


@pytest.mark.parametrize("case", CASES)
def test_a_window_row_is_a_fresh_choice_on_steps_one_to_k_run_on_the_scored_one(
        units: dict[tuple[str, str | None], dict], case: tuple[str, str | None]) -> None:
    jitter, shape = case
    rows = _window_rows(shape)
    assert len(rows) == (3 if shape is None else 1)
    assert {dict(c.kwargs)["window"] for c in rows} == {WINDOW}
    for cfg in rows:
        row = units[case]["rows"][f"{cfg.name}|2x"]
        split, budget = cfg.split_backward, policy._auto_budget(cfg, S, M, policy.BUDGETS["2x"])
        draw = choice_draw(jitter, 0, S, M, split, "sizes", window=WINDOW)
        _same_as_a_fresh_choice(row, cfg.name, draw, WINDOW, split, budget, jitter)


def test_a_window_is_its_steps_drawn_one_by_one_and_never_the_scored_step() -> None:
    for jitter in ("lognormal:0.5", "multimodal:0.3:3"):
        window = choice_draw(jitter, 2, S, M, True, "sizes", window=3)
        assert window.num_steps == 3
        for i in range(3):
            one = choice_draw(jitter, 2, S, M, True, "sizes", step=HELD_STEP + i)
            assert np.array_equal(window.table(i), one.table(0))
            if one.sizes(0) is not None:
                assert np.array_equal(window.sizes(i), one.sizes(0))
        scored = choice_draw(jitter, 2, S, M, True, "sizes", step=0)
        assert not any(np.allclose(window.table(i), scored.table(0)) for i in range(3))
    with pytest.raises(ValueError, match="window"):
        choice_draw("lognormal:0.5", 0, S, M, True, "sizes", window=0)


def test_the_window_changes_the_choice_where_one_step_misleads() -> None:
    """lognormal:0.5, split, seed 0, the 2x budget: step 1 alone picks zb-h2 under `light`,
    steps 1-4 bfw under greedy, so the window is not a relabelled one-step choice."""
    picks = []
    for window in (1, WINDOW):
        draw = choice_draw("lognormal:0.5", 0, S, M, True, "sizes", window=window)
        best = simulate(stages=S, microbatches=M, hint="auto", trace=draw, steps=window,
                        split_backward=True, cap="2x").tuning.best.candidate
        picks.append((best.label, best.choice.mode, best.choice.cap, best.choice.policy))
    assert picks[0][0] == "zb-h2" and picks[1][0] == "bfw", picks


def test_a_pipeline_with_a_window_chooses_what_the_window_row_chooses() -> None:
    """Pipeline(hint=AutoHint(window=k)) measures k steps under its start hint and chooses on
    their spans: the choice the bench's window row makes on the same k steps' durations."""
    draw = choice_draw("lognormal:0.5", 0, S, M, True, "sizes", window=WINDOW)
    chooser = SimChooser()

    async def main() -> Pipeline:
        pipe = Pipeline([None] * S, None, microbatches=M, split_backward=True, cap="2x",
                        hint=AutoHint(window=WINDOW, chooser=chooser),
                        device=SimDevice(device_duration(draw, 1.0), run_compute=False))
        for _ in range(WINDOW):
            await pipe.step()
        return pipe
    pipe = run_virtual(main())
    row = simulate(stages=S, microbatches=M, hint="auto", trace=draw, steps=WINDOW,
                   split_backward=True, cap="2x")
    assert chooser.last is not None and len(pipe.auto.choices) == 1
    best, want = chooser.last.best, row.tuning.best
    assert (best.candidate.label, best.candidate.choice.cap, best.candidate.choice.mode,
            best.candidate.choice.policy) == (want.candidate.label, want.candidate.choice.cap,
                                              want.candidate.choice.mode,
                                              want.candidate.choice.policy)
    assert best.step_time == pytest.approx(want.step_time, rel=1e-9)


@pytest.mark.heavy  # 8-step choices for three rows and two jitters: about 50 s of CPU
@pytest.mark.parametrize("jitter", JITTERS)
def test_a_resample_row_is_a_fresh_choice_on_step_one_and_its_copies(
        resample_units: dict[tuple[str, str | None], dict], jitter: str) -> None:
    rows = _resample_rows()
    assert len(rows) == 3 and {dict(c.kwargs)["copies"] for c in rows} == {RESAMPLE - 1}
    unit = resample_units[jitter, None]
    for cfg in rows:
        row = unit["rows"][f"{cfg.name}|2x"]
        # never faster than hindsight, the fastest fitting candidate of the same set
        hindsight = unit["rows"][f"{_hindsight(cfg)}|2x"]
        assert row["t"] >= hindsight["t"] and row["candidates"] == hindsight["candidates"]
        split, budget = cfg.split_backward, policy._auto_budget(cfg, S, M, policy.BUDGETS["2x"])
        draw = choice_draw(jitter, 0, S, M, split, "sizes", copies=RESAMPLE - 1)
        assert draw.num_steps == RESAMPLE
        one = choice_draw(jitter, 0, S, M, split, "sizes")
        assert np.array_equal(draw.table(0), one.table(0))  # the measured step first
        for i in range(1, RESAMPLE):  # then copies of it: its durations dealt again
            noise = draw.table(i) / (draw.sizes(i)[None, :, None] if draw.sizes(i) is not None
                                     else 1.0)
            measured = one.table(0) / (one.sizes(0)[None, :, None] if one.sizes(0) is not None
                                       else 1.0)
            assert np.allclose(np.sort(noise, axis=1), np.sort(measured, axis=1))
            assert not np.array_equal(draw.table(i), one.table(0))
        _same_as_a_fresh_choice(row, cfg.name, draw, RESAMPLE, split, budget, jitter)


def _same_as_a_fresh_choice(row: dict, name: str, draw: Any, steps: int, split: bool,
                            budget: Any, jitter: str) -> None:
    """`row` is auto's choice made afresh on `steps` steps of `draw`, scored on seed 0's step."""
    chosen = simulate(stages=S, microbatches=M, hint="auto", trace=draw, steps=steps,
                      split_backward=split, cap=budget)
    best = chosen.tuning.best
    c = best.candidate.choice
    scored = simulate(stages=S, microbatches=M, hint=c.hint, mode=c.mode, policy=c.policy,
                      cap=list(c.cap), jitter=jitter, seed=0, split_backward=split,
                      order=best.candidate.order)
    assert (row["chosen"], row["t_chosen_on"], row["t"], row["eff"], row["cap0"],
            row["peak"]) == (chosen.hint, chosen.step_time, scored.step_time,
                             scored.efficiency, c.cap[0], max(scored.peak_in_flight)), name
    assert row["candidates"] == len(chosen.tuning.rows), name
