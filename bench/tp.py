"""Tensor-parallel coordination overhead: ready (leader decides, members follow) vs strict.

Runs examples/tp_mlp.py under `mpiexec -n 4` (2 stages x 2 TP ranks), strict and ready
alternating inside one job (side by side, same processes), and reports per scenario:
- step time, median over measured steps (the first step of each run is warm-up), and the
  ready/strict ratio (includes any difference in task order, not only coordination);
- decision messages per step (strict: none);
- one-way decision latency, leader send -> member arrival (time.monotonic, one host);
- member wait: per task, how long a member sat idle with that task ready locally, waiting only
  for the leader's decision -- the direct cost of coordination -- and its share of the step;
- the cost of the tag check before each collective (verify on vs off, strict mode).

Run: python -m bench.tp [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from .common import median, write_result

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "tp_mlp.py"
SCENARIOS = {
    "small (width 16, hidden 32, 2 rows/mb)": ["--width", "16", "--hidden", "32", "--batch", "2"],
    "medium (width 256, hidden 1024, 64 rows/mb)": ["--width", "256", "--hidden", "1024",
                                                    "--batch", "64"],
}


def mpiexec() -> str:
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else "mpiexec"


def launch(extra: list[str], *, steps: int, repeats: int, timeout: float = 900) -> dict[str, Any]:
    cmd = [mpiexec(), "-n", "4", sys.executable, str(SCRIPT), "--tp", "2",
           "--mode", "strict,ready", "--microbatches", "8", "--steps", str(steps + 1),
           "--warmup", "1", "--repeats", str(repeats), "--no-check", *extra]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"tp_mlp failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(lines[0][len("RESULT "):])  # type: ignore[no-any-return]


def _steps(runs: list[dict[str, Any]]) -> list[float]:
    return [t for r in runs for t in r["step_s"]]


def scenario_row(name: str, res: dict[str, Any], steps: int) -> tuple[str, dict[str, float]]:
    strict, ready = res["runs"]["strict"], res["runs"]["ready"]
    t_strict, t_ready = median(_steps(strict)), median(_steps(ready))
    n_steps = steps * len(ready)
    msgs = sum(r["decision_messages"] for r in ready) / (len(ready) * (steps + 1))
    lat = median(r["latency_median_s"] for r in ready)
    lat95 = median(r["latency_p95_s"] for r in ready)
    wait_med = median(r["wait_median_s"] for r in ready)
    followers = res["world"] - res["pp"]
    wait_step = sum(r["wait_total_s"] for r in ready) / (n_steps * followers)
    figures = {"ratio": t_ready / t_strict, "wait_share": wait_step / t_ready}
    row = (f"| {name} | {t_strict * 1e3:.1f} | {t_ready * 1e3:.1f} | {figures['ratio']:.3f} | "
           f"{msgs:.0f} | {lat * 1e6:.0f} / {lat95 * 1e6:.0f} | {wait_med * 1e6:.0f} | "
           f"{wait_step * 1e3:.2f} ({100 * figures['wait_share']:.1f}%) |")
    return row, figures


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    steps, repeats = (3, 2) if args.quick else (5, 4)
    lines = [f"## TP coordination overhead, mpiexec -n 4 (PP=2 x TP=2), 1F1B, M=8, "
             f"{repeats} runs x {steps} measured steps per mode", "",
             "| scenario | strict step ms | ready step ms | ready/strict | decision msgs/step | "
             "latency us median/p95 | member wait us/task (median) | member wait ms/step "
             "(share of step) |", "|---|---|---|---|---|---|---|---|"]
    for name, extra in SCENARIOS.items():
        row, _ = scenario_row(name, launch(extra, steps=steps, repeats=repeats), steps)
        lines.append(row)
        print(row, flush=True)
    small = next(iter(SCENARIOS.values()))
    on = launch(small, steps=steps, repeats=repeats)
    off = launch([*small, "--verify", "off"], steps=steps, repeats=repeats)
    t_on, t_off = median(_steps(on["runs"]["strict"])), median(_steps(off["runs"]["strict"]))
    lines += ["", "## Tag check before each collective (strict mode, small scenario)", "",
              "| verify | strict step ms |", "|---|---|",
              f"| on | {t_on * 1e3:.1f} |", f"| off | {t_off * 1e3:.1f} |",
              f"| on/off | {t_on / t_off:.3f} |"]
    body = "\n".join(lines)
    write_result("tp", body, "python -m bench.tp" + (" --quick" if args.quick else ""))
    print(body)
    return body


if __name__ == "__main__":
    main()
