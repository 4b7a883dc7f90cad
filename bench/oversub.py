"""Oversubscribed host: S MPI ranks on this machine's few cores, sleep-only tasks.

With more ranks than cores, every microsecond a rank spends polling is taken from a rank whose
task should be ending: tasks overrun their given durations and the step stretches. This bench
runs `aioready train --sleep-only` (1F1B, M = 4S, F = `--task-ms`, B = 2F) on S ranks and
measures, per rank, the process CPU (% of one core) while its arbiter waits for a task to become
ready and while a task runs (the completion engine's `set_waiting` marks the two states), the
completion engine's wake-ups per second in each, and each task's overrun: its span minus its
given duration. The step is also compared with the ideal 1F1B step, (M + S - 1) * 3F.

Each configuration runs `--repeats` times (separate launches, alternating the variants: the fast
paths off and on, `AIOREADY_MPI_FAST`, with `--busy-sleep` the fast paths and
`AIOREADY_BUSY_SLEEP=1`, and with `--baseline REV` the aioready of an older commit),
so every side sees the same machine load; figures are medians over repeats with the range in
brackets.

Run: python -m bench.oversub [--quick] [--ranks 8,16] [--repeats 5]
(one launch alone: mpiexec -n 16 python -m bench.oversub --worker --stages 16 ...)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import median, other_load, write_result
from .e2e import mpiexec

ROOT = Path(__file__).resolve().parent.parent

TIMEOUT_S = 1800

# per-rank figures gathered to rank 0, in this order
FIELDS = ("wait_s", "wait_cpu_s", "wait_parks", "run_s", "run_cpu_s", "run_parks", "hot_passes",
          "rung", "bell_parks", "rings", "missed_rings")


class _Account:
    """Wall and process CPU time per arbiter state, over the measured steps only."""

    def __init__(self) -> None:
        self.on = False
        self.state: bool | None = None
        self.mark = (0.0, 0.0)
        self.parks0 = 0
        self.totals = dict.fromkeys(FIELDS, 0.0)
        self.engine: Any = None
        self.bell: Any = None  # the MPI transport's doorbell, if any

    def switch(self, engine: Any, waiting: bool | None) -> None:
        now = (time.monotonic(), time.process_time())
        if self.on and self.state is not None:
            key = "wait" if self.state else "run"
            self.totals[f"{key}_s"] += now[0] - self.mark[0]
            self.totals[f"{key}_cpu_s"] += now[1] - self.mark[1]
            self.totals[f"{key}_parks"] += wakes(engine) - self.parks0
        self.engine = engine
        self.state, self.mark, self.parks0 = waiting, now, wakes(engine)


def wakes(engine: Any) -> int:
    """The engine's wake-ups: its parks, and the rings it answered in the reader callback
    without ending its park (`num_ring_polls`; absent from older commits' engines)."""
    return engine.num_parks + getattr(engine, "num_ring_polls", 0)


def worker(args: argparse.Namespace) -> None:
    import numpy as np
    from mpi4py import MPI

    from aioready.cli.trainer import TrainConfig, train
    from aioready.launch import run
    from aioready.progress import ProgressEngine
    from aioready.runtime.rank import RankRuntime

    acct = _Account()
    set_waiting = ProgressEngine.set_waiting
    run_step = RankRuntime.run_step

    def counted_set_waiting(self: ProgressEngine, waiting: bool) -> None:
        acct.switch(self, waiting)
        set_waiting(self, waiting)

    async def counted_run_step(self: RankRuntime, step: int, *a: Any, **kw: Any) -> Any:
        acct.on = step >= args.warmup
        acct.bell = getattr(self.transport, "_bell", None)
        acct.state = None
        try:
            return await run_step(self, step, *a, **kw)
        finally:
            if acct.engine is not None:
                acct.switch(acct.engine, None)
            acct.on = False

    ProgressEngine.set_waiting = counted_set_waiting  # type: ignore[method-assign]
    RankRuntime.run_step = counted_run_step  # type: ignore[method-assign]
    comm = MPI.COMM_WORLD
    S = comm.Get_size()
    cfg = TrainConfig(stages=S, microbatches=args.microbatches or 4 * S, hint=args.hint,
                      mode="ready", task_ms=args.task_ms, sleep_only=True,
                      steps=args.warmup + args.steps, seed=0)
    result = run(train(cfg, comm=comm))  # as `aioready train`: uvloop when installed
    engine = acct.engine
    if engine is not None:
        acct.totals["hot_passes"] = engine.num_hot_passes
        acct.totals["bell_parks"] = engine.num_doorbell_parks
        acct.totals["rings"] = getattr(engine, "num_rings", 0)
        acct.totals["missed_rings"] = getattr(engine, "num_missed_rings", 0)
        acct.totals["rung"] = 0 if acct.bell is None else acct.bell.num_rung
    mine = np.array([acct.totals[k] for k in FIELDS], np.float64)
    every = np.zeros((S, len(FIELDS)), np.float64) if comm.Get_rank() == 0 else None
    comm.Gather(mine, every, root=0)
    if comm.Get_rank() != 0:
        return
    F = args.task_ms
    over = []
    for report in result.reports[args.warmup:]:
        for s in report.spans:
            given = F * (1 if s.kind.name == "F" else 2)
            over.append((s.end - s.start) * 1e3 - given)
    steps = [m.step_time * 1e3 for m in result.metrics[args.warmup:]]
    out = {"ranks": S, "microbatches": cfg.microbatches, "task_ms": F,
           "fast": os.environ.get("AIOREADY_MPI_FAST", "1"),
           "ideal_ms": (cfg.microbatches + S - 1) * 3 * F, "step_ms": steps,
           "overrun_ms": over, "per_rank": {k: every[:, i].tolist() for i, k in
                                            enumerate(FIELDS)}}
    Path(args.out).write_text(json.dumps(out))


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summarize(run: dict[str, Any]) -> dict[str, float]:
    """One launch's figures: medians over ranks (CPU %, wakes a second), over tasks (overrun)."""
    pr = run["per_rank"]
    wait_pct = [100 * c / w for c, w in zip(pr["wait_cpu_s"], pr["wait_s"]) if w > 0]
    run_pct = [100 * c / w for c, w in zip(pr["run_cpu_s"], pr["run_s"]) if w > 0]
    wait_hz = [p / w for p, w in zip(pr["wait_parks"], pr["wait_s"]) if w > 0]
    run_hz = [p / w for p, w in zip(pr["run_parks"], pr["run_s"]) if w > 0]
    over = run["overrun_ms"]
    tasks = 2 * run["microbatches"] * len(run["step_ms"])  # 1F1B: an F and a B per microbatch
    task_us = [(c + d) / tasks * 1e6 for c, d in zip(pr["wait_cpu_s"], pr["run_cpu_s"])]
    return {"task_cpu_us": median(task_us), "wait_cpu": median(wait_pct), "run_cpu": median(run_pct),
            "wait_hz": median(wait_hz), "run_hz": median(run_hz),
            "overrun_med": median(over), "overrun_p90": _pct(over, 0.9),
            "step_ratio": median(run["step_ms"]) / run["ideal_ms"],
            "missed_rings": sum(pr.get("missed_rings", [0]))}


def launch(S: int, variant: tuple[str, str, dict[str, str]], args: argparse.Namespace,
           workdir: Path, i: int) -> dict[str, Any] | str:
    label, tree, extra = variant
    out = workdir / f"s{S}-{len(label)}-{abs(hash(label))}-{i}.json"
    cmd = [mpiexec(), "-n", str(S), sys.executable, "-m", "bench.oversub", "--worker",
           "--task-ms", str(args.task_ms), "--steps", str(args.steps), "--warmup",
           str(args.warmup), "--hint", args.hint, "--microbatches", str(args.microbatches),
           "--out", str(out), "--tree", tree]
    env = {**os.environ, **extra}
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600,
                              cwd=ROOT)
    except subprocess.TimeoutExpired:
        return "timed out after 600 s"
    if proc.returncode != 0 or not out.exists():
        return f"failed (rc {proc.returncode}): {proc.stderr.strip()[-300:]}"
    return json.loads(out.read_text())


