"""The offline optimum of one pipeline step, for small instances, with OR-Tools CP-SAT.

The lower bound (aioready.telemetry.bounds) ignores memory and the order of tasks on a rank, so
on jittered steps no schedule may reach it. This module finds the best schedule a clairvoyant
planner could run for known durations under the same in-flight rule as the runtime
(aioready/in_flight.py), so a policy's step time can be read against the true limit. It is a
benchmark helper (an optional `bench` extra), not part of the library: the solver takes seconds
to minutes per instance and is only practical for S <= 8, M <= 32.

Formulation (docs/policy_measurements.md "The offline optimum"), in integer time units of
`unit_ms`:
  - one fixed-size interval per task (F, B, and W with a split backward) on its stage's rank;
  - no overlap on a rank (one task at a time, no preemption);
  - F(s,m) starts after F(s-1,m) ends plus the activation's message delay, B(s,m) after F(s,m)
    and after B(s+1,m) plus the gradient's delay, W(s,m) after B(s,m);
  - on each rank a cumulative of capacity `cap` over one interval per microbatch, from the start
    of its entry F (chunk 0) to the end of its last backward piece on that rank;
  - minimise the makespan (the step time: the first task starts at 0).
Durations are quantised to `unit_ms` (rounded to nearest) once, in `Instance`; the simulator is
then given the same quantised table (`Instance.trace`), so optimum, simulation and lower bound
read the very same numbers. `check` verifies a schedule against the instance without the model,
and every schedule `solve` returns has passed it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from aioready.placement import Placement
from aioready.sim.traces import Trace
from aioready.tasks import Kind

__all__ = ["Instance", "Optimum", "instance", "solve", "check", "greedy", "schedule_of",
           "TaskKey"]

TaskKey = tuple[int, int, int]
"""(kind, stage, microbatch) of one task."""


@dataclass(frozen=True)
class Instance:
    """One step to plan: integer durations (stages, M, 3), message delays (stages, M, 2)
    indexed by the destination stage (0 activation, 1 gradient), and a cap per rank."""

    placement: Placement
    split_backward: bool
    durations: np.ndarray
    comm: np.ndarray
    caps: tuple[int, ...]
    unit_ms: float
    sizes: np.ndarray | None = None
    """the microbatches' known sizes (aioready/sim/order.py), where the durations carry them"""

    @property
    def num_microbatches(self) -> int:
        return int(self.durations.shape[1])

    @property
    def kinds(self) -> tuple[Kind, ...]:
        return (Kind.F, Kind.B, Kind.W) if self.split_backward else (Kind.F, Kind.B)

    def tasks(self) -> list[TaskKey]:
        S, M = self.placement.num_stages, self.num_microbatches
        return [(int(k), s, m) for s in range(S) for m in range(M) for k in self.kinds]

    def duration(self, key: TaskKey) -> int:
        kind, stage, mb = key
        return int(self.durations[stage, mb, kind])

    def table_ms(self) -> np.ndarray:
        """The quantised durations in ms: what the simulator and the lower bound are given."""
        return self.durations.astype(np.float64) * self.unit_ms

    def trace(self) -> Trace:
        """The quantised durations as a one-step Trace for aioready.simulate."""
        return Trace(self.table_ms()[None], placement=self.placement,
                     split_backward=self.split_backward, source="quantised durations",
                     sizes=None if self.sizes is None else self.sizes[None])

    def permuted(self, slots: tuple[int, ...]) -> "Instance":
        """The same step with slot i holding microbatch `slots[i]` (a microbatch order): the
        same optimum, relabelled."""
        pick = list(slots)
        return Instance(self.placement, self.split_backward, self.durations[:, pick],
                        self.comm[:, pick], self.caps, self.unit_ms,
                        None if self.sizes is None else self.sizes[pick])

    def predecessors(self, key: TaskKey) -> list[tuple[TaskKey, int]]:
        """(task, delay) pairs: `key` may start once each task has ended plus its delay."""
        kind, s, m = key
        last = self.placement.num_stages - 1
        if kind == Kind.F:
            return [((int(Kind.F), s - 1, m), int(self.comm[s, m, 0]))] if s > 0 else []
        if kind == Kind.B:
            out = [((int(Kind.F), s, m), 0)]
            if s < last:
                out.append(((int(Kind.B), s + 1, m), int(self.comm[s, m, 1])))
            return out
        return [((int(Kind.B), s, m), 0)]

    def entry_stage(self, rank: int) -> int:
        """The stage whose F admits a microbatch on `rank` (chunk 0, aioready/in_flight.py)."""
        return self.placement.stage_of(rank, 0)

    def last_pieces(self, rank: int, mb: int) -> list[TaskKey]:
        """The backward pieces whose last end releases `mb` on `rank`: one per chunk."""
        kind = int(Kind.W if self.split_backward else Kind.B)
        return [(kind, s, mb) for s in self.placement.stages_of(rank)]


