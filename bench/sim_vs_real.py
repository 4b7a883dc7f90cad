"""How closely the simulator predicts a real run of the same durations.

The simulator runs the real runtime on a virtual clock; a real run of the same trace (the sim
device sleeping each task's duration on a real loop, in-process, no compute) adds only what the
machine costs: timer lateness, the loop's own work per task and message. For each hint, mode and
seed this runs both on one duration trace (S=4, M=8, lognormal:0.15 around F=15 ms, B=27 ms
unsplit, or F=B=W=15 ms split) and reports real / simulated step time: the median over seeds and
its range. 1.00 means the simulator's step time is what the machine delivered. Tests only check
what holds under any load (every task ran at least its duration, strict real >= simulated); the
closeness itself depends on the machine, so it is measured here. In ready mode a real run can
beat its simulation (a ratio below 1): shifted times change the arbiter's greedy choices.

Run: python -m bench.sim_vs_real [--quick]   (--quick: 2 seeds instead of 6)
"""

from __future__ import annotations

import argparse
import asyncio
import selectors

import aioready
from aioready.devices.sim import SimDevice
from aioready.placement import Placement
from aioready.sim.durations import device_duration
from aioready.sim.variability import BaseDurations, JitterModel

from .common import median, write_result

CASES = [("1f1b", False), ("1f1b", True), ("zb-h1", True), ("bfw", True)]
S, M = 4, 8


JITTER = "lognormal:0.15"
BASE = BaseDurations(f=15.0, b=27.0, b_split=15.0, w=15.0)


def durations(seed: int, split: bool) -> JitterModel:
    return JitterModel(JITTER, seed=seed, placement=Placement.linear(S), num_microbatches=M,
                       split_backward=split, base=BASE)


async def real_step(model: JitterModel, hint: str, mode: str, split: bool) -> float:
    pipe = aioready.Pipeline([None] * S, None, microbatches=M, hint=hint, mode=mode,
                             split_backward=split,
                             device=SimDevice(device_duration(model, 1e-3), run_compute=False))
    await pipe.step()
    assert pipe.last_step is not None
    return pipe.last_step.step_time * 1e3


def precise_loop() -> asyncio.AbstractEventLoop:
    """select(2) takes microsecond timeouts; epoll rounds every sleep up to a millisecond."""
    return asyncio.SelectorEventLoop(selectors.SelectSelector())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 seeds instead of 6")
    args = ap.parse_args()
    seeds = range(2 if args.quick else 6)
    rows = []
    for hint, split in CASES:
        for mode in ("strict", "ready"):
            ratios, sims = [], []
            for seed in seeds:
                sim = aioready.simulate(stages=S, microbatches=M, hint=hint, mode=mode,
                                        split_backward=split, jitter=JITTER, seed=seed,
                                        base=BASE).step_time
                with asyncio.Runner(loop_factory=precise_loop) as runner:
                    real = runner.run(real_step(durations(seed, split), hint, mode, split))
                ratios.append(real / sim)
                sims.append(sim)
            rows.append(f"| {hint}{' (split)' if split else ''} | {mode} | {median(sims):.1f} | "
                        f"{median(ratios):.3f} | {min(ratios):.3f} - {max(ratios):.3f} |")
            print(rows[-1], flush=True)
    body = "\n".join([
        f"S={S} stages, M={M} microbatches, one step per run, {len(seeds)} seeds; in-process, "
        "sim device sleeping each task's duration on a real select() loop, no compute.",
        "real / simulated: step time of the real run over the simulator's, same durations.", "",
        "| hint | mode | simulated ms (median) | real / simulated (median) | range |",
        "|---|---|---|---|---|", *rows])
    command = "python -m bench.sim_vs_real" + (" --quick" if args.quick else "")
    print(write_result("sim_vs_real", body, command))


if __name__ == "__main__":
    main()
