"""`aioready advise RUN`: what to change in a recorded run, each option simulated on its
durations (aioready/sim/advise.py), ranked, charted, and the one change advised."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

__all__ = ["add_parser", "run", "read_recording"]

EPILOG = """\
RUN is what a run recorded: the span CSV or Parquet (aioready train --csv, or
telemetry.export.write_parquet), a Chrome trace (--chrome-trace), or the --json summary of
aioready train, which also carries the hint, mode, policy, cap and layers per stage. With the
other forms, say them with the options below (defaults: 1f1b ready reserve at the hint's peak).

Every option is the real runtime replayed on the recorded durations on a virtual clock:
other hints, modes and policies; memory budgets of 1x, 1.5x and 2x the current caps; M/2 and
2M microbatches (per-microbatch durations averaged and scaled by M/M'); moving k layers between
neighbouring stages (a stage's per-layer cost = its task durations / its layers; needs
--layers-per-stage or a summary); halving the message latency seen in the spans.

examples:
  aioready train --steps 4 --json out/run.json && aioready advise out/run.json --png out/a.png
  aioready advise out/spans.csv --hint zb-h1 --cap 2x --layers-per-stage 4,4,4,4
"""


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "advise", help="rank the changes that would shorten a recorded run's step",
        description="Simulate changes of hint, memory budget, microbatch count, layer split "
        "and message latency on a recorded run's durations; print them ranked and the one "
        "change to make, with its command line.", epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_file", type=Path, metavar="RUN",
                   help="span CSV/Parquet, Chrome trace, or train --json summary")
    p.add_argument("--hint", default=None, help="the run's hint (default: the summary's, else "
                   "1f1b)")
    p.add_argument("--mode", choices=("ready", "strict"), default=None)
    p.add_argument("--policy", choices=("reserve", "greedy", "light", "drain"),
                   default=None)
    p.add_argument("--cap", default=None, help="the run's cap: N, N0,N1,... or Nx")
    p.add_argument("--layers-per-stage", default=None, metavar="N[,N...]",
                   help="layers each stage holds (one number: every stage)")
    p.add_argument("--steps", type=int, default=4, help="replay the last N recorded steps")
    p.add_argument("--unit-ms", type=float, default=None,
                   help="ms per unit of the file's clock (default: 1000 for CSV/Parquet/"
                   "Chrome, whose times are seconds)")
    p.add_argument("--json", type=Path, default=None, metavar="OUT", help="write every option")
    p.add_argument("--png", type=Path, default=None, metavar="OUT", help="write the chart")
    p.set_defaults(func=run)


def _summary(path: Path) -> dict[str, Any] | None:
    """The train --json summary in `path`, or None when it is another JSON (a Chrome trace)."""
    from ..errors import TraceError
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise TraceError(f"cannot read {path}", expected="a JSON file", got=str(exc)) from None
    if isinstance(data, dict) and "traceEvents" not in data:
        if "spans" not in data:
            raise TraceError(f"{path}: a summary without spans", expected="the --json of "
                             "aioready train from this version (it carries 'spans')",
                             got=f"keys {sorted(data)[:8]}",
                             fix="rerun aioready train --json, or pass its --csv")
        return data
    return None


def read_recording(path: Path, **given: Any) -> Any:
    """A sim.advise.Recording of the file; `given` settings (not None) win over the file's."""
    from ..sim.advise import Recording
    from ..telemetry.export import read_reports, reports_from_table
    settings: dict[str, Any] = {}
    summary = _summary(path) if path.suffix.lower() == ".json" else None
    if summary is not None:
        reports, unit = reports_from_table(summary["spans"]), 1.0
        settings = {k: summary.get(k) for k in ("hint", "mode", "policy", "cap")
                    if summary.get(k) is not None}
        lps = summary.get("layers_per_stage")
        if lps is not None:
            settings["layers_per_stage"] = (lps,) * int(summary["stages"])
    else:
        reports, unit = read_reports(path), 1000.0
    if given.get("unit_ms") is not None:
        unit = given.pop("unit_ms")
    given.pop("unit_ms", None)
    settings.update({k: v for k, v in given.items() if v is not None})
    return Recording(tuple(reports), unit_ms=unit, source=str(path), **settings)


def _layers(text: str | None, stages: int) -> tuple[int, ...] | None:
    from ..errors import ConfigError
    if text is None:
        return None
    try:
        counts = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ConfigError("--layers-per-stage", expected="N or N0,N1,...", got=text) from None
    return counts * stages if len(counts) == 1 else counts


def run(args: argparse.Namespace) -> int:
    from ..caps import parse_cap
    from ..sim.advise import advise, plot_advice
    rec = read_recording(args.run_file, hint=args.hint, mode=args.mode, policy=args.policy,
                         cap=parse_cap(args.cap), unit_ms=args.unit_ms)
    stages = 1 + max(s.stage for r in rec.reports for s in r.spans)
    layers = _layers(args.layers_per_stage, stages)
    if layers is not None:
        from dataclasses import replace
        rec = replace(rec, layers_per_stage=layers)
    advice = advise(rec, steps=args.steps)
    print(advice.table())
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(advice.as_dict(), indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.png:
        print(f"wrote {plot_advice(advice, args.png)}")
    return 0
