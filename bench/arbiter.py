"""Arbiter decision cost and whole-runtime overhead per task.

- decision: push + pop_nowait + done of every task of one rank, divided by the task count, with
  8, 64 and 512 tasks per rank (median of repeats), greedy and `light` (every third
  microbatch three times as costly, so light ones overtake), and greedy and `drain` on zb-h1
  with a split backward (drain's W test scans the announced gradients). Goal: < 5 us.
- overhead: a whole in-process pipeline step with zero-duration sim tasks and no compute, wall time
  divided by the number of tasks, on uvloop and on the default asyncio loop. Goal: < 50 us.

Each overhead row runs in its own processes, `--launches` of them alternating with the other rows
(and with `--baseline REV`, the aioready of an older commit), so all rows share the machine's load.

Run: python -m bench.arbiter [--quick] [--launches 5] [--baseline REV]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import median, other_load, write_result
from .oversub import ROOT, baseline_tree


def decision_cost(tasks_per_rank: int, repeats: int, light: bool = False,
                  split: bool = False, drain: bool = False) -> float:
    """`split`: zb-h1 with a split backward instead of 1F1B; `drain`: under the drain policy,
    whose W test sees one gradient announced far ahead (so it scans and lets W run)."""
    from aioready.forecast import Forecast  # here: a --worker imports aioready from --tree
    from aioready.ready_set import ReadySet
    from aioready.schedulers import make_hint
    from aioready.tasks import Task

    M = tasks_per_rank // (3 if split else 2)
    hint = make_hint("zb-h1" if split else "1f1b", num_stages=1, num_microbatches=M,
                     split_backward=split)
    order = hint.orders[0]
    prio = hint.priority(0)
    factors = {m: 3.0 if m % 3 == 0 else 1.0 for m in range(M)}
    forecast = Forecast()
    forecast.new_step(lambda: 0.0)
    forecast.observe(Task.parse("W0"), 1.0)
    forecast.notice(Task.parse(f"B{M}"), 1e9)
    samples = []
    for _ in range(repeats):
        rs = ReadySet(prio, cap=M, num_chunks=1, split_backward=split,
                      lightness=factors.get if light else None,
                      drain=forecast.clear_of_gradients if drain else None, entries=M)
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
                     policy: str = "reserve") -> list[tuple[float, float]]:
    """(wall, process CPU) us per task of `repeats` whole in-process steps."""
    import aioready
    from aioready.devices.sim import SimDevice

    async def main() -> list[tuple[float, float]]:
        out = []
        for _ in range(repeats):
            pipe = aioready.Pipeline([None] * S, None, microbatches=M, hint="1f1b",
                                     mode="ready", policy=policy,
                                     device=SimDevice(lambda i: 0.0, run_compute=False))
            t0, c0 = time.perf_counter(), time.process_time()
            await pipe.step()
            n = 2 * S * M
            out.append(((time.perf_counter() - t0) / n * 1e6,
                        (time.process_time() - c0) / n * 1e6))
        return out

    if loop_name == "uvloop":
        import uvloop
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(main())
    return asyncio.run(main())


def _launch(tree: str, loop_name: str, policy: str, steps: int) -> list[tuple[float, float]]:
    """One process running `steps` steps with the aioready package under `tree`."""
    cmd = [sys.executable, "-m", "bench.arbiter", "--worker", "--tree", tree, "--loop",
           loop_name, "--policy", policy, "--steps", str(steps)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT,
                         timeout=600).stdout
    return [tuple(x) for x in json.loads(out.strip().splitlines()[-1])]  # type: ignore[misc]


def _cell(xs: list[float]) -> str:
    return f"{median(xs):.1f} [{min(xs):.1f}-{max(xs):.1f}]"


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--launches", type=int, default=5, help="processes per row, alternating")
    ap.add_argument("--baseline", default="", help="a commit whose aioready runs beside this "
                    "tree's, launch by launch, as the 'before' rows")
    ap.add_argument("--worker", action="store_true", help="(internal) one launch")
    ap.add_argument("--tree", default="")
    ap.add_argument("--loop", default="uvloop")
    ap.add_argument("--policy", default="reserve")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args(argv)
    if args.worker:
        sys.path.insert(0, args.tree)
        print(json.dumps(runtime_overhead(args.loop, 4, 64, args.steps, args.policy)))
        return ""
    load = os.getloadavg()
    reps = 20 if args.quick else 200
    lines = ["## Arbiter decision cost (push + pop + done, per task)", "",
             "| tasks per rank | greedy: median us per decision | light | greedy, split "
             "(zb-h1) | drain, split (zb-h1) |", "|---|---|---|---|---|"]
    for n in (8, 64, 512):
        lines.append(f"| {n} | {decision_cost(n, reps):.2f} | "
                     f"{decision_cost(n, reps, light=True):.2f} | "
                     f"{decision_cost(n, reps, split=True):.2f} | "
                     f"{decision_cost(n, reps, split=True, drain=True):.2f} |")
    steps = 5 if args.quick else 20
    with tempfile.TemporaryDirectory() as tmp:
        trees = [("this tree", str(ROOT))]
        if args.baseline:
            trees.insert(0, (f"commit {args.baseline}", baseline_tree(args.baseline,
                                                                       Path(tmp))))
        rows: dict[tuple[str, str, str], list[tuple[float, float]]] = {}
        for _ in range(args.launches):  # alternating: every row sees the same load
            for loop_name in ("uvloop", "asyncio"):
                for policy in ("reserve", "greedy", "light"):
                    for label, tree in trees:
                        got = _launch(tree, loop_name, policy, steps)
                        # per launch: the median step (the first ones warm the caches)
                        rows.setdefault((loop_name, policy, label), []).append(
                            (median(w for w, _ in got), median(c for _, c in got)))
    lines += ["", "## Runtime overhead per task (zero-duration sim tasks, S=4, M=64, no compute)",
              "", "The reserving policy (the default) also sends a forecast notice for every task "
              "that feeds a peer and keeps the forecast's bookkeeping (docs/hot_path.md). "
              f"{args.launches} launches per row, alternating, {steps} steps each; per launch "
              "the median step, then median [min-max] over launches. Process CPU is less "
              f"sensitive than wall time to the machine's other load ({other_load()} at the "
              "end).", "",
              "| loop | policy | code | wall us per task | CPU us per task |",
              "|---|---|---|---|---|"]
    for (loop_name, policy, label), got in rows.items():
        lines.append(f"| {loop_name} | {policy} | {label} | {_cell([w for w, _ in got])} | "
                     f"{_cell([c for _, c in got])} |")
    body = "\n".join(lines)
    cmd = "python -m bench.arbiter" + (" --quick" if args.quick else "")
    cmd += f" --launches {args.launches}" + f" --baseline {args.baseline}" * bool(args.baseline)
    write_result("arbiter", body, cmd, load=list(load))
    print(body)
    return body


if __name__ == "__main__":
    main()
