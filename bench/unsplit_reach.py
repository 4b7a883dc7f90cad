"""What is reachable with an unsplit backward at S=32 (M=128): the policy's gap or the bound's?

`hint="auto"` with an unsplit backward within twice 1F1B's memory per rank reads 0.814
(lognormal:0.5) and 0.894 (multimodal:0.3:3) of the lower bound at S=32 (bench/results/
policy.md), against the issue's 0.93 and 0.90. Per jitter, seed and budget this computes, on
the same durations (JitterModel(..., split_backward=False).table(0), quantised to 0.01 ms as
bench/optimum.py does):

  lower       telemetry.bounds.lower_bound_table (any schedule, any memory)
  memory      bench/step_bounds.memory_bound (any schedule within the budget's caps)
  in-order    bench/step_bounds.in_order_rank_bound (forwards in microbatch order, any memory),
              in the given order and, where the durations carry sizes, in auto's middle order
  clairvoyant the best valid schedule bench/clairvoyant_list.py finds (bench.clairvoyant.search,
              checked by bench/optimum.py's check), on the given order and on the middle order
  tail-first  the clairvoyant list schedule with a critical-path ranking (`tail_first`), given
              order
  auto        simulate(hint="auto", cap=budget) on the same durations, in hindsight

Budgets: "2x" is auto's (twice strict 1F1B's peak on each rank: 2(S - r)); "64" is 2S on every
rank. Efficiency is lower / step time, as bench.policy reads it.

Run: python -m bench.unsplit_reach [--stages 32] [--seeds 0-4] [--jitters a,b]
     [--budgets 2x,64] [--groups 4] [--no-auto] [--opt-time S] [--out unsplit_reach] [--quick]
(about 13 minutes of CPU at the defaults; --quick: S=8, seed 0, seconds)
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from typing import Any

import numpy as np

from aioready.caps import resolve_caps
from aioready.placement import Placement
from aioready.schedulers import make_hint
from aioready.schedulers.order import cost_order
from aioready.sim.simulator import simulate
from aioready.sim.variability import JitterModel
from aioready.telemetry.bounds import lower_bound_table

from .clairvoyant import search
from .clairvoyant_list import Rule, Schedule, as_schedule, list_schedule
from .common import RESULTS, write_result
from .optimum import Instance, check, instance, solve
from .step_bounds import in_order_rank_bound, memory_bound


def _seeds(text: str) -> list[int]:
    lo, _, hi = text.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


def tail_first(inst: Instance) -> Schedule:
    """The shortest of the clairvoyant list schedules that rank tasks by their tail (the work
    left on their microbatch's chain after them: the issue's critical-path-aware ranking, with
    every duration known), alone or plus half a mean task per microbatch index, under each
    class order; checked by bench/optimum.py's check."""
    d = inst.durations.astype(float)
    F, B = d[:, :, 0], d[:, :, 1]
    K = 3 if inst.split_backward else 2
    W = d[:, :, 2] if K == 3 else np.zeros_like(F)
    tails = np.stack([F.sum(0) - np.cumsum(F, axis=0) + B.sum(0) + W[0],
                      np.cumsum(B, axis=0) - B + W[0], np.zeros_like(F)], axis=-1)[:, :, :K]
    index = np.arange(inst.num_microbatches, dtype=float)[None, :, None]
    best = None
    for prio in (-tails, -tails / (2 * d[:, :, :K].mean()) + index):
        for order in ("BFAW", "FBAW", "ABFW", "BAFW"):
            sch = list_schedule(inst, Rule(order=order), prio.reshape(-1))
            if best is None or sch.makespan < best.makespan:
                best = sch
    assert best is not None and not check(inst, as_schedule(best))
    return best


