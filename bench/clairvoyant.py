"""The clairvoyant schedule at S=128 (M=512, one seed, split backward): how close any schedule
that knows every duration comes to the issue's goals, and the bounds no schedule can beat.

Per jitter and budget, on bench.policy_large's durations (JitterModel, seed 0, quantised to
0.01 ms as bench/optimum.py does): the lower bound, the in-order bound, the memory-aware bound
(bench/step_bounds.py), and the best schedule bench/clairvoyant_list.py finds (a few whole-pipeline
rules, then coordinate descent over per-rank rules), checked by bench/optimum.py's `check`;
against strict 1F1B with an unsplit backward (the issue's baseline; simulated here, the runtime
itself). Budgets: "2x" is twice strict 1F1B's peak on each rank (2(S - r)), a count is the same
on every rank. No runtime simulation of a ready policy runs here (bench.policy_large does that).

Run: python -m bench.clairvoyant [--stages 128] [--seed 0 | --seeds 0-4] [--jitters a,b]
     [--budgets 2x,256] [--groups 8] [--rounds 1] [--out clairvoyant] [--quick]
(--quick: S=32, 4 groups, results in clairvoyant_quick.md; about a minute of CPU at S=128.
--seeds A-B: one row per seed, each seed's baseline, bounds and search its own.)
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from typing import Any

import numpy as np

from aioready.caps import resolve_caps
from aioready.placement import Placement
from aioready.schedulers import make_hint
from aioready.sim.simulator import simulate
from aioready.sim.variability import JitterModel
from aioready.telemetry.bounds import in_order_bound, lower_bound_table

from .clairvoyant_list import (
    Rule,
    Schedule,
    as_schedule,
    improve,
    in_order,
    list_schedule,
    overtaking,
    ready_times,
)
from .common import write_result
from .optimum import Instance, check, instance
from .step_bounds import in_order_rank_bound, memory_bound

GOALS = {"lognormal:0.5": 1.70, "multimodal:0.3:3": 2.2}
"""the issue's goals at S=128, against strict unsplit 1F1B"""

INF = math.inf
BASES = {  # whole-pipeline rules tried first, each with forwards in order and overtaking
    "greedy BFW": Rule(),
    "reserve for B in the drain": Rule(protect="B", reserve=0, drain_only=True),
    "reserve for B in the drain, keep W": Rule(protect="B", reserve=0, drain_only=True,
                                               drain_keep=0.6),
    "forwards first": Rule(order="ABFW"),
}
OVERTAKE = (0.0, 10.0)
"""`overtaking` weights: forwards in microbatch order, and short forwards first"""
PREDICTIONS = 4
"""reruns that reserve for the arrivals the previous schedule had (`ready_times`)"""
CHANGES = [  # what coordinate descent tries per group of ranks
    {"protect": "B", "reserve": 0, "drain_only": True},
    {"protect": "BA", "reserve": 0, "drain_only": False},
    {"reserve": INF},
    {"drain_keep": 0.0},
    {"drain_keep": 1.0},
    {"order": "ABFW"},
]


def critical_path(inst: Instance, sch: Schedule) -> list[int]:
    """Task ids from the first task to the last along which every task starts exactly when the
    one before it ends (the rank's previous task, or an input plus its delay); where none does
    (a wait), the latest-ending of those is taken. The schedule is as long as this chain."""
    S, M, K = inst.placement.num_stages, sch.microbatches, sch.kinds
    st, en = sch.start, sch.end
    prev = np.full(len(st), -1)
    for r in range(inst.placement.num_ranks):
        ids = np.concatenate([np.arange(s * M * K, (s + 1) * M * K)
                              for s in inst.placement.stages_of(r)])
        ids = ids[np.lexsort((en[ids], st[ids]))]
        prev[ids[1:]] = ids[:-1]
    u, path = int(np.argmax(en)), []
    while u >= 0:
        path.append(u)
        s, rest = divmod(u, M * K)
        m, k = divmod(rest, K)
        cands = [] if prev[u] < 0 else [(int(en[prev[u]]), int(prev[u]))]
        if k == 0 and s > 0:
            cands.append((int(en[u - M * K] + inst.comm[s, m, 0]), u - M * K))
        if k >= 1:
            cands.append((int(en[u - 1]), u - 1))
        if k == 1 and s < S - 1:
            cands.append((int(en[u + M * K] + inst.comm[s, m, 1]), u + M * K))
        u = max(cands)[1] if cands else -1
    return path[::-1]


