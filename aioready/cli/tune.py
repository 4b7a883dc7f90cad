"""`aioready tune`: the fastest schedule for the durations of a trace, within a budget, and the
table it was chosen from."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

__all__ = ["add_parser", "run", "command_line"]

EPILOG = """\
Every library hint valid for the trace's shape (stages, ranks, microbatches, split backward) is
simulated on the trace's durations with the real runtime on a virtual clock: strict at the
hint's own peak in-flight count, ready at 1x, 1.5x and 2x of it and at the whole budget on
every rank (the smallest factor that reaches it: the JSON's `factor`), each clipped to
--budget. The fastest whose peak in-flight fits the budget is printed with the command that
runs it.

budget: an integer, one per rank (comma-separated), or 'Nx' = N times the peak in-flight count
of the hint an auto pipeline starts from (1f1b on one chunk per rank; with --hint auto:<hint>,
that hint's); the default is 1x, what a pipeline without auto holds.

memory: activation bytes per rank instead of --budget (24GiB, 512MiB, a byte count, one per
rank comma-separated, or Nx = N times the start hint's own peak bytes), in the bytes of the
simulator's model (1 MiB per ms of a forward; see docs/policy.md "Memory budgets").

examples:
  aioready simulate --stages 4 --microbatches 8 --split-backward --jitter lognormal:0.5 \\
      --write-trace t.csv
  aioready tune --trace t.csv --budget 4x
  aioready tune --trace t.csv --hint auto:zbv --json out/tune.json
"""


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "tune", help="choose the fastest hint, mode and cap for a trace's durations",
        description="Simulate the candidate hints, modes and caps on the durations of a trace "
        "and print the table they rank in and the command line of the fastest within budget.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", type=Path, required=True, help="durations CSV (see simulate)")
    p.add_argument("--stages", type=int, default=None, help="check: the trace's stages S")
    p.add_argument("--microbatches", type=int, default=None,
                   help="check: the trace's microbatches per step M")
    p.add_argument("--budget", default=None, help="in-flight limit: N, N0,N1,... or Nx (default 1x: the start hint's peak)")
    p.add_argument("--memory", default=None,
                   help="activation bytes per rank instead of --budget: 24GiB, N0,N1,... or Nx")
    p.add_argument("--hint", default="auto",
                   help="auto (any placement for the trace's ranks) or auto:<hint> (its "
                   "placement)")
    p.add_argument("--modes", default="ready,strict", help="modes to try, comma-separated")
    p.add_argument("--json", type=Path, default=None, metavar="OUT",
                   help="write the rows and the choice here")
    p.set_defaults(func=run)


def command_line(choice: Any, trace: Any, path: Path) -> str:
    """The `aioready simulate` line that runs the choice (a rule on another placement than its
    own needs the library: make_hint(..., placement=...))."""
    from ..schedulers import HINTS
    parts = ["aioready simulate", f"--stages {trace.placement.num_stages}",
             f"--microbatches {trace.num_microbatches}", f"--trace {path}",
             f"--hint {choice.hint}", f"--mode {choice.mode}",
             *([f"--policy {choice.policy}"] if choice.mode == "ready" else []),
             f"--memory {','.join(str(m) for m in choice.memory)}" if choice.memory
             else f"--cap {','.join(str(c) for c in choice.cap)}"]
    if trace.split_backward:
        parts.append("--split-backward")
    line = " ".join(parts)
    if choice.memory and choice.mode == "ready" and any(
            c < trace.num_microbatches for c in choice.cap):
        line += (f"   # and at most {','.join(str(c) for c in choice.cap)} microbatches in "
                 "flight: Pipeline(memory=[memory.Budget(bytes=..., count=...), ...])")
    if choice.placement != HINTS[choice.hint].style:
        line += f"   # on the {choice.placement} placement: make_hint(..., placement=" \
                f"{choice.placement!r})"
    return line


def run(args: argparse.Namespace) -> int:
    from ..caps import parse_cap
    from ..memory import check_one_gate, parse_memory
    from ..sim.traces import read_trace
    from ..sim.tune import tune
    parse_cap(args.budget)
    parse_memory(args.memory)
    check_one_gate(args.budget, args.memory)
    trace = read_trace(args.trace)
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    tuning = tune(trace, hint=args.hint, stages=args.stages, microbatches=args.microbatches,
                  budget=args.budget, modes=modes, memory=args.memory)
    print(tuning.table())
    print(f"run it: {command_line(tuning.best.candidate.choice, trace, args.trace)}")
    if args.json:
        rows = [{"hint": r.candidate.choice.label, "mode": r.candidate.choice.mode,
                 "policy": r.candidate.choice.policy,
                 "factor": r.candidate.factor, "cap": list(r.candidate.choice.cap),
                 "memory": r.candidate.choice.memory and list(r.candidate.choice.memory),
                 "peak": list(r.peak), "stopped": r.stopped,
                 "step_time": r.step_time, "efficiency": r.efficiency,
                 "peak_in_flight": list(r.peak_in_flight), "fits": r.fits}
                for r in tuning.rows]
        body = {"time_unit": "ms", "trace": str(args.trace), "budget": args.budget,
                "memory": args.memory,
                "chosen": rows[tuning.rows.index(tuning.best)], "rows": rows}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(body, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0
