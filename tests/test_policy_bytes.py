"""bench.policy's auto rows under a byte budget: equal memory in bytes, measured.

A `bytes` row gives `hint="auto"` the column's "2x" as `memory=`: twice the bytes strict 1F1B
holds at its peak on each rank (sim/budget.py), so the row may hold at most that on any rank.
The hindsight row chooses on the scored durations, whose strict peak is the one it is read
against; the held-out row is given those bytes as a number and chooses on step 1
(bench/policy_held.py), and must be what a fresh `simulate(hint="auto", memory=...)` on that
draw, its choice then run on the scored step, gives.
"""

from __future__ import annotations

from typing import Any

import pytest

import bench.policy as policy
from aioready.errors import ConfigError
from aioready.memory import Budget, resolve_memory
from aioready.placement import Placement
from aioready.schedulers import make_hint
from aioready.sim.budget import gated
from aioready.sim.choice import choose_auto
from aioready.sim.memory import mean_bytes
from aioready.sim.simulator import simulate
from aioready.sim.variability import JitterModel
from aioready.testing.helpers import make_mlp_stages, max_grad_diff, mse_loss, reference_step
from bench.policy_held import choice_draw
from tests.test_memory import _batches, _run

S, M, JITTER = 4, 16, "multimodal:0.3:3"


# make test: one row of each kind, the two splits across them; every byte row under heavy
ONE = ("auto bytes", "auto bytes split, held-out")


def _rows(held: bool, names: tuple[str, ...] | None = None) -> list[policy.Config]:
    return [c for c in policy.CONFIGS
            if dict(c.kwargs).get("bytes") and bool(policy._held(c)) == held
            and (names is None or c.name in names)]


@pytest.fixture(scope="module", params=[pytest.param(ONE, id="one-of-each"),
                                        pytest.param(None, marks=pytest.mark.heavy, id="all")])
def names(request: pytest.FixtureRequest) -> tuple[str, ...] | None:
    """The byte rows tested: both splits, by each kind with every row, across the kinds in
    make test."""
    kinds = [_rows(False, request.param), _rows(True, request.param)]
    for rows in kinds if request.param is None else [[*kinds[0], *kinds[1]]]:
        assert {c.split_backward for c in rows} == {False, True}, request.param
    return request.param


@pytest.fixture(scope="module")
def unit(names: tuple[str, ...] | None) -> dict:
    saved = policy.CONFIGS[:]
    policy.CONFIGS[:] = [*_rows(False, names), *_rows(True, names)]
    try:
        return policy.sim_unit(S, JITTER, 0)
    finally:
        policy.CONFIGS[:] = saved


def test_a_hindsight_byte_row_holds_at_most_twice_strict_1f1b_bytes_on_every_rank(
        names: tuple[str, ...] | None, unit: dict) -> None:
    rows = _rows(False, names)
    assert rows
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


def test_a_held_out_byte_row_is_a_fresh_choice_on_step_1_run_on_step_0(
        names: tuple[str, ...] | None, unit: dict) -> None:
    rows = _rows(True, names)
    assert rows
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


# -- count-capped candidates within bytes (sim/budget.py `Limit.counted`) ----------------------

LOGNORMAL = "lognormal:0.5"


def _sim(hint: Any, mode: str, caps: tuple[int, ...], policy: str, bound: float | None = None,
         memory: tuple[int, ...] | None = None, microbatch_order: str = "given") -> Any:
    return simulate(stages=S, microbatches=M, hint=hint, mode=mode, policy=policy,
                    jitter=LOGNORMAL, seed=0, order=microbatch_order, **gated(caps, memory))


@pytest.fixture(scope="module")
def tuning() -> Any:
    """Every candidate simulated in full (no pruning), so each row has its peaks."""
    durations = JitterModel(LOGNORMAL, seed=0, placement=Placement.linear(S),
                            num_microbatches=M, split_backward=False)
    return choose_auto(_sim, "auto", num_stages=S, num_ranks=None, num_microbatches=M,
                       split_backward=False, memory="2x", prune=False,
                       mean_bytes=lambda o: mean_bytes(durations, o.placement, 1))


