"""`aioready plot`: draw a step's timeline PNG from a Chrome trace JSON or a span CSV."""

from __future__ import annotations

import argparse
import sys

from ..errors import ConfigError
from ..telemetry.spans import StepReport

__all__ = ["add_parser", "run"]

EXAMPLES = """examples:
  aioready train --chrome-trace out/run.json --steps 3 && aioready plot out/run.json -o out/run.png
  aioready plot out/spans.csv -o out/step0.png --step 0
  aioready plot out/strict.json --compare out/ready.json -o out/compare.png
"""


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "plot", help="draw a timeline PNG from a trace",
        description="Draw one step of a recorded run as a PNG timeline: ranks as rows, F/B/W "
        "boxes with microbatch numbers, idle time hatched. Reads the Chrome trace JSON or the "
        "span CSV that 'aioready train' writes. With --compare, draws two runs (e.g. strict "
        "and ready) one above the other.", epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", metavar="TRACE", help="a .json Chrome trace or a .csv span file")
    p.add_argument("-o", "--output", required=True, metavar="PNG", help="where to write")
    p.add_argument("--step", type=int, default=None, help="which step (default: the last)")
    p.add_argument("--compare", metavar="TRACE2", default=None,
                   help="a second trace of the same step, drawn below")
    p.add_argument("--labels", default=None, metavar="A,B",
                   help="titles of the two timelines with --compare (default: file names)")
    p.set_defaults(func=run)


def _pick(path: str, step: int | None) -> StepReport:
    from ..telemetry.export import read_reports
    reports = read_reports(path)
    if step is None:
        return reports[-1]
    for r in reports:
        if r.step == step:
            return r
    raise ConfigError(f"no step {step} in {path}", expected=[r.step for r in reports], got=step)


def run(args: argparse.Namespace) -> int:
    from ..telemetry.plots import plot_compare, plot_timeline
    report = _pick(args.trace, args.step)
    if args.compare is None:
        path = plot_timeline(report, args.output)
    else:
        labels = (args.labels.split(",") if args.labels
                  else [args.trace.rsplit("/", 1)[-1], args.compare.rsplit("/", 1)[-1]])
        if len(labels) != 2:
            raise ConfigError("--labels takes two names", expected="A,B", got=args.labels)
        path = plot_compare([report, _pick(args.compare, args.step)], args.output, labels)
    print(f"wrote {path}", file=sys.stderr)
    return 0