def path_summary(inst: Instance, sch: Schedule, path: list[int], least: int = 3
                 ) -> list[str]:
    """The critical path as runs on one rank (at least `least` tasks), in ms."""
    M, K = sch.microbatches, sch.kinds
    rank_of = inst.placement.rank_of
    runs: list[list] = []
    for u in path:
        s, rest = divmod(u, M * K)
        r, k = rank_of(s), rest % K
        if runs and runs[-1][0] == r:
            runs[-1][2] = int(sch.end[u])
            runs[-1][3] += "FBW"[k]
        else:
            runs.append([r, int(sch.start[u]), int(sch.end[u]), "FBW"[k]])
    out = []
    for r, a, b, kinds in runs:
        if len(kinds) >= least:
            out.append(f"rank {r}: {a * inst.unit_ms:.1f}-{b * inst.unit_ms:.1f} ms, "
                       f"{kinds.count('F')} F {kinds.count('B')} B {kinds.count('W')} W")
    short = sum(1 for x in runs if len(x[3]) < least)
    out.append(f"{short} shorter runs (the chain passing through a rank)")
    return out


def search(inst: Instance, groups: int, rounds: int) -> tuple[str, Schedule, list[str]]:
    """The best of the whole-pipeline rules, then per-rank coordinate descent from it."""
    tried = {(name, w): list_schedule(inst, rule, overtaking(inst, w))
             for name, rule in BASES.items() for w in OVERTAKE}
    name, w = min(tried, key=lambda k: tried[k].makespan)
    log = [f"{k}{', overtaking' if v else ''}: {s.makespan * inst.unit_ms:.1f} ms"
           for (k, v), s in tried.items()]
    prio, best = overtaking(inst, w), tried[(name, w)]
    how = name + (", overtaking" if w else "")
    predict = ready_times(inst, best)
    sch = best
    for i in range(PREDICTIONS):
        sch = list_schedule(inst, BASES[name], prio, ready_times(inst, sch))
        log.append(f"rerun {i + 1} reserving for the arrivals before: "
                   f"{sch.makespan * inst.unit_ms:.1f} ms")
        if sch.makespan < best.makespan:
            best, predict, how = sch, ready_times(inst, sch), how.split(";")[0] + "; predicted"
    rules, tuned = improve(inst, [BASES[name]] * inst.placement.num_ranks, candidates=CHANGES,
                           groups=groups, rounds=rounds, log=log, prio=prio, predict=predict)
    if tuned.makespan < best.makespan:
        best, how = tuned, how + "; per-rank descent"
    return how, best, log


def one_case(S: int, seed: int, jitter: str, budget: str, groups: int, rounds: int
             ) -> dict[str, Any]:
    M = 4 * S
    began = time.process_time()
    placement = Placement.linear(S)
    table = JitterModel(jitter, seed=seed, placement=placement, num_microbatches=M,
                        split_backward=True).table(0)
    base = make_hint("1f1b", num_stages=S, num_microbatches=M, split_backward=True)
    caps = tuple(resolve_caps(budget if budget.endswith("x") else int(budget), base))
    inst = instance(table, placement=placement, split_backward=True, caps=caps)
    ms = inst.table_ms()
    how, best, log = search(inst, groups, rounds)
    problems = check(inst, as_schedule(best))
    if problems:
        raise RuntimeError("clairvoyant schedule fails the checker: " + "; ".join(problems[:3]))
    path = path_summary(inst, best, critical_path(inst, best))
    return {"jitter": jitter, "budget": budget, "how": how, "log": log, "path": path,
            "step": best.makespan * inst.unit_ms, "lb": lower_bound_table(placement, ms, True),
            "in_order": in_order_bound(placement, ms, True),
            "memory": memory_bound(placement, ms, True, caps),
            "rank_in_order": in_order_rank_bound(ms, True), "ordered": in_order(best, S),
            "cpu_s": time.process_time() - began}


