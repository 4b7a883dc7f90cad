"""The default of `aioready train` at equal memory, in the simulator: what it chooses under its
activation budget, against ZBV strict (torch's ZBVZeroBubble's twin) and against the in-flight
count budget it had before, on the durations of one bench/e2e_scale cell.

The cell's trace is generated again from its configuration (bench/e2e.generate_trace is seeded,
so it is the same trace the measured run replayed); the simulator replays it load-free, so the
table is deterministic. Peaks are (chunk, microbatch) activations held on the busiest rank,
shown as linear-stage microbatches (half a V stage's count), the unit of the e2e pages' 'peak
act' column.

    python -m bench.default_budget    # S=16, multimodal:0.3:3, seed 0 (e2e_scale_quiet16)

writes bench/results/default_budget.md (not with --quick).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from aioready.placement import Placement
from aioready.runtime.autotune import AutoHint
from aioready.schedulers import make_hint
from aioready.sim.simulator import simulate
from aioready.sim.traces import Trace, read_trace

from .common import write_result
from .e2e import generate_trace
from .e2e_worker import RunShape, default_start, stage_seconds

__all__ = ["rows", "main"]


def rows(*, spec: str, ranks: int, seed: int, task_ms: float, warmup: int, steps: int
         ) -> tuple[Any, list[tuple[str, float, float, str]]]:
    """(the start, [(row, median simulated step ms, peak held in linear-stage microbatches,
    what it chose)]) over the measured steps of the cell."""
    groups, M = 2 * ranks, 4 * ranks
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.csv"
        generate_trace(spec, seed=seed, groups=groups, microbatches=M, steps=warmup + steps,
                       task_ms=task_ms, path=path)
        trace = read_trace(path, placement=Placement(groups, groups, "linear"))
    start = default_start(groups, ranks, M, trace, None)

    def sim(style: str, split: bool, **how: Any) -> tuple[float, float, str]:
        shape = RunShape(Placement(2 * ranks, ranks, style), groups, split)
        tables = np.stack([stage_seconds(trace.table(warmup + i), shape, None) * 1e3
                           for i in range(steps)])
        result = simulate(stages=2 * ranks, ranks=ranks, microbatches=M, split_backward=split,
                          steps=steps, trace=Trace(tables, placement=shape.placement,
                                                   split_backward=split, source=spec), **how)
        chose = (f"{result.hint} {result.mode}"
                 + (f" {result.policy}" if result.mode == "ready" else "")
                 + f" caps {max(result.cap)}")
        return (statistics.median(s.step_time for s in result.per_step),
                max(result.peak_held) / 2, chose)

    style, split = start.choice.placement, start.split_backward
    begin = make_hint(start.choice.hint, num_stages=2 * ranks, num_ranks=ranks,
                      num_microbatches=M, split_backward=split, placement=style)
    count = 2 * min(ranks, M)  # the in-flight count budget of the default before
    out = [("default (activations <= ZBV's)",
            *sim(style, split, hint=AutoHint(start=begin), activations=start.budget)),
           ("zbv strict (ZBVZeroBubble's twin)", *sim("v", True, hint="zbv", mode="strict")),
           (f"the default before (in flight <= {count})",
            *sim(style, split, hint=AutoHint(start=begin), cap=count))]
    return start, out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.default_budget", description=__doc__)
    ap.add_argument("--spec", default="multimodal:0.3:3")
    ap.add_argument("--ranks", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--task-ms", type=float, default=10.0)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="S=4 (the table of make test's size)")
    args = ap.parse_args(argv)
    ranks = 4 if args.quick else args.ranks
    start, table = rows(spec=args.spec, ranks=ranks, seed=args.seed, task_ms=args.task_ms,
                        warmup=args.warmup, steps=args.steps)
    body = [f"S={ranks}, M={4 * ranks}, `{args.spec}`, seed {args.seed}, F = B = W = "
            f"{args.task_ms / 2:g} ms per layer group, measured steps {args.warmup}.."
            f"{args.warmup + args.steps - 1} of the trace: the default starts from "
            f"{start.label} (simulated on step 0); its budget is {start.budget} (chunk, "
            f"microbatch) activations per rank, {start.budget / 2:g} linear-stage microbatches.",
            "", "| configuration | simulated step ms (median) | peak held, busiest rank "
            "(linear-stage mb) | chose |", "|---|---|---|---|"]
    body += [f"| {name} | {ms:.0f} | {peak:g} | {chose} |" for name, ms, peak, chose in table]
    text = "\n".join(body)
    print(text)
    if not args.quick:
        write_result("default_budget", text, "python -m bench.default_budget")


if __name__ == "__main__":
    main()
