"""bench.policy's memo reuses simulations across rows; it must never change what auto chooses.

Each auto row of the bench, computed with the unit's shared memo (fixed rows' runs, other auto
rows' runs and stopped candidates, whole auto rows that share what decides them), is compared
with `aioready.simulate(hint="auto")` on the same durations, which simulates every candidate
afresh: the same chosen configuration and the same step time, float for float.
"""

from __future__ import annotations

import pytest

import bench.policy as policy
from aioready.sim.cutoff import Exceeded
from aioready.sim.simulator import simulate

S, M = 4, 16


# one row of each kind (plain, 2S each, given order, bytes) on multimodal in make test
# (microbatch sizes: the order candidates share the memo too); every row, and lognormal, heavy
KINDS = ("auto", "auto split, 2S each", "auto split, given order", "auto bytes split")


@pytest.mark.parametrize("jitter, kinds", [
    pytest.param("lognormal:0.5", None, marks=pytest.mark.heavy, id="lognormal-all"),
    pytest.param("multimodal:0.3:3", None, marks=pytest.mark.heavy, id="multimodal-all"),
    pytest.param("multimodal:0.3:3", KINDS, id="multimodal-kinds")])
def test_auto_rows_with_the_memo_choose_what_simulate_chooses(
        jitter: str, kinds: tuple[str, ...] | None, monkeypatch) -> None:
    # (held-out rows choose on another draw: tests/test_policy_held.py)
    autos = [c for c in policy.CONFIGS if c.hint == "auto" and not policy._held(c)
             and (kinds is None or c.name in kinds)]
    assert len({c.name for c in autos}) >= 4
    fixed = [policy.Config("zb-h2"), policy.Config("1f1b", split=True, label="greedy 1f1b",
                                                   kwargs=(("policy", "greedy"),))]
    # fixed rows first, as in the bench: their finished runs are reused by auto's candidates
    monkeypatch.setattr(policy, "CONFIGS", [*fixed, *autos])
    unit = policy.sim_unit(S, jitter, 0)
    extra = policy.BUDGETS["2x"]
    for cfg in autos:
        row = unit["rows"][f"{cfg.name}|2x"]
        given = dict(cfg.kwargs).get("order") == "given"
        fresh = simulate(stages=S, microbatches=M, hint="auto", jitter=jitter, seed=0,
                         split_backward=cfg.split_backward,
                         order="given" if given else None,
                         **policy.auto_gate(cfg, S, M, extra, _no_scored_peak))
        best = fresh.tuning.best
        assert (row["chosen"], row["t"], row["cap0"], row["peak"]) == (
            fresh.hint, fresh.step_time, best.candidate.choice.cap[0],
            max(best.peak_in_flight)), cfg.name
        assert row["candidates"] == len(fresh.tuning.rows), cfg.name


def _no_scored_peak() -> list[int]:
    raise AssertionError("a hindsight row's byte budget is '2x' of the durations chosen on")


def test_a_stopped_run_is_reused_only_under_a_bound_it_exceeds() -> None:
    memo: dict[tuple[object, ...], object] = {}
    calls: list[float | None] = []

    def stopped(bound: float | None):
        def run() -> object:
            calls.append(bound)
            raise Exceeded(bound or 0.0, 12.0)
        return run
    for bound in (10.0, 9.0, 11.0):
        with pytest.raises(Exceeded) as caught:
            policy._reuse(memo, ("k",), bound, stopped(bound))
        assert caught.value.bound == bound and caught.value.at_least >= bound
    assert calls == [10.0, 11.0]  # 9 <= 10: known to exceed; 11 > 10: run again
    assert memo[("k",)].__traceback__ is None  # kept without the stopped run's frames
    assert policy._reuse(memo, ("k",), None, lambda: "done") == "done"  # no bound: runs
    assert policy._reuse(memo, ("k",), 1.0, lambda: "again") == "done"  # finished: reused
