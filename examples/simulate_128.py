"""Simulate a 128-stage pipeline under multimodal jitter: strict vs ready, several hints and caps.

    python examples/simulate_128.py                    # S=128, M=128: a few minutes
    python examples/simulate_128.py --stages 32 --microbatches 64   # quicker

`aioready.simulate` runs the real runtime (ready set, arbiter, messages) on a virtual clock:
task durations come from the seeded jitter model, no time passes for real, and the result is
exact and deterministic. Efficiency is the lower bound from the realised durations over the
simulated step time (docs/architecture.md "Variability and traces").
"""

from __future__ import annotations

import argparse
import time

import aioready


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, default=128)
    p.add_argument("--microbatches", type=int, default=128)
    p.add_argument("--jitter", default="multimodal:0.3:3")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    runs = [("1f1b", "strict", None, False), ("1f1b", "ready", None, False),
            ("1f1b", "ready", "2x", False), ("bfw", "ready", "2x", True)]
    print(f"S={a.stages} M={a.microbatches} jitter {a.jitter} seed {a.seed} (times in ms of the "
          "trace unit: F=1, B=2 unsplit; B=W=1 split)")
    base = None
    for hint, mode, cap, split in runs:
        t = time.perf_counter()
        r = aioready.simulate(stages=a.stages, microbatches=a.microbatches, hint=hint,
                              mode=mode, jitter=a.jitter, seed=a.seed, cap=cap,
                              split_backward=split)
        base = base or r.step_time
        print(f"{hint:5} {mode:6} cap {cap or 'hint':4}  step {r.step_time:9.1f}  lower bound "
              f"{r.lower_bound:9.1f}  efficiency {r.efficiency:.3f}  speedup "
              f"{base / r.step_time:.2f}x  ({r.num_tasks} tasks, "
              f"{time.perf_counter() - t:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