def test_a_byte_budget_also_tries_count_capped_candidates_fitting_by_peak_bytes(
        tuning: Any) -> None:
    limit = list(tuning.limit)
    forms = {r.candidate.form for r in tuning.rows}
    assert {"bytes", "count 1x", "count 1.5x", "count 2x", "order"} <= forms, forms
    counted = [r for r in tuning.rows if r.candidate.counts is not None]
    assert counted and all(r.candidate.choice.memory == tuning.limit for r in counted)
    assert any(min(r.candidate.choice.cap) < M for r in counted)
    table = tuning.table()
    assert "count 1.5x" in table and "form" in table.splitlines()[0]
    assert not any(r.stopped for r in counted)
    for row in counted[::5]:  # the row is what simulate gives with the caps and the bytes
        c = row.candidate.choice
        again = _sim(c.hint, c.mode, c.cap, c.policy, None, c.memory, row.candidate.order)
        assert row.step_time == again.step_time
        assert list(row.peak) == list(again.peak_activation_bytes)
        assert row.fits == all(p <= m for p, m in zip(again.peak_activation_bytes, limit))
        # the caps bind (under the reservation, an empty rank may admit one forward ahead of
        # the order, whose own forwards always pass: tests/test_no_deadlock.py)
        hint = make_hint(c.hint, num_stages=S, num_microbatches=M)
        bounds = [max(cap, hint.peak(r) + 1) if c.policy == "reserve" else cap
                  for r, cap in enumerate(c.cap)]
        assert all(p <= b for p, b in zip(again.peak_in_flight, bounds)), (c, again)


def test_a_count_budget_gets_no_count_capped_byte_rows() -> None:
    counted = simulate(stages=S, microbatches=M, hint="auto", jitter="lognormal:0.5", seed=0,
                       cap="2x").tuning
    assert {r.candidate.form for r in counted.rows} <= {"count", "order"}
    assert all(r.candidate.counts is None and r.candidate.choice.memory is None
               for r in counted.rows)


def test_a_bad_budget_still_errors_clearly() -> None:
    with pytest.raises(ConfigError, match="no candidate schedule fits") as info:
        simulate(stages=S, microbatches=M, hint="auto", jitter="lognormal:0.5", seed=0,
                 memory="1KiB")
    assert "peak activation bytes" in str(info.value)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ConfigError, match="count"):
            resolve_memory([Budget(bytes=10, count=bad)] * S, S)


@pytest.mark.parametrize("policy", ["greedy", "light", "reserve"])
def test_caps_with_the_byte_backstop_keep_both_and_gradients_exact(policy: str) -> None:
    """Real stages, shapes varying per microbatch: the chosen count cap binds, the bytes stay
    within the budget while more than one microbatch is held (greedy, light), gradients match
    the reference."""
    stages = make_mlp_stages(4)
    xs, ys = _batches((2, 9, 3, 4, 12, 1, 6, 5))
    _, ref = reference_step(stages, mse_loss, xs, ys)
    caps = (5, 4, 3, 2)  # at or above 1F1B's peak on every rank: the reservation holds
    budgets = [Budget(bytes=20_000, count=c) for c in caps]
    step = _run(stages, xs, ys, memory=budgets, policy=policy, device="inline").last_step
    assert max_grad_diff(stages, ref) < 1e-12
    alone = _run(make_mlp_stages(4), xs, ys, memory=1, policy="greedy").last_step
    for rank, peak in step.peak_in_flight.items():
        assert peak <= caps[rank], (rank, step.peak_in_flight)
    for rank, held in step.peak_activation_bytes.items():
        # under the reservation the order's own entry forward passes the byte gate (it binds
        # only the forwards run ahead, docs/policy.md "Memory budgets"), as without a count
        if policy != "reserve":
            assert held <= max(20_000, alone.peak_activation_bytes[rank]), (rank, held)
    # the count, not the bytes, is what bound rank 0 here: the bytes alone admit more
    loose = _run(make_mlp_stages(4), xs, ys, memory=[Budget(bytes=10**9, count=c)
                                                     for c in caps], policy=policy,
                 device="inline").last_step
    assert loose.peak_in_flight[0] == caps[0]
