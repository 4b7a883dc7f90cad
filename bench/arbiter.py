"""Arbiter decision cost and whole-runtime overhead per task.

- decision: push + pop_nowait + done of every task of one rank, divided by the task count, with
  8, 64 and 512 tasks per rank (median of repeats), greedy and `light` (every third
  microbatch three times as costly, so light ones overtake). Goal: < 5 us.
- overhead: a whole in-process pipeline step with zero-duration sim tasks and no compute, wall time
  divided by the number of tasks, on uvloop and on the default asyncio loop. Goal: < 50 us.

Run: python -m bench.arbiter [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import time

from aioready.ready_set import ReadySet
from aioready.schedulers import make_hint

from .common import median, write_result


def decision_cost(tasks_per_rank: int, repeats: int, light: bool = False) -> float:
    M = tasks_per_rank // 2
    hint = make_hint("1f1b", num_stages=1, num_microbatches=M)
    order = hint.orders[0]
    prio = hint.priority(0)
    factors = {m: 3.0 if m % 3 == 0 else 1.0 for m in range(M)}
    samples = []
    for _ in range(repeats):
        rs = ReadySet(prio, cap=M, num_chunks=1, split_backward=False,
                      lightness=factors.get if light else None)
        t0 = time.perf_counter_ns()
        for task in order:
            rs.push(task)
        while True:
            task = rs.pop_nowait()
            if task is None:
                break
            rs.done(task)
        samples.append((time.perf_counter_ns() - t0) / len(order) / 1000)
    return median(samples)


def runtime_overhead(loop_name: str, S: int, M: int, repeats: int,
                     policy: str = "reserve") -> float:
    import aioready
    from aioready.devices.sim import SimDevice

    async def main() -> list[float]:
        out = []
        for _ in range(repeats):
            pipe = aioready.Pipeline([None] * S, None, microbatches=M, hint="1f1b",
                                     mode="ready", policy=policy,
                                     device=SimDevice(lambda i: 0.0, run_compute=False))
            t0 = time.perf_counter()
            await pipe.step()
            out.append((time.perf_counter() - t0) / (2 * S * M) * 1e6)
        return out

    if loop_name == "uvloop":
        import uvloop
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return median(runner.run(main()))
    return median(asyncio.run(main()))


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    reps = 20 if args.quick else 200
    lines = ["## Arbiter decision cost (push + pop + done, per task)", "",
             "| tasks per rank | greedy: median us per decision | light |", "|---|---|---|"]
    for n in (8, 64, 512):
        lines.append(f"| {n} | {decision_cost(n, reps):.2f} | "
                     f"{decision_cost(n, reps, light=True):.2f} |")
    lines += ["", "## Runtime overhead per task (zero-duration sim tasks, S=4, M=64, no compute)",
              "", "The reserving policy (the default) also sends a forecast notice for every task "
              "that feeds a peer and keeps the forecast's bookkeeping (docs/hot_path.md).", "",
              "| loop | policy | median us per task |", "|---|---|---|"]
    for loop_name in ("uvloop", "asyncio"):
        for policy in ("reserve", "greedy", "light"):
            us = runtime_overhead(loop_name, 4, 64, 5 if args.quick else 20, policy)
            lines.append(f"| {loop_name} | {policy} | {us:.1f} |")
    body = "\n".join(lines)
    cmd = "python -m bench.arbiter" + (" --quick" if args.quick else "")
    write_result("arbiter", body, cmd)
    print(body)
    return body


if __name__ == "__main__":
    main()
