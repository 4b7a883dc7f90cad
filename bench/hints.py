"""Every hint under the simulated device with lognormal jitter: strict order vs readiness-first.

For each hint: S=8 stages, M=32 microbatches, per-stage base costs F=1, B=1, W=1 (split
backward) or F=1, B=2 (unsplit), each task multiplied by a mean-1 lognormal factor (sigma 0.5)
drawn from (seed, stage, microbatch, kind) so that strict and ready runs of one seed see the same
realized durations. Linear hints run on 8 ranks; two-chunk hints (interleaved, V) put the 8
stages on 4 ranks. Runs the real runtime (RankRuntime, ReadySet, in-process transport) on the
virtual clock, without compute. Reports the median step time over seeds in each mode, and each
mode's efficiency = lower bound / step time (median over seeds of the per-seed ratio).

Lower bound: aioready.telemetry.bounds.lower_bound (docs/architecture.md "Lower bound"). The
jitter model is local (a seeded mean-1 lognormal, the same law as sim/variability.py's
`lognormal:0.5` but other draws), so these figures stay comparable with earlier runs.

Run: python -m bench.hints [--quick]   (--quick: 5 seeds instead of 20)
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
from typing import Callable

from aioready.clock import run_virtual
from aioready.devices import SimDevice
from aioready.hints import HintOrder
from aioready.runtime.pipeline import Pipeline
from aioready.schedulers import HINTS, make_hint
from aioready.tasks import Kind
from aioready.telemetry.bounds import lower_bound

from .common import median, write_result

HINT_SET = [("gpipe", False), ("1f1b", False), ("1f1b", True), ("interleaved-1f1b", False),
            ("interleaved-zb", True), ("zb-h1", True), ("zb-h2", True), ("zbv", True),
            ("bf", False), ("bfw", True)]
SIGMA = 0.5

Duration = Callable[[int, int, Kind], float]


def jitter(seed: int, split: bool) -> Duration:
    """Realized duration of (stage, microbatch, kind): base cost times a mean-1 lognormal."""
    base = {Kind.F: 1.0, Kind.B: 1.0 if split else 2.0, Kind.W: 1.0}

    def duration(stage: int, mb: int, kind: Kind) -> float:
        z = random.Random(f"{seed}:{stage}:{mb}:{int(kind)}").gauss(0.0, 1.0)
        return base[kind] * math.exp(SIGMA * z - 0.5 * SIGMA * SIGMA)
    return duration


def step_time(hint: HintOrder, mode: str, dur: Duration) -> float:
    p = hint.placement

    async def main() -> float:
        pipe = Pipeline([None] * p.num_stages, None, microbatches=hint.num_microbatches,
                        hint=hint, mode=mode, split_backward=hint.split_backward,
                        device=SimDevice(lambda i: dur(i.stage, i.microbatch, i.kind),
                                         run_compute=False))
        await pipe.step()
        assert pipe.last_step is not None
        return pipe.last_step.step_time
    return run_virtual(main())


def run(S: int, M: int, seeds: int) -> list[list[str]]:
    rows = []
    for name, split in HINT_SET:
        hint = make_hint(name, num_stages=S, num_microbatches=M, split_backward=split)
        times: dict[str, list[float]] = {"strict": [], "ready": []}
        eff: dict[str, list[float]] = {"strict": [], "ready": []}
        for seed in range(seeds):
            dur = jitter(seed, split)
            bound = lower_bound(hint.placement, M, split, dur)
            for mode in ("strict", "ready"):
                t = step_time(hint, mode, dur)
                times[mode].append(t)
                eff[mode].append(bound / t)
        label = f"{name}{' (split)' if split and HINTS[name].needs_split is None else ''}"
        rows.append([label, str(hint.num_ranks), ",".join(map(str, hint.default_caps or ())),
                     f"{median(times['strict']):.2f}", f"{median(times['ready']):.2f}",
                     f"{median(times['strict']) / median(times['ready']):.3f}",
                     f"{median(eff['strict']):.3f}", f"{median(eff['ready']):.3f}",
                     f"{statistics.mean(t > 0 for t in times['ready']):.0%}"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="5 seeds instead of 20")
    args = ap.parse_args()
    S, M, seeds = 8, 32, 5 if args.quick else 20
    rows = run(S, M, seeds)
    head = ["hint", "ranks", "default caps", "strict median", "ready median",
            "strict/ready", "eff strict", "eff ready"]
    lines = [f"S={S} stages, M={M} microbatches, lognormal sigma={SIGMA} jitter (local, mean 1), "
             f"{seeds} seeds, default caps; lower bound: "
             + "aioready.telemetry.bounds.lower_bound.",
             "Step times in units of one unjittered F; efficiency = lower bound / step time "
             "(median of per-seed ratios).", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r[:8]) + " |" for r in rows]
    body = "\n".join(lines)
    print(body)
    write_result("hints", body, "python -m bench.hints" + (" --quick" if args.quick else ""))


if __name__ == "__main__":
    main()
