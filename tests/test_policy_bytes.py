"""bench.policy's auto rows under a byte budget: equal memory in bytes, measured.

A `bytes` row gives `hint="auto"` the column's "2x" as `memory=`: twice the bytes strict 1F1B
holds at its peak on each rank (sim/budget.py), so the row may hold at most that on any rank.
The hindsight row chooses on the scored durations, whose strict peak is the one it is read
against; the held-out row is given those bytes as a number and chooses on step 1
(bench/policy_held.py), and must be what a fresh `simulate(hint="auto", memory=...)` on that
draw, its choice then run on the scored step, gives.
"""

from __future__ import annotations

import pytest

import bench.policy as policy
from aioready.sim.budget import gated
from aioready.sim.simulator import simulate
from bench.policy_held import choice_draw

S, M, JITTER = 4, 16, "multimodal:0.3:3"


def _rows(held: bool) -> list[policy.Config]:
    return [c for c in policy.CONFIGS
            if dict(c.kwargs).get("bytes") and bool(policy._held(c)) == held]


@pytest.fixture(scope="module")
def unit() -> dict:
    saved = policy.CONFIGS[:]
    policy.CONFIGS[:] = [*_rows(False), *_rows(True)]
    try:
        return policy.sim_unit(S, JITTER, 0)
    finally:
        policy.CONFIGS[:] = saved


def test_a_hindsight_byte_row_holds_at_most_twice_strict_1f1b_bytes_on_every_rank(
        unit: dict) -> None:
    rows = _rows(False)
    assert {c.split_backward for c in rows} == {False, True}
    for cfg in rows:
        row = unit["rows"][f"{cfg.name}|2x"]
        strict = unit["strict_bytes"][f"1f1b/{int(cfg.split_backward)}"]
        assert row["limit_bytes"] == [int(2 * b) for b in strict], cfg.name
        assert row["memory"] is not None or row["mode"] == "strict", cfg.name
        assert len(row["pkb"]) == S
        for rank, (held, was) in enumerate(zip(row["pkb"], strict)):
            assert held <= 2 * was, (cfg.name, rank, held, was)


def test_a_count_row_is_not_held_to_bytes() -> None:
    # the same durations under cap="2x": a heavy microbatch costs one slot, so some rank holds
    # more than twice 1F1B's bytes (what the byte rows are for)
    counted = simulate(stages=S, microbatches=M, hint="auto", jitter=JITTER, seed=0, cap="2x")
    strict = simulate(stages=S, microbatches=M, hint="1f1b", mode="strict", jitter=JITTER,
                      seed=0)
    assert any(p > 2 * b for p, b in zip(counted.peak_activation_bytes,
                                         strict.peak_activation_bytes))


def test_a_held_out_byte_row_is_a_fresh_choice_on_step_1_run_on_step_0(unit: dict) -> None:
    rows = _rows(True)
    assert {c.split_backward for c in rows} == {False, True}
    for cfg in rows:
        row = unit["rows"][f"{cfg.name}|2x"]
        split = cfg.split_backward
        strict = simulate(stages=S, microbatches=M, hint="1f1b", mode="strict", jitter=JITTER,
                          seed=0, split_backward=split).peak_activation_bytes
        budget = [int(2 * b) for b in strict]
        chosen = simulate(stages=S, microbatches=M, hint="auto", split_backward=split,
                          trace=choice_draw(JITTER, 0, S, M, split, "sizes"), memory=budget)
        best = chosen.tuning.best
        c = best.candidate.choice
        assert list(chosen.tuning.limit) == budget == row["limit_bytes"]
        scored = simulate(stages=S, microbatches=M, hint=c.hint, mode=c.mode, policy=c.policy,
                          jitter=JITTER, seed=0, split_backward=split,
                          order=best.candidate.order,
                          **gated(c.cap, c.memory))
        assert (row["chosen"], row["t_chosen_on"], row["t"], row["eff"], row["pkb"],
                row["memory"], row["candidates"]) == (
            chosen.hint, chosen.step_time, scored.step_time, scored.efficiency,
            list(scored.peak_activation_bytes), None if c.memory is None else list(c.memory),
            len(chosen.tuning.rows)), cfg.name
        # it fitted on the draw it chose on
        assert all(p <= m for p, m in zip(chosen.peak_activation_bytes, budget)), cfg.name
