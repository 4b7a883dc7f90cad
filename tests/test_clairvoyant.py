"""bench/clairvoyant_list.py and bench/step_bounds.py: the clairvoyant list scheduler emits
valid schedules (bench/optimum.py's independent checker), never beats CP-SAT's proven optimum,
and the memory-aware and head-tail lower bounds never exceed it; where the bound binds (no jitter, caps
2(S - r)) a schedule meets it exactly, so neither side can be off there. The in-order rank
bound never exceeds the optimum of schedules that keep forwards in order (CP-SAT with that
constraint) nor any such schedule the scheduler or the runtime produces.
"""

from __future__ import annotations

import pytest

from aioready.schedulers import make_hint
from aioready.sim.simulator import simulate
from aioready.sim.variability import JitterModel
from aioready.tasks import Kind
from aioready.telemetry.bounds import in_order_bound, lower_bound_table
from bench.clairvoyant_list import (
    Rule,
    as_schedule,
    improve,
    in_order,
    list_schedule,
    overtaking,
)
from bench.optimum import Instance, check, instance, solve
from bench.step_bounds import head_tail_bound, in_order_rank_bound, memory_bound

RULES = [Rule(), Rule(w_pick="long"), Rule(order="ABFW"), Rule(guard=1),
         Rule(protect="B", reserve=0, drain_only=True), Rule(protect="BA", reserve=0),
         Rule(reserve=30)]


def _instance(name: str, S: int, M: int, jitter: str, seed: int, split: bool,
              caps: tuple[int, ...] | str | None = None) -> Instance:
    hint = make_hint(name, num_stages=S, num_microbatches=M, split_backward=split)
    model = JitterModel(jitter, seed=seed, placement=hint.placement, num_microbatches=M,
                        split_backward=split)
    if caps == "2x":
        caps = tuple(2 * c for c in hint.default_caps)
    comm = model.comm_table(0) if model.spec.has_comm else None
    return instance(model.table(0), placement=hint.placement, split_backward=split,
                    caps=tuple(caps or hint.default_caps), comm_ms=comm)


def _bound(inst: Instance) -> float:
    """The memory bound in the instance's units (its durations are the quantised ones)."""
    return memory_bound(inst.placement, inst.durations.astype(float), inst.split_backward,
                        inst.caps)


@pytest.mark.parametrize("name,S,M,split,jitter,caps", [
    ("1f1b", 4, 8, True, "lognormal:0.5", None), ("1f1b", 4, 8, True, "multimodal:0.3:3", "2x"),
    ("1f1b", 5, 10, False, "lognormal:0.5+comm:0.2:0.5", None),
    ("bfw", 4, 8, True, "lognormal:0.5", (1, 1, 1, 1)),
    ("interleaved-1f1b", 8, 8, False, "multimodal:0.3:3", None),
    ("interleaved-1f1b", 8, 8, True, "lognormal:0.5", "2x"),
    ("zbv", 8, 8, True, "lognormal:0.5+comm:0.1", None)])
def test_every_schedule_passes_the_checker(name: str, S: int, M: int, split: bool,
                                           jitter: str, caps: object) -> None:
    inst = _instance(name, S, M, jitter, 1, split, caps)  # type: ignore[arg-type]
    for rule in RULES:
        sch = list_schedule(inst, rule)
        assert check(inst, as_schedule(sch)) == [], (name, rule)
        assert sch.makespan == max(e for _, e in as_schedule(sch).values())
        assert sch.makespan >= _bound(inst) - 1e-9, (name, rule)


def test_checker_rejects_a_broken_clairvoyant_schedule() -> None:
    inst = _instance("1f1b", 4, 8, "lognormal:0.5", 2, True, "2x")
    good = as_schedule(list_schedule(inst))
    assert check(inst, good) == []
    b = (int(Kind.B), 1, 3)
    size = good[b][1] - good[b][0]
    at = good[(int(Kind.B), 2, 3)][1] - 1  # before its gradient has arrived
    assert any("before" in p for p in check(inst, {**good, b: (at, at + size)}))
    w = (int(Kind.W), 0, 0)
    f = (int(Kind.F), 0, 1)  # F1 on rank 0 runs while W0 does
    clash = {**good, w: (good[f][0], good[f][0] + good[w][1] - good[w][0])}
    assert any("while" in p for p in check(inst, clash))
    tight = instance(inst.table_ms(), placement=inst.placement, split_backward=True,
                     caps=(1, 1, 1, 1))
    assert any("in flight" in p for p in check(tight, good))


@pytest.mark.parametrize("split,jitter,seed,caps", [
    (True, "lognormal:0.5", 0, None), (True, "lognormal:0.5", 1, "2x"),
    (True, "multimodal:0.3:3", 2, (1, 1, 1)), (False, "lognormal:0.5", 3, None),
    (False, "multimodal:0.3:3", 4, "2x"), (True, "none", 0, None)])
def test_within_the_proven_optimum(split: bool, jitter: str, seed: int, caps: object) -> None:
    # S=3, M=4: CP-SAT proves these optimal in milliseconds; a valid schedule can be no
    # shorter than the optimum, and a lower bound no longer
    inst = _instance("1f1b", 3, 4, jitter, seed, split, caps)  # type: ignore[arg-type]
    opt = solve(inst, time_limit_s=30.0)
    assert opt.status == "OPTIMAL"
    bound = _bound(inst)
    assert lower_bound_table(inst.placement, inst.durations.astype(float), split) <= bound
    assert bound <= opt.objective + 1e-9
    table = inst.durations.astype(float)
    assert lower_bound_table(inst.placement, table, split) <= head_tail_bound(table, split)
    assert head_tail_bound(table, split) <= opt.objective + 1e-9
    for rule in RULES:
        assert list_schedule(inst, rule).makespan >= opt.objective


