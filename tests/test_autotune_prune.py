"""hint="auto" with pruning: the same choice as the full search, and every stopped candidate
really was slower (its recorded lower bound is below its true step time, above the best's)."""

from __future__ import annotations

import pytest

import aioready
from aioready.sim.choice import choose_auto
from aioready.sim.cutoff import Exceeded

CASES = [(4, 8, "lognormal:0.5", 0, False, "2x", 1), (4, 8, "multimodal:0.3:3", 1, True, "2x", 1),
         (4, 12, "lognormal:0.5", 2, True, "4x", 2), (6, 12, "multimodal:0.3:3", 3, False, "1x", 1),
         (4, 8, "lognormal:0.2+straggler:1:1.5", 4, True, None, 1)]


def _tune(S: int, M: int, jitter: str, seed: int, split: bool, budget: str | None, steps: int,
          prune: bool):  # type: ignore[no-untyped-def]
    def run(order, mode, caps, policy, bound=None):  # type: ignore[no-untyped-def]
        return aioready.simulate(stages=S, microbatches=M, hint=order, mode=mode, jitter=jitter,
                                 seed=seed, cap=list(caps), split_backward=split,
                                 policy=policy, steps=steps, stop_after=bound)
    return choose_auto(run, "auto", num_stages=S, num_ranks=None, num_microbatches=M,
                       split_backward=split, budget=budget, prune=prune)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"S{c[0]}M{c[1]}-{c[2]}-s{c[3]}")
def test_pruned_search_chooses_as_the_full_one(case: tuple) -> None:  # type: ignore[type-arg]
    pruned, full = _tune(*case, prune=True), _tune(*case, prune=False)
    assert pruned.choice == full.choice
    assert pruned.best == full.best
    assert not any(r.stopped for r in full.rows)
    true = {r.candidate: r.step_time for r in full.rows}
    assert set(true) == {r.candidate for r in pruned.rows}  # every candidate has its row
    stopped = [r for r in pruned.rows if r.stopped]
    for row in stopped:
        assert full.best.step_time < row.step_time <= true[row.candidate] * (1 + 1e-12)
    for row in pruned.rows:
        if not row.stopped:
            assert row.step_time == true[row.candidate]


def test_some_candidates_are_stopped_and_the_table_says_so() -> None:
    tuning = _tune(*CASES[1], prune=True)
    assert any(r.stopped for r in tuning.rows)
    assert "stopped:" in tuning.table() and ">" in tuning.table()
    assert tuning.rows[0] is tuning.best


def test_stop_after_raises_only_past_the_bound() -> None:
    kw = dict(stages=4, microbatches=8, hint="1f1b", jitter="lognormal:0.5", seed=0)
    full = aioready.simulate(**kw)  # type: ignore[arg-type]
    assert aioready.simulate(**kw, stop_after=full.step_time).step_time == full.step_time
    with pytest.raises(Exceeded) as info:
        aioready.simulate(**kw, stop_after=0.9 * full.step_time)  # type: ignore[arg-type]
    assert 0.9 * full.step_time < info.value.at_least <= full.step_time
