"""Where the time goes at twice the memory on multimodal jitter (docs/policy_measurements.md).

One simulated step of greedy bfw, split backward, M = 4S, with 2S on every rank: per rank, the
busy time and the idle time split into "something was ready" (only entry forwards held back by
the cap can be) and "nothing was ready", read from the spans (a span records when its task
became ready); the last rank's first idle stretch; then the same step with 3S on the first
ranks only; and the lower bound over the in-order bound (telemetry.bounds) over seeds.

Run: python -m bench.convoy [--stages 16] [--seed 0]
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from aioready.placement import Placement
from aioready.sim.simulator import simulate
from aioready.sim.variability import JitterModel
from aioready.telemetry.bounds import in_order_bound, lower_bound_table

from .common import step_reports

JITTER = "multimodal:0.3:3"


def _spans(S: int, seed: int, caps: list[int], jitter: str = JITTER) -> tuple[Any, list[Any]]:
    """One step and its spans."""
    with step_reports() as reports:
        r = simulate(stages=S, microbatches=4 * S, hint="bfw", jitter=jitter, seed=seed,
                     split_backward=True, policy="greedy", cap=caps)
    return r, [s for rep in reports for s in rep.spans]


def idle(spans: list[Any], rank: int, start: float, end: float) -> tuple[float, float, float]:
    """(busy, idle with a task ready, idle with none) of one rank."""
    mine = sorted((s for s in spans if s.rank == rank), key=lambda s: s.start)
    gaps, t = [], start
    for s in mine:
        if s.start > t:
            gaps.append((t, s.start))
        t = max(t, s.end)
    gaps.append((t, end))
    waiting = 0.0
    for a, b in gaps:
        cur = a
        for lo, hi in sorted((max(a, s.ready), min(b, s.start)) for s in mine
                             if s.ready < b and s.start > a):
            lo = max(lo, cur)
            if hi > lo:
                waiting, cur = waiting + hi - lo, hi
    total_idle = sum(b - a for a, b in gaps)
    return sum(s.end - s.start for s in mine), waiting, total_idle - waiting


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    S, seed = args.stages, args.seed
    r, spans = _spans(S, seed, [2 * S] * S)
    start, end = min(s.start for s in spans), max(s.end for s in spans)
    print(f"S={S}, M={4 * S}, {JITTER}, seed {seed}, greedy bfw, 2S on every rank: step "
          f"{r.step_time:.1f} ms, efficiency {r.efficiency:.3f}")
    for rank in range(S):
        busy, ready, none = idle(spans, rank, start, end)
        print(f"  rank {rank:3d}: busy {busy:6.1f}  idle with a task ready {ready:5.1f}  "
              f"idle with none {none:5.1f}")
    last = sorted((s for s in spans if s.rank == S - 1), key=lambda s: s.start)
    gap = max((b.start - a.end, a.label, b.label) for a, b in zip(last, last[1:]))
    print(f"  last rank's longest idle stretch: {gap[0]:.1f} ms, after {gap[1]} before {gap[2]}")
    for name, caps in (("3S on rank 0", [3 * S] + [2 * S] * (S - 1)),
                       ("3S on ranks 0-3", [3 * S] * 4 + [2 * S] * (S - 4)),
                       ("3S on every rank", [3 * S] * S)):
        print(f"{name}: efficiency {_spans(S, seed, caps)[0].efficiency:.3f}")
    for jitter in ("lognormal:0.5", JITTER):
        ratios = []
        for s in range(10):
            table = JitterModel(jitter, seed=s, placement=Placement.linear(S),
                                num_microbatches=4 * S, split_backward=True).table(0)
            place = Placement.linear(S)
            ratios.append(lower_bound_table(place, table, True) / in_order_bound(place, table,
                                                                                 True))
        print(f"lower bound / in-order bound, {jitter}, seeds 0-9: median "
              f"{statistics.median(ratios):.3f}, worst {min(ratios):.3f}")


if __name__ == "__main__":
    main()