def _budget_text(budget: str) -> str:
    return "2(S - r) (2x per rank)" if budget == "2x" else f"{budget} on every rank"


def _one_jitter(args: argparse.Namespace, seed: int, jitter: str, lines: list[str],
                details: list[str]) -> None:
    """One table row per budget for (seed, jitter), and its details."""
    S = args.stages
    unsplit = simulate(stages=S, microbatches=4 * S, hint="1f1b", mode="strict",
                       jitter=jitter, seed=seed, split_backward=False).step_time
    goal = GOALS.get(jitter)
    for budget in args.budgets.split(","):
        d = one_case(S, seed, jitter, budget, args.groups, args.rounds)
        floor = max(d["memory"], d["lb"])
        ordered = max(floor, d["in_order"], d["rank_in_order"])
        lines.append(
            f"| {seed} | {jitter} | {_budget_text(budget)} | {unsplit:.1f} | "
            f"{'-' if goal is None else f'{unsplit / goal:.1f} ({goal:g}x)'} | "
            f"{d['lb']:.1f} | {d['memory']:.1f} | {d['in_order']:.1f} | "
            f"{d['rank_in_order']:.1f} | {unsplit / floor:.3f}x | {unsplit / ordered:.3f}x "
            f"| {d['step']:.1f} | {unsplit / d['step']:.3f}x | "
            f"{'yes' if d['ordered'] else 'no'} | {d['lb'] / d['step']:.3f}, "
            f"{d['in_order'] / d['step']:.3f}, {floor / d['step']:.3f} |")
        details += ["", f"### seed {seed}, {jitter}, {_budget_text(budget)}: {d['how']} "
                    f"(CPU {d['cpu_s']:.0f} s)", "", "Tried: " + "; ".join(d["log"]) + ".",
                    "", "Critical path of the clairvoyant schedule (runs of 3 or more "
                    "tasks on one rank):", "", *[f"- {x}" for x in d["path"]]]
        print(lines[-1], flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", default=None, help="a range A-B of seeds (one row each)")
    ap.add_argument("--jitters", default="lognormal:0.5,multimodal:0.3:3")
    ap.add_argument("--budgets", default="2x,256")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", default="clairvoyant")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.stages, args.groups, args.out = 32, 4, "clairvoyant_quick"
    S, began = args.stages, time.perf_counter()
    lo, _, hi = (args.seeds or str(args.seed)).partition("-")
    seeds = list(range(int(lo), int(hi or lo) + 1))
    lines = [f"S={S}, M={4 * S}, seeds {seeds[0]}-{seeds[-1]}, split backward, durations of "
             "bench.policy_large quantised to 0.01 ms. Times in ms. unsplit 1F1B: strict 1F1B "
             "with an unsplit backward (simulated; the issue's baseline); goal: the step the "
             "issue's goal asks for (baseline / goal). Bounds (no schedule is shorter): lower "
             "(telemetry.bounds, any schedule), memory (bench/step_bounds.py, any schedule "
             "within the budget), in-order and in-order rank (any schedule that runs each "
             "stage's forwards in microbatch order, any memory; the second is "
             "bench/step_bounds.py's). max ratio: the baseline over the larger of lower and "
             "memory, the most any schedule can reach. clairvoyant: the best valid schedule "
             "bench/clairvoyant_list.py found (checked by bench/optimum.py's check), in "
             "order: whether it keeps forwards in microbatch order; efficiency: lower, in-order "
             "and the larger of lower and memory, each over the clairvoyant step.", "",
             "| seed | jitter | budget | unsplit 1F1B | goal | lower | memory | in-order | "
             "in-order rank | max ratio | max ratio in order | clairvoyant | vs unsplit | in order "
             "| efficiency: lower, in-order, best bound |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    details: list[str] = []
    for seed in seeds:
        for jitter in args.jitters.split(","):
            _one_jitter(args, seed, jitter, lines, details)
    lines += details
    lines += ["", f"Running time {time.perf_counter() - began:.0f} s (one process)."]
    body = "\n".join(lines)
    print(body)
    write_result(args.out, body, shlex.join(["python", "-m", "bench.clairvoyant",
                                                    *sys.argv[1:]]))


if __name__ == "__main__":
    main()