def instance(table_ms: np.ndarray, *, placement: Placement, split_backward: bool,
             caps: tuple[int, ...], comm_ms: np.ndarray | None = None,
             unit_ms: float = 1e-2, sizes: np.ndarray | None = None) -> Instance:
    """Quantise a duration table (stages, M, 3) in ms, as `Durations.table(step)` gives it, and
    optionally a JitterModel's `comm_table(step)`, to integer units of `unit_ms`."""
    table = np.asarray(table_ms, dtype=np.float64)
    S, M, _ = table.shape
    if S != placement.num_stages or len(caps) != placement.num_ranks:
        raise ValueError(f"instance: table has {S} stages for a placement of "
                         f"{placement.num_stages}, {len(caps)} caps for {placement.num_ranks} ranks")
    durations = np.rint(table / unit_ms).astype(np.int64)
    if not split_backward:
        durations[:, :, Kind.W] = 0
    comm = (np.zeros((S, M, 2), dtype=np.int64) if comm_ms is None
            else np.rint(np.asarray(comm_ms) / unit_ms).astype(np.int64))
    return Instance(placement, split_backward, durations, comm, tuple(int(c) for c in caps),
                    unit_ms, None if sizes is None else np.asarray(sizes, dtype=np.float64))


@dataclass(frozen=True)
class Optimum:
    """What the solver found: its status, the best schedule's makespan and the proven bound."""

    status: str
    """OPTIMAL (proven) or FEASIBLE (time limit reached first)"""
    objective: int
    """makespan of the best schedule found, in units"""
    bound: int
    """the solver's proven lower bound on the optimum, in units"""
    unit_ms: float
    wall_s: float
    schedule: dict[TaskKey, tuple[int, int]]
    """task -> (start, end) in units"""

    @property
    def makespan_ms(self) -> float:
        return self.objective * self.unit_ms

    @property
    def bound_ms(self) -> float:
        return self.bound * self.unit_ms

    def as_dict(self) -> dict[str, Any]:
        return {"status": self.status, "makespan_ms": self.makespan_ms,
                "bound_ms": self.bound_ms, "wall_s": self.wall_s}


def greedy(inst: Instance) -> dict[TaskKey, tuple[int, int]]:
    """A valid schedule to start the solver from (and to bound its horizon): list scheduling
    that always places the task that can start earliest, backward pieces before forwards and
    low microbatches first on ties, admitting microbatches to a rank in microbatch order."""
    rank_of = inst.placement.rank_of
    R = inst.placement.num_ranks
    free = [0] * R
    admitted = [0] * R  # microbatches admitted so far, in order
    releases: list[list[int]] = [[] for _ in range(R)]  # release times of admitted ones
    done: dict[TaskKey, tuple[int, int]] = {}
    todo = set(inst.tasks())
    while todo:
        best: tuple[int, int, int, TaskKey] | None = None
        for key in todo:
            at = _earliest(inst, key, done, free, admitted, releases)
            if at is not None:
                cand = (at, -key[0], key[2], key)
                best = cand if best is None or cand < best else best
        if best is None:
            raise RuntimeError("greedy schedule is stuck (a cap below 1?)")
        at, _, _, key = best
        rank = rank_of(key[1])
        done[key] = (at, at + inst.duration(key))
        free[rank] = done[key][1]
        todo.discard(key)
        if key[0] == Kind.F and key[1] == inst.entry_stage(rank):
            admitted[rank] += 1
        pieces = inst.last_pieces(rank, key[2])
        if key in pieces and all(p in done for p in pieces):
            releases[rank].append(max(done[p][1] for p in pieces))
    return done


