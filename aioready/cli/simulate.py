"""`aioready simulate`: run the real runtime on a virtual clock and report step time, bound,
efficiency; `--compare` runs both modes side by side."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..placement import Placement
from ..schedulers import hint_names
from ..schedulers.order import ORDERS

__all__ = ["add_parser", "run"]

EPILOG = """\
jitter specs (terms joined by '+'; durations in ms, base F=1, B=2 unsplit, B=1 W=1 split):
  none                               no jitter
  lognormal:SIGMA                    each task x a mean-1 lognormal factor
  multimodal:FRACTION:FACTOR[:NOISE] that fraction of microbatches costs FACTOR x everywhere
  straggler:RANK:FACTOR              one slow rank
  comm:MEAN_MS[:SIGMA]               a delay on every message

cap: an integer, one per rank (comma-separated), or 'Nx' = N times the hint's own peak
in-flight count (memory: each in-flight microbatch holds one microbatch of activations per chunk).

memory: bytes per rank instead of a count: 24GiB, 512MiB, 1.5GB, a byte count, one per rank
(8MiB,6MiB) or 'Nx' = N times the bytes the hint's own order holds at its peak. The simulator's
model: a microbatch holds 1 MiB per ms of its forward on a stage (docs/policy.md "Memory budgets").

examples:
  aioready simulate --stages 4 --microbatches 8 --hint 1f1b --mode strict
  aioready simulate --stages 8 --microbatches 32 --jitter lognormal:0.5 --seed 1 --compare
  aioready simulate --stages 8 --microbatches 32 --jitter multimodal:0.3:3+comm:0.1 \\
      --split-backward --cap 2x --compare --json out/sim.json
  aioready simulate --stages 16 --microbatches 64 --hint bfw --split-backward \
      --jitter multimodal:0.3:3 --seed 0 --cap 48 --compare
  aioready simulate --stages 4 --microbatches 8 --trace durations.csv --mode ready
  aioready simulate --stages 8 --microbatches 32 --jitter multimodal:0.3:3 --memory 2x --compare
  aioready simulate --stages 4 --microbatches 8 --jitter lognormal:0.5 --write-trace t.csv
  aioready simulate --stages 8 --microbatches 32 --split-backward --jitter lognormal:0.5 \
      --hint auto --cap 2x --compare
  aioready simulate --stages 8 --microbatches 32 --split-backward --jitter multimodal:0.3:3 \
      --hint zb-h2 --cap 2x --microbatch-order ascending
"""


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "simulate", help="simulate a pipeline step on a virtual clock",
        description="Run the real aioready runtime (ready set, arbiter, in-process transport) "
        "for every rank in one process on a virtual clock, with task durations from a seeded "
        "jitter model or a trace. Times are in ms. Prints step time, lower bound, efficiency.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, required=True, help="number of pipeline stages S")
    p.add_argument("--microbatches", type=int, required=True, help="microbatches per step M")
    p.add_argument("--hint", default="1f1b", help=f"one of {', '.join(hint_names())}, a file, "
                   "or auto (choose by simulating them, see 'aioready tune')")
    p.add_argument("--mode", default="ready", choices=("ready", "strict"))
    p.add_argument("--policy", default="reserve", choices=("reserve", "greedy", "light", "drain"),
                   help="ready mode's rule: reserve (default: keep the hint's next task's place, "
                   "backfill what ends in time), greedy (best-ranked ready task at once) or light "
                   "(greedy, but a clearly lighter microbatch's forward goes first)")
    p.add_argument("--jitter", default="none", help="jitter spec (see below)")
    p.add_argument("--seed", type=int, default=0, help="seed of the jitter model")
    p.add_argument("--cap", default=None, help="in-flight cap: N, N0,N1,... or Nx (see below)")
    p.add_argument("--memory", default=None,
                   help="activation bytes per rank instead of --cap (see below)")
    p.add_argument("--split-backward", action="store_true", help="separate B and W tasks")
    p.add_argument("--microbatch-order", default=None, choices=ORDERS,
                   help="run each step's microbatches as given or in a cost order of their "
                   "known sizes (default: given; with --hint auto every order is simulated "
                   "and the fastest kept)")
    p.add_argument("--steps", type=int, default=1, help="steps to simulate")
    p.add_argument("--trace", type=Path, default=None, help="replay durations from this CSV")
    p.add_argument("--write-trace", type=Path, default=None, metavar="FILE",
                   help="write the durations used as a trace CSV")
    p.add_argument("--json", type=Path, default=None, metavar="OUT", help="write results here")
    p.add_argument("--compare", action="store_true",
                   help="run strict and ready and print the speedup of ready")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..sim.simulator import simulate
    from ..sim.traces import read_trace, write_trace
    from ..sim.variability import JitterModel
    common = dict(stages=args.stages, microbatches=args.microbatches, hint=args.hint,
                  jitter=args.jitter, seed=args.seed, cap=args.cap, memory=args.memory,
                  split_backward=args.split_backward, steps=args.steps, policy=args.policy,
                  trace=read_trace(args.trace) if args.trace else None,
                  order=args.microbatch_order)
    modes = ("strict", "ready") if args.compare else (args.mode,)
    results = {mode: simulate(mode=mode, **_baseline(common, mode))  # type: ignore[arg-type]
               for mode in modes}
    for result in results.values():
        print(result.summary())
        if result.order != "given":
            print(f"microbatch order: {result.order} (by each microbatch's known size)")
        if result.tuning is not None:
            print(result.tuning.table())
    out: dict[str, object] = {m: r.as_dict() for m, r in results.items()}
    if args.compare:
        speedup = results["strict"].step_time / results["ready"].step_time
        print(f"speedup of ready over strict: {speedup:.3f}x")
        out["speedup"] = speedup
    if args.write_trace:
        source = common["trace"] or JitterModel(
            args.jitter, seed=args.seed, placement=_placement(args),
            num_microbatches=args.microbatches, split_backward=args.split_backward)
        args.write_trace.parent.mkdir(parents=True, exist_ok=True)
        write_trace(args.write_trace, source, steps=args.steps)
        print(f"wrote {args.write_trace}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        body = out if args.compare else out[args.mode]
        args.json.write_text(json.dumps(body, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def _start(hint: str, split_backward: bool) -> str:
    """The hint itself, or for auto the hint it starts from (placement, baseline)."""
    from ..runtime.autotune import parse_auto, start_hint
    auto = parse_auto(hint)
    return hint if auto is None else auto or start_hint("linear", split_backward)


def _baseline(common: dict[str, object], mode: str) -> dict[str, object]:
    """With --hint auto the mode is chosen; --compare's strict run is the start hint, strict,
    at its own cap."""
    hint = _start(str(common["hint"]), bool(common["split_backward"]))
    if mode != "strict" or hint == common["hint"]:
        return common
    return {**common, "hint": hint, "cap": None}


def _placement(args: argparse.Namespace) -> Placement:
    from ..schedulers import make_hint
    return make_hint(_start(args.hint, args.split_backward), num_stages=args.stages,
                     num_microbatches=args.microbatches,
                     split_backward=args.split_backward).placement
