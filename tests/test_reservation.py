"""The reserving ready-mode policy: the hint's next task keeps its place, another ready task
backfills only when the forecast says it ends in time, entry forwards run ahead only within the
memory above the hint's peak, and the reservation is used only where it cannot deadlock."""

from __future__ import annotations

import math
import random

import pytest

import aioready.forecast as forecast_module
from aioready.forecast import COST_UNIT, MAX_FACTOR, Forecast, decode_duration, encode_duration
from aioready.hints import HintOrder
from aioready.ready_set import ReadySet
from aioready.runtime.rank import reservation_holds
from aioready.schedulers import HINTS, make_hint
from aioready.sim.simulator import simulate
from aioready.tasks import Kind, Task


def tasks(text: str) -> list[Task]:
    return [Task.parse(word) for word in text.split()]


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def reserving(order: str, *, cap: int, peak: int, fits: bool | None = None,
              forecast: Forecast | None = None) -> ReadySet:
    ranked = tasks(order)
    judge = forecast.fits if forecast is not None else (lambda c, r: bool(fits))
    return ReadySet({t: i for i, t in enumerate(ranked)}, cap=cap, num_chunks=1,
                    split_backward=False, reserve_order=ranked, reserve_peak=peak, fits=judge)


def test_the_reserved_task_waits_for_a_candidate_that_does_not_fit() -> None:
    rs = reserving("F0 F1 B0 F2 B1 B2", cap=3, peak=3, fits=False)
    rs.push(Task.parse("F0"))
    assert rs.pop_nowait() == Task.parse("F0")
    rs.push(Task.parse("B0"))  # F1 (reserved) has not arrived: B0 would delay it
    assert rs.pop_nowait() is None and rs.reserved == Task.parse("F1")
    rs.push(Task.parse("F1"))
    assert rs.pop_nowait() == Task.parse("F1")
    assert rs.pop_nowait() == Task.parse("B0")  # now the reserved one itself


def test_a_candidate_that_fits_runs_before_the_reserved_task() -> None:
    rs = reserving("F0 F1 B0 F2 B1 B2", cap=3, peak=3, fits=True)
    rs.push(Task.parse("F0"))
    rs.pop_nowait()
    rs.push(Task.parse("B0"))
    assert rs.pop_nowait() == Task.parse("B0")  # backfilled
    rs.push(Task.parse("F1"))
    assert rs.pop_nowait() == Task.parse("F1") and rs.reserved == Task.parse("F2")


def test_entry_forwards_run_ahead_only_within_the_room_above_the_peak() -> None:
    order = "F0 B0 F1 B1 F2 B2 F3 B3"
    at_peak = reserving(order, cap=1, peak=1, fits=False)
    above = reserving(order, cap=2, peak=1, fits=False)
    for rs in (at_peak, above):
        for t in tasks("F0 F1 F2"):
            rs.push(t)
        assert rs.pop_nowait() == Task.parse("F0")
    assert at_peak.pop_nowait() is None  # F1 waits for B0 (cap 1)
    assert above.pop_nowait() == Task.parse("F1")  # one microbatch ahead: the extra memory
    assert above.pop_nowait() is None  # F2 would be a second one ahead: no room
    assert above.in_flight == 2 <= above.cap


def test_a_gated_reserved_task_lets_the_backward_that_frees_memory_run() -> None:
    rs = reserving("F0 F1 B0 B1", cap=1, peak=1, fits=False)
    rs.push(Task.parse("F0"))
    rs.pop_nowait()
    rs.push(Task.parse("F1"))  # reserved, ready, but the cap is reached
    rs.push(Task.parse("B0"))
    assert rs.pop_nowait() == Task.parse("B0")


def test_the_forecast_backfills_only_what_ends_before_the_announced_arrival() -> None:
    clock = Clock()
    fc = Forecast()
    fc.new_step(clock)
    b0, f1 = Task.parse("B0"), Task.parse("F1")
    assert not fc.fits(b0, f1)  # no estimate yet: behave as strict
    fc.observe(b0, 2.0)
    assert not fc.fits(b0, f1)  # no idea yet how long F1's feeder takes
    fc.observe(Task.parse("F0"), 3.0)
    assert fc.fits(b0, f1)  # no notice: its feeder has not started, F1 is >= 3 away
    fc.notice(f1, 1.5)  # it started now and takes 1.5
    assert not fc.fits(b0, f1)
    fc.notice(f1, 3.0)
    assert fc.fits(b0, f1)
    clock.t = 1.5
    assert not fc.fits(b0, f1)  # 1.5 + 2 > 3
    fc.arrived(f1)
    assert fc.fits(b0, f1)  # back to "not started": now + 3