def _earliest(inst: Instance, key: TaskKey, done: dict[TaskKey, tuple[int, int]],
              free: list[int], admitted: list[int], releases: list[list[int]]) -> int | None:
    """When `key` could start after what is placed, or None if it cannot be placed yet."""
    rank = inst.placement.rank_of(key[1])
    at = free[rank]
    for pred, delay in inst.predecessors(key):
        if pred not in done:
            return None
        at = max(at, done[pred][1] + delay)
    if key[0] == Kind.F and key[1] == inst.entry_stage(rank):
        if key[2] != admitted[rank]:
            return None
        over = admitted[rank] - inst.caps[rank]  # this many must have left first
        if over >= 0:
            left = sorted(releases[rank])
            if len(left) <= over:
                return None
            at = max(at, left[over])
    return at


def solve(inst: Instance, *, time_limit_s: float = 10.0, workers: int = 1, seed: int = 0,
          start_from: Iterable[dict[TaskKey, tuple[int, int]]] = ()) -> Optimum:
    """Minimise the makespan with CP-SAT; raise if no schedule is found or one fails `check`.

    The search starts from the shortest valid schedule of `start_from` (say, the spans of
    simulated runs, `schedule_of`), or `greedy(inst)` if none is valid; its makespan also bounds
    the horizon, so the answer is never worse than a valid schedule it was given. A solver that
    runs out of time before its first solution returns that start schedule, as FEASIBLE.
    """
    from ortools.sat.python import cp_model

    model = cp_model.CpModel()
    valid = [sch for sch in start_from if not check(inst, sch)]
    best = min(valid or [greedy(inst)], key=_makespan)
    origin = min(s for s, _ in best.values())
    first = {k: (s - origin, e - origin) for k, (s, e) in best.items()}
    horizon = _makespan(first)
    start: dict[TaskKey, Any] = {}
    end: dict[TaskKey, Any] = {}
    per_rank: list[list[Any]] = [[] for _ in range(inst.placement.num_ranks)]
    for key in inst.tasks():
        size = inst.duration(key)
        start[key] = model.new_int_var(0, horizon, f"s{key}")
        end[key] = model.new_int_var(0, horizon, f"e{key}")
        per_rank[inst.placement.rank_of(key[1])].append(
            model.new_interval_var(start[key], size, end[key], f"i{key}"))
    for key in inst.tasks():
        model.add_hint(start[key], first[key][0])
        model.add_hint(end[key], first[key][1])
        for pred, delay in inst.predecessors(key):
            model.add(start[key] >= end[pred] + delay)
    for rank, intervals in enumerate(per_rank):
        model.add_no_overlap(intervals)
        model.add_cumulative(_held(model, inst, rank, start, end, horizon),
                             [1] * inst.num_microbatches, inst.caps[rank])
    makespan = model.new_int_var(0, horizon, "makespan")
    model.add_max_equality(makespan, list(end.values()))
    model.minimize(makespan)

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit_s)
    solver.parameters.num_workers = int(workers)
    solver.parameters.random_seed = int(seed)
    began = time.perf_counter()
    code = solver.solve(model)
    wall = time.perf_counter() - began
    if code == cp_model.INFEASIBLE or code == cp_model.MODEL_INVALID:
        raise RuntimeError(f"CP-SAT: {solver.status_name(code)} (the start schedule was valid)")
    if code == cp_model.UNKNOWN:  # out of time before its first solution: the start is one
        bound = max(0, int(np.ceil(solver.best_objective_bound - 1e-6)))
        return Optimum("FEASIBLE", horizon, min(bound, horizon), inst.unit_ms, wall, first)
    status = solver.status_name(code)
    schedule = {k: (solver.value(start[k]), solver.value(end[k])) for k in inst.tasks()}
    problems = check(inst, schedule)
    if problems:
        raise RuntimeError("CP-SAT returned a schedule that fails the checker: "
                           + "; ".join(problems[:5]))
    objective = int(solver.objective_value)
    if objective != max(e for _, e in schedule.values()):
        raise RuntimeError(f"objective {objective} is not the schedule's last end "
                           f"{max(e for _, e in schedule.values())}")
    bound = int(np.ceil(solver.best_objective_bound - 1e-6))
    return Optimum(status, objective, min(bound, objective), inst.unit_ms, wall, schedule)