def test_memory_bound_is_met_where_it_binds() -> None:
    # no jitter, caps 2(S - r): the last rank can keep at most 2 W back, so the gradient's way
    # up from it is not hidden: head S-1, then all but 2 of its 3M tasks, then S-1 backwards
    # and stage 0's W; the greedy list schedule reaches exactly that
    S, M = 8, 32
    inst = _instance("1f1b", S, M, "none", 0, True, "2x")
    unit = round(1 / inst.unit_ms)
    bound = _bound(inst)
    assert bound == pytest.approx(((S - 1) + 3 * M - 2 + (S - 1) + 1) * unit)
    assert bound > lower_bound_table(inst.placement, inst.durations.astype(float), True)
    assert list_schedule(inst).makespan == pytest.approx(bound)
    wide = _instance("1f1b", S, M, "none", 0, True, (2 * S,) * S)  # W can hide the tail there
    assert _bound(wide) == pytest.approx(((S - 1) + 3 * M) * unit)
    assert list_schedule(wide).makespan == pytest.approx(_bound(wide))


def test_improve_keeps_the_best_and_stays_valid() -> None:
    inst = _instance("1f1b", 6, 24, "lognormal:0.5", 5, True, "2x")
    start = [Rule()] * 6
    rules, best = improve(inst, start, candidates=[{"w_pick": "long"}, {"order": "ABFW"},
                                                   {"protect": "B", "reserve": 0}], groups=3)
    assert best.makespan <= list_schedule(inst, start).makespan
    assert best.makespan == list_schedule(inst, rules).makespan
    assert check(inst, as_schedule(best)) == []


def _in_order_optimum(inst: Instance) -> int:
    """CP-SAT's proven optimum over schedules that run each stage's forwards in microbatch
    order, with no memory limit (what `in_order_rank_bound` bounds)."""
    from ortools.sat.python import cp_model
    model = cp_model.CpModel()
    horizon = int(inst.durations.sum() + inst.comm.sum()) + 1
    start, end = {}, {}
    per_rank: list[list[object]] = [[] for _ in range(inst.placement.num_ranks)]
    for key in inst.tasks():
        start[key] = model.new_int_var(0, horizon, "")
        end[key] = model.new_int_var(0, horizon, "")
        per_rank[inst.placement.rank_of(key[1])].append(
            model.new_interval_var(start[key], inst.duration(key), end[key], ""))
    for key in inst.tasks():
        for pred, delay in inst.predecessors(key):
            model.add(start[key] >= end[pred] + delay)
        kind, s, m = key
        if kind == Kind.F and m > 0:
            model.add(start[key] >= end[(kind, s, m - 1)])
    for intervals in per_rank:
        model.add_no_overlap(intervals)
    makespan = model.new_int_var(0, horizon, "")
    model.add_max_equality(makespan, list(end.values()))
    model.minimize(makespan)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = 30.0
    solver.parameters.num_workers = 1
    assert solver.solve(model) == cp_model.OPTIMAL
    return int(solver.objective_value)


@pytest.mark.parametrize("split,jitter,seed", [
    (True, "lognormal:0.5", 0), (True, "lognormal:0.5", 1), (True, "multimodal:0.3:3", 2),
    (False, "lognormal:0.5", 3), (False, "multimodal:0.3:3", 4), (True, "none", 0)])
def test_in_order_rank_bound_is_below_the_in_order_optimum(split: bool, jitter: str,
                                                          seed: int) -> None:
    inst = _instance("1f1b", 3, 4, jitter, seed, split, (4, 4, 4))
    table = inst.durations.astype(float)
    bound = in_order_rank_bound(table, split)
    assert bound >= in_order_bound(inst.placement, table, split) - 1e-9
    assert bound <= _in_order_optimum(inst) + 1e-9


@pytest.mark.parametrize("seed", range(4))
def test_in_order_rank_bound_is_below_in_order_schedules(seed: int) -> None:
    # the scheduler's schedules with forwards in order, and the runtime's strict and greedy ones
    for split in (True, False):
        inst = _instance("1f1b", 6, 24, "lognormal:0.5", seed, split, "2x")
        bound = in_order_rank_bound(inst.durations.astype(float), split)
        for rule in RULES:
            sch = list_schedule(inst, rule, overtaking(inst, 0.0))
            assert in_order(sch, 6)
            assert sch.makespan >= bound - 1e-9, rule
        for hint, mode in (("1f1b", "strict"), ("bfw" if split else "1f1b", "ready")):
            run = simulate(stages=6, microbatches=24, hint=hint, mode=mode, policy="greedy",
                           trace=inst.trace(), split_backward=split, cap="2x")
            assert run.step_time / inst.unit_ms >= bound - 1e-6, (hint, mode)


def test_head_tail_bound_can_exceed_the_lower_bound() -> None:
    # two stages, two microbatches, unsplit: the least head (stage 0's F of microbatch 0) and
    # the least tail come from different microbatches, so the lower bound charges rank 1 both
    # minima; its tasks of microbatch 1 cannot start before 9, which the head-tail bound sees
    import numpy as np

    from aioready.placement import Placement
    table = np.zeros((2, 2, 3))
    table[:, :, Kind.F] = [[4, 9], [1, 6]]
    table[:, :, Kind.B] = [[4, 2], [4, 4]]
    inst = instance(table, placement=Placement.linear(2), split_backward=False, caps=(2, 2),
                    unit_ms=1.0)
    assert lower_bound_table(inst.placement, table, False) == 21
    assert head_tail_bound(table, False) == 22
    opt = solve(inst, time_limit_s=30.0)
    assert opt.status == "OPTIMAL" and opt.objective >= 22
