"""Where unsplit auto loses at twice the bytes (docs/policy_measurements.md "Auto at twice the
bytes").

One simulated step (M = 4S, multimodal:0.3:3, unsplit by default) of what `hint="auto"` chooses
within `memory="2x"` (twice strict 1F1B's peak activation bytes per rank, sim/budget.py), and,
on the same durations, what it chooses within `cap="2x"` (twice 1F1B's peak count). Per choice:
step time, efficiency (lower bound / step time), peak bytes on each rank against the byte
budget, and per rank the busy time and the idle time split into "a task was ready" (held back by
the gate, or by the reservation) and "nothing was ready" (bench/convoy.py's split). For rank 0
the longest idle gaps, with what it held when each began (microbatches in flight, bytes, the
budget), read back from the spans (a microbatch holds its F's bytes from that F's end to its
last backward piece's end, the model of sim/memory.py). With `--plot`, both timelines go to
bench/results/bytes_gap.png (not kept: large at S=32).

Run: python -m bench.bytes_gap [--stages 32] [--seed 4] [--split] [--plot]
"""

from __future__ import annotations

import argparse
from typing import Any

from aioready.sim.budget import gated
from aioready.sim.memory import BYTES_PER_MS
from aioready.sim.simulator import simulate
from aioready.tasks import Kind
from aioready.telemetry.plots import plot_compare
from aioready.telemetry.spans import StepReport, merge_reports

from .common import RESULTS, step_reports, write_result
from .convoy import idle

JITTER = "multimodal:0.3:3"


def _chosen(S: int, seed: int, split: bool, gate: dict[str, Any]) -> tuple[Any, Any, StepReport]:
    """auto's choice within `gate`, and its step simulated again for the spans."""
    tuned = simulate(stages=S, microbatches=4 * S, hint="auto", jitter=JITTER, seed=seed,
                     split_backward=split, **gate)
    best = tuned.tuning.best
    c = best.candidate.choice
    with step_reports() as reports:
        simulate(stages=S, microbatches=4 * S, hint=c.hint, mode=c.mode, policy=c.policy,
                 jitter=JITTER, seed=seed, split_backward=split, order=best.candidate.order,
                 **gated(c.cap, c.memory))
    return tuned, best, merge_reports(reports)


def held_at(report: StepReport, rank: int, at: float, split: bool) -> tuple[int, float]:
    """(microbatches in flight, activation bytes held) on `rank` at time `at`."""
    last = Kind.W if split else Kind.B
    mine = [s for s in report.spans if s.rank == rank]
    entry = min(s.stage for s in mine)
    ends = {(s.microbatch, s.stage): s.end for s in mine if s.kind is last}
    count = sum(1 for s in mine if s.kind is Kind.F and s.stage == entry and s.start <= at
                < ends.get((s.microbatch, s.stage), float("inf")))
    held = sum((s.end - s.start) * BYTES_PER_MS for s in mine if s.kind is Kind.F
               and s.end <= at < ends.get((s.microbatch, s.stage), float("inf")))
    return count, held


def gaps(report: StepReport, rank: int) -> list[tuple[float, float]]:
    mine = sorted((s for s in report.spans if s.rank == rank), key=lambda s: s.start)
    out, t = [], report.start
    for s in mine:
        if s.start > t:
            out.append((t, s.start))
        t = max(t, s.end)
    if report.end > t:
        out.append((t, report.end))
    return out


def describe(label: str, S: int, split: bool, tuned: Any, best: Any, report: StepReport,
             limit: list[float] | None) -> list[str]:
    c = best.candidate.choice
    mib = 2**20
    peaks = tuned.peak_activation_bytes
    lines = [f"**{label}**: chose {tuned.hint} ({c.mode}, {c.policy}), step "
             f"{tuned.step_time:.1f} ms, efficiency {tuned.efficiency:.3f}; peak MiB on ranks "
             f"0, 1, S/2, S-1: " + ", ".join(f"{peaks[r] / mib:.1f}" for r in
                                             (0, 1, S // 2, S - 1))
             + ("" if limit is None else " (byte budget " + ", ".join(
                 f"{limit[r] / mib:.1f}" for r in (0, 1, S // 2, S - 1)) + ")"), "",
             "| rank | busy ms | idle, a task ready | idle, nothing ready |", "|---|---|---|---|"]
    for rank in sorted({0, 1, 2, S // 4, S // 2, S - 1}):
        busy, ready, none = idle(report.spans, rank, report.start, report.end)
        lines.append(f"| {rank} | {busy:.1f} | {ready:.1f} | {none:.1f} |")
    lines += ["", "Rank 0's five longest idle gaps: when (ms from the step's start), how long, "
              "and what it held as each began.", "",
              "| begins | ms | in flight | MiB held | MiB budget |", "|---|---|---|---|---|"]
    for a, b in sorted(gaps(report, 0), key=lambda g: g[0] - g[1])[:5]:
        count, held = held_at(report, 0, a, split)
        lines.append(f"| {a - report.start:.1f} | {b - a:.1f} | {count} | {held / mib:.1f} | "
                     + ("-" if limit is None else f"{limit[0] / mib:.1f}") + " |")
    return lines + [""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=32)
    ap.add_argument("--seed", type=int, default=4)
    ap.add_argument("--split", action="store_true", help="split backward (default unsplit)")
    ap.add_argument("--plot", action="store_true", help="also bytes_gap.png")
    args = ap.parse_args()
    S, split = args.stages, args.split
    lines = [f"S={S}, M={4 * S}, {JITTER}, seed {args.seed}, "
             f"{'split' if split else 'unsplit'} backward, one step.", ""]
    shown = []
    for label, gate in (("memory=\"2x\"", {"memory": "2x"}), ("cap=\"2x\"", {"cap": "2x"})):
        tuned, best, report = _chosen(S, args.seed, split, gate)
        limit = list(tuned.tuning.limit) if tuned.tuning.in_bytes else None
        lines += describe(label, S, split, tuned, best, report, limit)
        shown.append((report, f"{label}: {tuned.hint}"))
    if args.plot:
        png = plot_compare([r for r, _ in shown], RESULTS / "bytes_gap.png",
                           labels=[lab for _, lab in shown], clock_unit_s=1e-3)
        lines.append(f"Timelines: {png.name} (not kept in the repository).")
    body = "\n".join(lines)
    print(body)
    write_result("bytes_gap", body, f"python -m bench.bytes_gap --stages {S} --seed "
                 f"{args.seed}" + (" --split" if split else "") + (" --plot" if args.plot else ""))


if __name__ == "__main__":
    main()