def baseline_tree(rev: str, workdir: Path) -> str:
    """The aioready package of commit `rev`, extracted under `workdir` (no worktree made)."""
    base = workdir / "baseline"
    base.mkdir()
    archive = subprocess.run(["git", "archive", rev, "aioready"], cwd=ROOT, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
    return str(base)


def _cell(xs: list[float], fmt: str) -> str:
    return f"{median(xs):{fmt}} [{min(xs):{fmt}}-{max(xs):{fmt}}]"


COLUMNS = (("task_cpu_us", "CPU us per task (all of it runtime)", ".0f"),
           ("wait_cpu", "waiting rank CPU %", ".2f"), ("run_cpu", "CPU % while a task runs",
           ".2f"), ("wait_hz", "engine wakes/s waiting", ".0f"),
           ("run_hz", "engine wakes/s in a task", ".0f"),
           ("overrun_med", "task overrun median ms", ".2f"),
           ("overrun_p90", "task overrun p90 ms", ".2f"),
           ("step_ratio", "step / ideal 1F1B step", ".3f"),
           ("missed_rings", "missed rings (all ranks)", ".0f"))


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--worker", action="store_true", help="one rank (under mpiexec)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ranks", default="8,16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--task-ms", type=float, default=10.0)
    ap.add_argument("--microbatches", type=int, default=0, help="0: 4 per rank")
    ap.add_argument("--hint", default="1f1b")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--fast", default="0,1", help="AIOREADY_MPI_FAST values to alternate")
    ap.add_argument("--baseline", default="", help="a commit whose aioready runs beside this "
                    "tree's (fast paths on), alternating, as the 'before' rows")
    ap.add_argument("--busy-sleep", action="store_true", help="add a variant with "
                    "AIOREADY_BUSY_SLEEP=1 (fast paths on)")
    ap.add_argument("--variant", action="append", default=[], help="another variant (fast "
                    "paths on): VAR=VALUE[,VAR=VALUE...] set for its launches, e.g. "
                    "AIOREADY_TASK_LEAD_US=1000; repeatable")
    ap.add_argument("--out", default="", help="(worker) where to write its JSON record")
    ap.add_argument("--tree", default="", help="(worker) import aioready from this directory")
    args = ap.parse_args(argv)
    if args.worker:
        if args.tree:
            sys.path.insert(0, args.tree)
        worker(args)
        return ""
    if args.quick:
        args.ranks, args.repeats, args.steps = "8", 2, 1
    ranks = [int(r) for r in args.ranks.split(",")]
    load = other_load()
    rows: dict[tuple[int, str], list[dict[str, float]]] = {}
    failures: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        variants = [(f"AIOREADY_MPI_FAST={f}", str(ROOT), {"AIOREADY_MPI_FAST": f})
                    for f in args.fast.split(",")]
        if args.busy_sleep:
            variants.append(("AIOREADY_BUSY_SLEEP=1", str(ROOT), {"AIOREADY_MPI_FAST": "1",
                                                                 "AIOREADY_BUSY_SLEEP": "1"}))
        for spec in args.variant:
            env = dict(kv.split("=", 1) for kv in spec.split(","))
            variants.append((spec, str(ROOT), {"AIOREADY_MPI_FAST": "1", **env}))
        if args.baseline:
            variants.insert(0, (f"commit {args.baseline}", baseline_tree(args.baseline,
                                                                         Path(tmp)), {}))
        for S in ranks:
            for i in range(args.repeats):
                for variant in variants:
                    got = launch(S, variant, args, Path(tmp), i)
                    if isinstance(got, str):
                        failures.append(f"S={S} {variant[0]} repeat {i}: {got}")
                        continue
                    rows.setdefault((S, variant[0]), []).append(summarize(got))
                    print(f"S={S} {variant[0]} #{i}: {rows[(S, variant[0])][-1]}", flush=True)
    lines = ["## Oversubscribed host: sleep-only 1F1B, M = 4S, F = "
             f"{args.task_ms:g} ms, B = 2F", "",
             f"{args.repeats} launches per row ({args.steps} measured steps after "
             f"{args.warmup} warm-up), the variants alternating; medians over ranks "
             "(CPU, wakes) and tasks (overrun) per launch, then median [range] over launches. "
             f"{os.cpu_count()} cores; {load} before, {other_load()} after.", "",
             "| S | code | " + " | ".join(c[1] for c in COLUMNS) + " |",
             "|---|---|" + "---|" * len(COLUMNS)]
    for (S, label), runs in rows.items():
        cells = [_cell([r[key] for r in runs], fmt) for key, _, fmt in COLUMNS]
        lines.append(f"| {S} | {label} | " + " | ".join(cells) + " |")
    if failures:
        lines += ["", "Failed launches:", *[f"- {f}" for f in failures]]
    body = "\n".join(lines)
    command = "python -m bench.oversub" + (" --quick" if args.quick else
                                           f" --ranks {args.ranks} --repeats {args.repeats}")
    command += f" --fast {args.fast}" * (args.fast != "0,1")
    command += f" --baseline {args.baseline}" * bool(args.baseline)
    command += " --busy-sleep" * args.busy_sleep
    command += "".join(f" --variant {v}" for v in args.variant)
    write_result("oversub", body, command)
    print(body)
    return body


if __name__ == "__main__":
    main()