def test_a_backfill_keeps_a_margin_of_one_standard_deviation() -> None:
    fc = Forecast()
    fc.new_step(Clock())
    b0, f1 = Task.parse("B0"), Task.parse("F1")
    for d in (1.0, 3.0):  # mean 2, standard deviation 1
        fc.observe(b0, d)
    assert fc.margin(b0) == pytest.approx(1.0)
    fc.notice(f1, 2.5)
    assert not fc.fits(b0, f1)  # 2 + 1 > 2.5, though 2 alone would fit
    fc.notice(f1, 3.0)
    assert fc.fits(b0, f1)


def test_a_weight_piece_backfills_until_the_reserved_task_is_announced() -> None:
    fc = Forecast()
    fc.new_step(Clock())
    w0, b0, f1 = Task.parse("W0"), Task.parse("B0"), Task.parse("F1")
    assert not fc.fits(w0, f1)  # no estimate of W yet: behave as strict
    fc.observe(w0, 5.0)
    fc.observe(b0, 5.0)
    fc.observe(Task.parse("F0"), 1.0)
    assert fc.fits(w0, f1)  # F1's feeder has not started: a W feeds no one, it may run
    assert not fc.fits(b0, f1)  # a B of the same length may not (5 > 1)
    fc.notice(f1, 1.0)  # the feeder started: now the W must end in time like any task
    assert not fc.fits(w0, f1)
    fc.notice(f1, 10.0)
    assert fc.fits(w0, f1)


def test_a_costly_microbatch_is_expected_to_stay_costly() -> None:
    fc = Forecast()
    fc.new_step(Clock())
    f0, f1 = Task.parse("F0"), Task.parse("F1")
    fc.observe(f0, 1.0)
    fc.carry(1, 3.0)  # upstream: microbatch 1 took three times the mean
    assert fc.estimate(f1) == pytest.approx(3.0) and fc.estimate(f0) == pytest.approx(1.0)
    fc.observe(f1, 3.0)  # normalised by its factor: the mean stays 1
    assert fc.mean(0, Kind.F) == pytest.approx(1.0)
    assert fc.cost_factor(f1, 1e9) == MAX_FACTOR
    fc.carry(2, 1e12)  # a peer's word is clamped
    assert fc.estimate(Task.parse("F2")) == pytest.approx(MAX_FACTOR)
    assert decode_duration(encode_duration(0.25)) == pytest.approx(0.25)
    assert encode_duration(1e30) == 2**32 - 1 and encode_duration(-1) == 0
    assert COST_UNIT == 1024


def test_forward_ended_is_observe_cost_factor_and_carry_float_for_float() -> None:
    """The runtime's one call at a forward's end must leave the forecast exactly where the
    three calls it replaces did (decisions depend on these floats)."""
    rng = random.Random(7)
    for _ in range(200):
        one, three = Forecast(), Forecast()
        one.new_step(Clock())
        three.new_step(Clock())
        for _ in range(60):
            task = Task(rng.choice([Kind.F, Kind.B]), rng.randrange(6), rng.randrange(2))
            d = rng.choice([0.0, -1.0, rng.lognormvariate(0, 1), rng.uniform(0, 1e-6)])
            if rng.random() < 0.2:
                factor = rng.lognormvariate(0, 2)
                one.carry(task.microbatch, factor)
                three.carry(task.microbatch, factor)
            if task.kind is Kind.F:
                got = one.forward_ended(task, d)
                three.observe(task, d)
                want = three.cost_factor(task, d)
                three.carry(task.microbatch, want)
                assert got == want
            else:
                one.observe(task, d)
                three.observe(task, d)
            for t in (task, Task(Kind.F, task.microbatch, task.chunk)):
                assert (one.estimate(t), one.margin(t), one.early_estimate(t)) == (
                    three.estimate(t), three.margin(t), three.early_estimate(t))
            assert one.carried(task.microbatch) == three.carried(task.microbatch)



def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) ==
                                                  math.copysign(1, b))


