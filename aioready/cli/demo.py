"""`make demo` (`python -m aioready.cli.demo`): strict vs ready on a small GPT over 4 MPI ranks.

Trains the tiny GPT-style model of aioready/testing/models.py for a few steps under multimodal-like
jitter (some microbatches cost 3x at every stage, as image-bearing ones do), once in `strict` mode
(the hint order, exactly) and once in `ready` mode (readiness-first, in-flight cap raised to 2x the
1F1B peak: the freedom docs/policy.md says the gains come from), with the same seed and so the same
task durations. Over MPI (mpiexec from this Python's environment) when mpi4py, mpiexec and the MPI
transport are all present; otherwise in one process, and it says so. Prints a table and writes
timelines (out/strict.png, out/ready.png, out/compare.png) and Chrome traces.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["main", "mpi_launcher"]


def mpi_launcher() -> tuple[str | None, str]:
    """The mpiexec to use, or None and the reason MPI cannot be used."""
    if importlib.util.find_spec("mpi4py") is None:
        return None, "mpi4py is not installed"
    if importlib.util.find_spec("aioready.transports.mpi") is None:
        return None, "this build has no MPI transport (aioready.transports.mpi)"
    here = Path(sys.executable).parent / "mpiexec"
    exe = str(here) if here.exists() else shutil.which("mpiexec")
    if exe is None:
        return None, "no mpiexec next to this Python or on PATH"
    return exe, f"MPI via {exe}"


def _train_args(a: argparse.Namespace, mode: str, out: Path) -> list[str]:
    args = ["--stages", str(a.ranks), "--microbatches", str(a.microbatches), "--hint", "1f1b",
            "--mode", mode, "--jitter", a.jitter, "--seed", str(a.seed), "--steps",
            str(a.steps), "--task-ms", str(a.task_ms), "--json", str(out / f"{mode}.json"),
            "--chrome-trace", str(out / f"{mode}.trace.json"), "--png", str(out / f"{mode}.png"),
            "--no-progress"]
    if mode == "ready":
        args += ["--cap", str(2 * a.ranks)]
    return args


def _run_mpi(exe: str, a: argparse.Namespace, mode: str, out: Path) -> str | None:
    """Run one mode under mpiexec; None when it worked, else why it did not."""
    cmd = [exe, "-n", str(a.ranks), sys.executable, "-m", "aioready", "train",
           *_train_args(a, mode, out)]
    print("$", " ".join(cmd), flush=True)
    try:
        proc = subprocess.run(cmd, timeout=a.timeout, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return f"mpiexec ran past {a.timeout:.0f} s"
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
        return f"mpiexec exited with {proc.returncode}:\n{tail}"
    return None


def _run_inprocess(a: argparse.Namespace, mode: str, out: Path) -> None:
    from . import main as cli_main
    print(f"$ aioready train {' '.join(_train_args(a, mode, out))}", flush=True)
    if cli_main(["train", *_train_args(a, mode, out)]) != 0:
        raise SystemExit(f"demo: the {mode} run failed")


def _table(out: Path) -> list[dict[str, Any]]:
    rows = []
    for mode in ("strict", "ready"):
        s = json.loads((out / f"{mode}.json").read_text())
        rows.append({"mode": mode, "cap": s["cap"], "step_ms": statistics.median(s["step_time"]),
                     "lb_ms": statistics.median(s["lower_bound"]),
                     "eff": statistics.median(s["efficiency"]), "loss": s["loss"][-1],
                     "overruns": s["overruns"], "transport": s["transport"]})
    base = rows[0]["step_ms"]
    print(f"\n{'mode':8}{'cap':>6}{'step ms':>10}{'LB ms':>9}{'efficiency':>12}{'speedup':>9}"
          f"{'last loss':>11}")
    for r in rows:
        cap = "hint" if r["cap"] is None else str(r["cap"])
        print(f"{r['mode']:8}{cap:>6}{r['step_ms']:>10.1f}{r['lb_ms']:>9.1f}{r['eff']:>12.3f}"
              f"{base / r['step_ms']:>8.2f}x{r['loss']:>11.4f}")
    print("(medians over steps; speedup = strict step time / this step time)")
    if any(r["overruns"] for r in rows):
        print(f"note: {sum(r['overruns'] for r in rows)} tasks computed for longer than their "
              "given duration (a loaded machine): the two runs' durations differ that much")
    return rows


def simulated(a: argparse.Namespace) -> dict[str, float]:
    """Median step time (ms) of each mode on the same durations, on the virtual clock: what the
    runs above would show on an idle machine (no compute, no clock noise)."""
    from ..clock import run_virtual
    from ..devices.sim import SimDevice
    from ..runtime.pipeline import Pipeline
    from ..sim.durations import paced_duration
    out = {}
    for mode in ("strict", "ready"):
        cap = 2 * a.ranks if mode == "ready" else None
        pipe = Pipeline([None] * a.ranks, None, microbatches=a.microbatches, hint="1f1b",
                        mode=mode, cap=cap, device=SimDevice(lambda i: 0.0, run_compute=False))
        duration, _ = paced_duration(placement=pipe.hint.placement,
                                     num_microbatches=a.microbatches, split_backward=False,
                                     task_ms=a.task_ms, jitter=a.jitter, seed=a.seed)
        for rt in pipe.runtimes:
            rt.device = SimDevice(duration, run_compute=False)

        async def steps(pipe: Pipeline = pipe) -> list[float]:
            times = []
            for _ in range(a.steps):
                await pipe.step()
                assert pipe.last_step is not None
                times.append(pipe.last_step.step_time)
            return times
        out[mode] = statistics.median(run_virtual(steps())) * 1e3
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m aioready.cli.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4, help="pipeline ranks = stages")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--jitter", default="multimodal:0.3:3")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--task-ms", type=float, default=20.0, help="base F duration in ms")
    p.add_argument("--out", default="out", help="output folder")
    p.add_argument("--in-process", action="store_true", help="do not use MPI")
    p.add_argument("--timeout", type=float, default=150.0, help="seconds per MPI run")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    exe, why = (None, "--in-process given") if a.in_process else mpi_launcher()
    print(f"aioready demo: {a.ranks}-stage GPT-style model, M={a.microbatches}, {a.steps} steps, "
          f"jitter {a.jitter}, seed {a.seed}")
    print(f"transport: {why}" if exe else f"transport: in-process ({why})", flush=True)
    for mode in ("strict", "ready"):
        failed = _run_mpi(exe, a, mode, out) if exe else "not used"
        if exe and failed:
            print(f"the MPI run failed ({failed});\nfalling back to in-process for both modes",
                  flush=True)
            exe = None
            if mode == "ready":
                _run_inprocess(a, "strict", out)
        if not exe:
            _run_inprocess(a, mode, out)
    _table(out)
    sim = simulated(a)
    print(f"virtual clock, same durations, no compute: strict {sim['strict']:.1f} ms, ready "
          f"{sim['ready']:.1f} ms, speedup {sim['strict'] / sim['ready']:.2f}x")
    from ..telemetry.export import read_chrome_trace
    from ..telemetry.plots import plot_compare
    strict, ready = (read_chrome_trace(out / f"{m}.trace.json")[-1] for m in ("strict", "ready"))
    path = plot_compare([strict, ready], out / "compare.png",
                        labels=("strict 1f1b", f"ready 1f1b cap {2 * a.ranks}"))
    print(f"timelines: {out / 'strict.png'}, {out / 'ready.png'}, {path} (last step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
