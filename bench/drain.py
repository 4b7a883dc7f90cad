"""Where a multimodal step loses its time under the cost orders (docs/policy_measurements.md
"The microbatch order"): the drain.

One simulated step (split backward, M = 4S, multimodal:0.3:3) of the hint auto most often
chooses at twice the memory (greedy zb-h2), in the given order and in each cost order of
schedulers/order.py, on the same durations. Per order: the step time, the efficiency (lower
bound / step time) and each rank's idle time split in three: before its first task (the fill),
after its last forward ends (the drain: only backward pieces are left, and they wait on the
microbatches still in the pipeline), and in between. With `--plot` the "ascending" and "middle"
timelines go to bench/results/drain.png, one above the other, and the "ascending" step to
drain.json (Perfetto); at S=32 they are megabytes, so the repository keeps only drain.md.

Run: python -m bench.drain [--stages 32] [--seed 0] [--budget 2S|2x] [--plot]
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from aioready.caps import resolve_caps
from aioready.schedulers import make_hint
from aioready.schedulers.order import ORDERS
from aioready.sim.simulator import simulate
from aioready.telemetry.export import write_chrome_trace
from aioready.telemetry.plots import plot_compare
from aioready.telemetry.spans import StepReport, merge_reports

from .common import RESULTS, step_reports, write_result

JITTER, HINT, POLICY = "multimodal:0.3:3", "zb-h2", "greedy"


def _run(S: int, seed: int, caps: list[int], order: str) -> tuple[Any, StepReport]:
    """One step and its merged report."""
    with step_reports() as reports:
        r = simulate(stages=S, microbatches=4 * S, hint=HINT, jitter=JITTER, seed=seed,
                     split_backward=True, policy=POLICY, cap=caps, order=order)
    return r, merge_reports(reports)


def idle_split(report: StepReport, num_ranks: int) -> tuple[float, float, float]:
    """Mean idle time per rank: before its first task, between, after its last forward."""
    start, end = report.start, report.end
    fill, middle, drain = [], [], []
    for rank in range(num_ranks):
        mine = [s for s in report.spans if s.rank == rank]
        last_f = max(s.end for s in mine if s.kind.name == "F")
        busy = sum(s.end - s.start for s in mine)
        busy_after = sum(s.end - max(s.start, last_f) for s in mine if s.end > last_f)
        fill.append(min(s.start for s in mine) - start)
        drain.append(end - last_f - busy_after)
        middle.append(end - start - busy - fill[-1] - drain[-1])
    return statistics.mean(fill), statistics.mean(middle), statistics.mean(drain)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget", choices=("2S", "2x"), default="2S",
                    help="2S on every rank, or 2x of strict 1F1B's peak on each rank")
    ap.add_argument("--plot", action="store_true", help="also drain.png and drain.json")
    args = ap.parse_args()
    S = args.stages
    caps = [2 * S] * S if args.budget == "2S" else list(resolve_caps("2x", make_hint(
        "1f1b", num_stages=S, num_microbatches=4 * S, split_backward=True)))
    lines = [f"S={S}, M={4 * S}, {JITTER}, seed {args.seed}, split backward, {HINT} ready "
             f"({POLICY}), caps {args.budget} ({caps[0]} on rank 0, {caps[-1]} on the last); "
             "idle: mean per rank, ms.", "",
             "| order | step ms | efficiency | idle before first task | idle between | "
             "idle after its last forward |", "|---|---|---|---|---|---|"]
    reports = []
    for order in ORDERS:
        r, rep = _run(S, args.seed, caps, order)
        reports.append(rep)
        fill, middle, drain = idle_split(rep, S)
        lines.append(f"| {order} | {r.step_time:.1f} | {r.efficiency:.3f} | {fill:.1f} | "
                     f"{middle:.1f} | {drain:.1f} |")
    if args.plot:
        shown = ("ascending", "middle")
        png = plot_compare([reports[ORDERS.index(o)] for o in shown], RESULTS / "drain.png",
                           labels=[f"{o} (seed {args.seed})" for o in shown],
                           clock_unit_s=1e-3)
        write_chrome_trace([reports[ORDERS.index("ascending")]], RESULTS / "drain.json",
                           clock_unit_s=1e-3)
        lines += ["", f"Timelines: {png.name}; the ascending step for Perfetto: drain.json "
                  "(not kept in the repository: megabytes at S=32)."]
    body = "\n".join(lines)
    print(body)
    command = (f"python -m bench.drain --stages {S} --seed {args.seed} --budget {args.budget}"
               + (" --plot" if args.plot else ""))
    write_result("drain", body, command)


if __name__ == "__main__":
    main()