def _held(model: Any, inst: Instance, rank: int, start: dict[TaskKey, Any],
          end: dict[TaskKey, Any], horizon: int) -> list[Any]:
    """One interval per microbatch: from its entry F's start to its last piece's end."""
    entry = inst.entry_stage(rank)
    out = []
    for m in range(inst.num_microbatches):
        pieces = inst.last_pieces(rank, m)
        if len(pieces) == 1:
            release = end[pieces[0]]
        else:
            release = model.new_int_var(0, horizon, f"release{rank},{m}")
            model.add_max_equality(release, [end[p] for p in pieces])
        first = start[(int(Kind.F), entry, m)]
        size = model.new_int_var(_round_trip(inst, entry, m), horizon, f"held{rank},{m}")
        out.append(model.new_interval_var(first, size, release, f"h{rank},{m}"))
    return out


def schedule_of(spans: Iterable[Any], unit_ms: float, origin: float = 0.0
                ) -> dict[TaskKey, tuple[int, int]]:
    """A schedule in units from a step's spans (telemetry.spans.Span: stage, microbatch, kind,
    start, end in ms of the virtual clock), times counted from `origin`."""
    return {(int(sp.kind), sp.stage, sp.microbatch): (int(round((sp.start - origin) / unit_ms)),
                                                      int(round((sp.end - origin) / unit_ms)))
            for sp in spans}


def _round_trip(inst: Instance, entry: int, mb: int) -> int:
    """The least time `mb` is held from `entry`: its dependency chain from F(entry) to B(entry)
    (and W(entry) when split). Implied by the precedences, but stated on the interval's size
    it lets the cumulative's energy reasoning see it, which tightens the proven bound."""
    S = inst.placement.num_stages
    d, c = inst.durations[:, mb], inst.comm[:, mb]
    total = d[entry:, Kind.F].sum() + d[entry:, Kind.B].sum()
    total += c[entry + 1:, 0].sum() + c[entry:S - 1, 1].sum()
    if inst.split_backward:
        total += d[entry, Kind.W]
    return int(total)


def _makespan(schedule: dict[TaskKey, tuple[int, int]]) -> int:
    return max(e for _, e in schedule.values()) - min(s for s, _ in schedule.values())


def check(inst: Instance, schedule: dict[TaskKey, tuple[int, int]]) -> list[str]:
    """Every way `schedule` breaks the instance's rules (empty: it is a valid schedule).

    Written without the solver's model: durations, precedences with delays, one task at a time
    per rank, and the in-flight count replayed as events (a release at t before an admit at t).
    """
    problems: list[str] = []
    tasks = inst.tasks()
    if set(schedule) != set(tasks):
        missing = len(set(tasks) - set(schedule))
        extra = len(set(schedule) - set(tasks))
        return [f"schedule has {missing} tasks missing and {extra} unknown"]
    for key in tasks:
        s, e = schedule[key]
        if s < 0 or e - s != inst.duration(key):
            problems.append(f"{_name(key)} runs [{s}, {e}) for a duration of {inst.duration(key)}")
        for pred, delay in inst.predecessors(key):
            if s < schedule[pred][1] + delay:
                problems.append(f"{_name(key)} starts at {s} before {_name(pred)} ends at "
                                f"{schedule[pred][1]} (+ delay {delay})")
    for rank in range(inst.placement.num_ranks):
        problems += _rank_problems(inst, rank, schedule)
    return problems


def _rank_problems(inst: Instance, rank: int,
                   schedule: dict[TaskKey, tuple[int, int]]) -> list[str]:
    problems = []
    stages = set(inst.placement.stages_of(rank))
    runs = sorted((schedule[k], k) for k in inst.tasks() if k[1] in stages)
    for (a, ka), (b, kb) in zip(runs, runs[1:]):
        if b[0] < a[1] and b[1] > b[0] and a[1] > a[0]:
            problems.append(f"rank {rank}: {_name(kb)} starts at {b[0]} while {_name(ka)} runs "
                            f"until {a[1]}")
    events = []
    entry = inst.entry_stage(rank)
    for m in range(inst.num_microbatches):
        events.append((schedule[(int(Kind.F), entry, m)][0], 1, +1))
        events.append((max(schedule[p][1] for p in inst.last_pieces(rank, m)), 0, -1))
    held = 0
    for t, _, delta in sorted(events):
        held += delta
        if held > inst.caps[rank]:
            problems.append(f"rank {rank}: {held} microbatches in flight at {t}, cap "
                            f"{inst.caps[rank]}")
    return problems


def _name(key: TaskKey) -> str:
    kind, stage, mb = key
    return f"{Kind(kind).name}{mb}@stage{stage}"