def test_the_written_out_comparisons_equal_the_builtin_min_max_formulas() -> None:
    """forecast Note [no min/max]: the old formulas, with the builtins, against the new code."""
    rng = random.Random(3)
    edges = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1 / MAX_FACTOR, MAX_FACTOR, 5e-324,
             -5e-324, 1.0, 2**32 / 1e6, 2**31 / 1e6, -1.0]
    for x in edges + [rng.lognormvariate(0, 4) * rng.choice([1, -1]) for _ in range(3000)]:
        assert _same(forecast_module._clamp(x), min(MAX_FACTOR, max(1 / MAX_FACTOR, x)))
        if math.isfinite(x):
            assert encode_duration(x) == min(2**32 - 1, max(0, int(x * 1e6)))
    for _ in range(300):  # the deviation and the early side, from running sums as before
        fc, sums = Forecast(), [0.0, 0.0, 0]
        fc.new_step(Clock())
        b0 = Task.parse("B0")
        same = rng.random() < 0.5  # equal durations: the variance rounds to +-tiny or 0
        base = rng.lognormvariate(0, 3)
        for _ in range(rng.randrange(1, 40)):
            d = base if same else rng.choice([0.0, rng.lognormvariate(0, 3)])
            fc.observe(b0, d)
            sums = [sums[0] + d, sums[1] + d * d, sums[2] + 1]
            mean = sums[0] / sums[2]
            std = max(0.0, sums[1] / sums[2] - mean * mean) ** 0.5
            assert _same(fc.margin(b0), std)
            assert _same(fc.early_estimate(b0), max(0.0, mean - std / 2))


@pytest.mark.parametrize("name", sorted(HINTS))
def test_every_hint_of_the_library_runs_to_completion(name: str) -> None:
    spec = HINTS[name]
    split = bool(spec.needs_split)
    hint = make_hint(name, num_stages=4 * spec.chunks, num_microbatches=8, split_backward=split)
    assert hint.runs_to_completion()
    assert reservation_holds(hint, list(hint.default_caps))
    below = [max(1, c - 1) for c in hint.default_caps]
    assert not reservation_holds(hint, below) or below == list(hint.default_caps)


def test_orders_that_cannot_complete_are_not_reserved_for() -> None:
    good = make_hint("1f1b", num_stages=2, num_microbatches=2)
    local = HintOrder("local", good.placement, 2, False, (good.orders[0], tuple(tasks(
        "B0 F0 F1 B1"))))
    # rank 0 waits for B0 before it sends F1, rank 1 waits for F1 before it runs B0
    cycle = HintOrder("cycle", good.placement, 2, False, (tuple(tasks("F0 B0 F1 B1")),
                                                         tuple(tasks("F0 F1 B0 B1"))))
    for hint in (local, cycle):
        assert not hint.runs_to_completion()
        assert not reservation_holds(hint, [2, 2])
        result = simulate(stages=2, microbatches=2, hint=hint, mode="ready", steps=2)
        assert result.num_notices == 0 and result.step_time > 0  # greedy, and it completes


def test_the_simulator_uses_the_reservation_by_default() -> None:
    kw = dict(stages=4, microbatches=8, jitter="lognormal:0.5", seed=3, steps=2)
    reserve = simulate(**kw)  # type: ignore[arg-type]
    greedy = simulate(policy="greedy", **kw)  # type: ignore[arg-type]
    assert reserve.num_notices > 0 and greedy.num_notices == 0
    assert reserve.num_tasks == greedy.num_tasks and reserve.num_messages == greedy.num_messages
    with pytest.raises(Exception, match="policy"):
        simulate(policy="eager", **kw)  # type: ignore[arg-type]


def test_a_notice_says_which_task_and_how_long_and_refuses_a_stage_not_held() -> None:
    from aioready.errors import ProtocolError
    from aioready.placement import Placement
    from aioready.runtime.notices import NOTICE_B, Notices
    place = Placement.linear(3)
    middle, last = Notices(1, place, (1,)), Notices(2, place, (2,))
    fc = Forecast()
    fc.new_step(Clock())
    f0, b0 = Task.parse("F0"), Task.parse("B0")
    assert middle.announce(f0, fc, step=4) is None  # no estimate yet
    for d in (1.0, 3.0):
        fc.observe(f0, d)
        fc.observe(b0, 2 * d)
    peer, msg = middle.announce(f0, fc, step=4)  # type: ignore[misc]
    assert (peer, msg.stage, msg.step, msg.tag & NOTICE_B) == (2, 2, 4, 0)
    assert last.read(msg, 8) == (f0, pytest.approx(2.0 - 1.0 / 2))  # the early side
    peer, msg = middle.announce(b0, fc, step=4)  # type: ignore[misc]
    assert (peer, msg.stage, bool(msg.tag & NOTICE_B)) == (0, 0, True)
    assert Notices(0, place, (0,)).read(msg, 8) == (b0, pytest.approx(4.0 - 2.0 / 2))
    assert last.announce(f0, fc, step=4) is None  # the last stage's F feeds nobody
    with pytest.raises(ProtocolError, match="does not hold"):
        middle.read(msg, 8)