def one_case(S: int, seed: int, jitter: str, budget: str, groups: int, auto: bool,
             opt_time: float = 0.0) -> dict[str, Any]:
    """Bounds, clairvoyant schedules and auto's step on one (seed, jitter, budget)."""
    M, began = 4 * S, time.process_time()
    pl = Placement.linear(S)
    model = JitterModel(jitter, seed=seed, placement=pl, num_microbatches=M,
                        split_backward=False)
    base = make_hint("1f1b", num_stages=S, num_microbatches=M, split_backward=False)
    caps = tuple(resolve_caps(budget if budget.endswith("x") else int(budget), base))
    orders = {"given": tuple(range(M))}
    sizes = model.sizes(0)
    if sizes is not None:
        orders["middle"] = cost_order(list(sizes), "middle", S, False)
    out: dict[str, Any] = {"jitter": jitter, "seed": seed, "budget": budget, "caps": caps}
    for name, perm in orders.items():
        inst = instance(model.table(0)[:, list(perm), :], placement=pl, split_backward=False,
                        caps=caps)
        ms = inst.table_ms()
        if name == "given":
            out["lb"] = lower_bound_table(pl, ms, False)
            out["memory"] = memory_bound(pl, ms, False, caps)
            out["tail_first"] = tail_first(inst).makespan * inst.unit_ms
        out[f"in_order_{name}"] = in_order_rank_bound(ms, False)
        how, best, _ = search(inst, groups, 1)
        problems = check(inst, as_schedule(best))
        if problems:
            raise RuntimeError("clairvoyant schedule fails the checker: " + "; ".join(problems))
        out[f"clair_{name}"] = best.makespan * inst.unit_ms
        out[f"clair_{name}_how"] = how
        if opt_time > 0:  # CP-SAT from the clairvoyant schedule: the optimum lies between
            opt = solve(inst, time_limit_s=opt_time, start_from=[as_schedule(best)])
            out[f"opt_{name}"] = opt.objective * inst.unit_ms
            out[f"opt_bound_{name}"] = opt.bound * inst.unit_ms
            out[f"opt_{name}_status"] = opt.status
    if auto:
        r = simulate(stages=S, microbatches=M, hint="auto", jitter=jitter, seed=seed,
                     split_backward=False, cap=budget if budget.endswith("x") else int(budget))
        best = r.tuning.best.candidate.choice
        out["auto"], out["auto_chosen"] = r.step_time, f"{r.hint} {best.how}"
        out["auto_peak"] = max(r.peak_in_flight)
    out["cpu_s"] = time.process_time() - began
    return out


def table(rows: list[dict[str, Any]]) -> list[str]:
    """One line per case: bounds and schedules as efficiencies (lower bound / step)."""
    lines = ["| jitter | budget | seed | memory | in-order given | in-order middle | "
             "clairvoyant given | clairvoyant middle | tail-first | auto | auto's choice | "
             "CP-SAT best, proven (given; middle) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def eff(d: dict[str, Any], key: str) -> str:
        return f"{d['lb'] / d[key]:.3f}" if key in d else "-"
    for d in rows:
        lines.append(f"| {d['jitter']} | {d['budget']} | {d['seed']} | {eff(d, 'memory')} | "
                     f"{eff(d, 'in_order_given')} | {eff(d, 'in_order_middle')} | "
                     f"{eff(d, 'clair_given')} | {eff(d, 'clair_middle')} | "
                     f"{eff(d, 'tail_first')} | {eff(d, 'auto')} | "
                     f"{d.get('auto_chosen', '-')} | {_opt(d, eff)} |")
    return lines


def _opt(d: dict[str, Any], eff: Any) -> str:
    return "; ".join(f"{eff(d, 'opt_' + n)}, {eff(d, 'opt_bound_' + n)} "
                     f"{d['opt_' + n + '_status']}"
                     for n in ("given", "middle") if f"opt_{n}" in d) or "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=32)
    ap.add_argument("--seeds", default="0-4")
    ap.add_argument("--jitters", default="lognormal:0.5,multimodal:0.3:3")
    ap.add_argument("--budgets", default="2x,64")
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--no-auto", action="store_true")
    ap.add_argument("--opt-time", type=float, default=0.0,
                    help="CP-SAT seconds per instance and order (0: none; small S only)")
    ap.add_argument("--out", default="unsplit_reach")
    ap.add_argument("--quick", action="store_true",
                    help="S=8, seed 0, into unsplit_reach_quick (seconds)")
    args = ap.parse_args()
    if args.quick:
        args.stages, args.seeds, args.out = 8, "0", "unsplit_reach_quick"
    began = time.perf_counter()
    rows = []
    for jitter in args.jitters.split(","):
        for budget in args.budgets.split(","):
            for seed in _seeds(args.seeds):
                rows.append(one_case(args.stages, seed, jitter, budget, args.groups,
                                     not args.no_auto, args.opt_time))
                print(table(rows[-1:])[-1], f"{rows[-1]['cpu_s']:.0f} s", flush=True)
    body = "\n".join([
        f"S={args.stages}, M={4 * args.stages}, unsplit backward, one step per seed, durations "
        "quantised to 0.01 ms. Each figure is the lower bound (telemetry.bounds) over a step "
        "time: for a bound (memory, in-order) the most any schedule of its class can reach; "
        "for a schedule (clairvoyant, auto) its efficiency. Budget 2x: 2(S - r) on rank r "
        "(auto's unsplit budget); a number: that many on every rank. middle: the microbatch "
        "order auto's middle candidates run (schedulers/order.py), where the durations carry "
        "sizes.", "", *table(rows), "",
        f"Running time {time.perf_counter() - began:.0f} s (one process)."])
    print(body)
    write_result(args.out, body, shlex.join(["python", "-m", "bench.unsplit_reach",
                                             *sys.argv[1:]]))
    (RESULTS / f"{args.out}.json").write_text(json.dumps(rows, indent=1, default=_plain))


def _plain(x: object) -> object:
    return x.tolist() if isinstance(x, np.ndarray) else str(x)


if __name__ == "__main__":
    main()
