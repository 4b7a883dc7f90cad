"""Deep pipelines, real processes: aioready (mpiexec, MPITransport) against every schedule of
torch.distributed.pipelining (torchrun, gloo) at S = 4, 8 and 16 ranks, M = 4S microbatches.

The stage compute is the thin model of bench/e2e_thin.py and each task sleeps its injected
duration (aioready/testing/inject.py: the same durations on both runtimes, from one group trace per
scenario and seed, 2S layer groups of F = B = W = task_ms / 2), so 16 ranks fit on a small machine
and what is left on top of the sleeps is each runtime's own cost. Per configuration, over every
measured step of every seed: median step time (max over ranks after a barrier) and its spread,
peak activations per rank (measured by the injector, in linear-stage microbatches), the CPU each
rank's process spent per task, and runtime overhead = measured step - the simulator's step for the
same durations and configuration (aioready.sim.simulate; torch rows against the strict form of
the same schedule, DualPipeV has none), as a share of the step. Warm-up steps are the same on both
sides. A configuration that fails or hangs is a row that says so; the others of its launch are
run again without it. Writes bench/results/e2e_scale.md, .json and .png.

Run: python -m bench.e2e --scale [--sizes 4,8,16] [--seeds 0,1,2] [--steps N] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import RESULTS, write_result
from .e2e import ROOT, _free_port, generate_trace, mpiexec, split_spec
from .e2e_worker import DEFAULT

__all__ = ["SCENARIOS", "TORCH_ALL", "AIOREADY_FULL", "AIOREADY_REDUCED", "run_one", "main"]

TIMEOUT_S = 10800.0  # `python -m bench all`: the default matrix takes ~2 h on 2 busy cores
SCENARIOS = ["lognormal:0.5", "multimodal:0.3:3", "straggler:1:1.5"]
TORCH_ALL = ["ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B",
             "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV"]
# DEFAULT: what `aioready train` runs with no schedule flags (hint auto, its placement style and
# split backward chosen before step 0, within ZBV's busiest-rank in-flight count), on the model
# split into 2 stages per rank as for torch's two-chunk schedules (bench/e2e_worker.py)
AIOREADY_FULL = [DEFAULT, "1f1b/strict", "1f1b/ready", "1f1b/ready:greedy", "1f1b/ready@2x",
                 "bfw/ready",
                 "interleaved-zb/ready", "zbv/strict", "zbv/ready", "zbv/ready:greedy",
                 "zbv/ready@1.5x", "zbv/ready@2x", "auto/ready@2x"]
AIOREADY_REDUCED = [DEFAULT, "zbv/strict", "zbv/ready", "zbv/ready@2x", "auto/ready@2x"]
TORCH_FOR_HINT = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                  "interleaved-1f1b": "ScheduleInterleaved1F1B",
                  "interleaved-zb": "ScheduleInterleavedZeroBubble",
                  "zbv": "ScheduleZBVZeroBubble"}
HINT_FOR_TORCH = {v: k for k, v in TORCH_FOR_HINT.items()}
MODEL = ["--thin", "--dim", "8", "--seq", "4", "--mb-size", "1", "--vocab", "16"]


def _watched(cmd: list[str], out: Path, log: Path, first_s: float, per_config_s: float) -> None:
    """Run `cmd`; stop it once no config has finished for `per_config_s` (the first may also
    take `first_s` of start-up). A hang then costs one config's time, not the launch's."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)
        seen, since, limit = -1, time.monotonic(), first_s + per_config_s
        while proc.poll() is None:
            time.sleep(1.0)
            done = out.stat().st_mtime_ns if out.exists() else 0
            if done != seen:
                seen, since = done, time.monotonic()
                limit = per_config_s if done else limit
            elif time.monotonic() - since > limit:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise RuntimeError(f"timed out after {limit:.0f} s without a finished config: "
                                   f"{' '.join(cmd)}\n{log.read_text()[-3000:]}")
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {' '.join(cmd)}\n{log.read_text()[-3000:]}")


def _side_launch(side: str, ranks: int, common: list[str], configs: list[str], out: Path,
                 log: Path, first_s: float, per_config_s: float) -> None:
    worker = ["-m", "bench.e2e_worker", side, *common, "--out", str(out)]
    if side == "aioready":
        cmd = [mpiexec(), "-n", str(ranks), sys.executable, *worker, "--configs",
               ",".join(configs)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
               "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1", "--master-port",
               str(_free_port()), *worker, "--torch-configs", ",".join(configs)]
    _watched(cmd, out, log, first_s, per_config_s)


def run_side(side: str, configs: list[str], *, ranks: int, common: list[str], workdir: Path,
             tag: str, per_config_s: float, launch_s: float) -> list[dict[str, Any]]:
    """Every config of one side; a failed or hung config becomes a row with its error and the
    rest are launched again without it."""
    rows: list[dict[str, Any]] = []
    todo = list(configs)
    attempt = 0
    while todo:
        out = workdir / f"{side}-{tag}-{attempt}.json"
        log = workdir / f"{side}-{tag}-{attempt}.log"
        error = None
        try:
            _side_launch(side, ranks, common, todo, out, log, launch_s, per_config_s)
        except RuntimeError as exc:
            error = str(exc)
        done = json.loads(out.read_text())["records"] if out.exists() else []
        rows += done
        todo = todo[len(done):]
        if error is None:
            break
        if todo:  # the config running when the launch died
            reason = "hung (timed out)" if "timed out" in error.splitlines()[0] else "failed"
            last = [ln for ln in error.splitlines()[1:] if ln.strip()][-1:] or [""]
            rows.append({"name": todo[0], "side": side,
                         "error": reason + (f": {last[0][-200:]}" if last[0] else "")})
            todo = todo[1:]
        attempt += 1
    return rows


def run_one(*, spec: str, ranks: int, seed: int, task_ms: float, warmup: int, steps: int,
            aioready_configs: list[str], torch_configs: list[str], workdir: Path,
            model_args: list[str] | None = None) -> dict[str, Any]:
    """One scenario, one seed, one S: both sides on the same trace."""
    workdir.mkdir(parents=True, exist_ok=True)
    groups, M = 2 * ranks, 4 * ranks
    tag = f"S{ranks}-{spec.replace(':', '_').replace('+', '-')}-seed{seed}"
    trace = workdir / f"trace-{tag}.csv"
    generate_trace(spec, seed=seed, groups=groups, microbatches=M, steps=warmup + steps,
                   task_ms=task_ms, path=trace)
    common = ["--trace", str(trace), "--groups", str(groups), "--straggler",
              split_spec(spec)[1], "--microbatches", str(M), "--warmup", str(warmup),
              "--steps", str(steps), "--seed", str(seed), *(MODEL if model_args is None
                                                             else model_args)]
    # a step takes about 3M task_ms / efficiency; 8x that and a minute is a hang
    per_config = 60.0 + 8.0 * (warmup + steps) * 3 * M * task_ms * 1e-3 * (1.5 if "straggler"
                                                                               in spec else 1)
    t0 = time.perf_counter()
    rows = run_side("aioready", aioready_configs, ranks=ranks, common=common, workdir=workdir,
                    tag=tag, per_config_s=per_config, launch_s=120.0 + 4 * ranks)
    rows += run_side("torch", torch_configs, ranks=ranks, common=common, workdir=workdir,
                     tag=tag, per_config_s=per_config, launch_s=120.0 + 4 * ranks)
    return {"scenario": spec, "ranks": ranks, "seed": seed, "trace": str(trace),
            "microbatches": M, "groups": groups, "warmup": warmup, "records": rows,
            "wall_s": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from .e2e_scale_page import write_outputs
    from .e2e_scale_report import simulated, summarize
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", action="store_true", help="(accepted: `bench.e2e --scale`)")
    ap.add_argument("--quick", action="store_true",
                    help="S=4 and 8, multimodal only, one seed, 2 steps, few configs")
    ap.add_argument("--sizes", default=None, help="ranks S, comma-separated (default 4,8,16)")
    ap.add_argument("--scenarios", default=None, help="jitter specs, comma-separated")
    ap.add_argument("--seeds", default=None, help="comma-separated (default 0,1,2)")
    ap.add_argument("--steps", type=int, default=None, help="measured steps (default 3)")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up steps, both sides")
    ap.add_argument("--task-ms", type=float, default=10.0,
                    help="F = B = W of a linear stage, ms (half of it per layer group)")
    ap.add_argument("--full-below", type=int, default=16,
                    help="S below this runs the reduced config lists (default: all but S=16)")
    ap.add_argument("--full-scenarios", default=None,
                    help="scenarios that run the full config lists at S >= --full-below "
                    "(default: all); the others run the reduced lists")
    ap.add_argument("--one-seed", default="",
                    help="scenarios that run only the first seed (comma-separated)")
    ap.add_argument("--runs-out", default=None, metavar="FILE",
                    help="write the raw runs here after each one (to rebuild the page with "
                    "--from-runs if the matrix is cut short)")
    ap.add_argument("--from-runs", default=None, metavar="FILE",
                    help="no launches: rebuild the page from a --runs-out file")
    ap.add_argument("--measured-by", default=None, metavar="TEXT",
                    help="with --from-runs: the commands and commits that measured the runs (markdown), "
                    "said on the page")
    ap.add_argument("--aioready", default=None, help="override: hint/mode,... for every S")
    ap.add_argument("--name", default="e2e_scale",
                    help="write bench/results/NAME.md, .json and .png (default e2e_scale)")
    ap.add_argument("--torch", default=None, help="override: schedule names for every S")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in (args.sizes or ("4,8" if args.quick else "4,8,16")).split(",")]
    scenarios = (args.scenarios.split(",") if args.scenarios else
                 ["multimodal:0.3:3"] if args.quick else SCENARIOS)
    seeds = [int(s) for s in (args.seeds or ("0" if args.quick else "0,1,2")).split(",")]
    steps = args.steps or (2 if args.quick else 3)
    load_start = list(os.getloadavg())
    started = time.strftime("%H:%M:%S", time.gmtime())
    full_specs = args.full_scenarios.split(",") if args.full_scenarios else scenarios
    one_seed = [s for s in args.one_seed.split(",") if s]
    runs: list[dict[str, Any]] = []
    if args.from_runs:
        saved = json.loads(Path(args.from_runs).read_text())
        runs, load_start, started = saved["runs"], saved["load_start"], saved["started_utc"]
        seeds = sorted({r["seed"] for r in runs})
        sizes = sorted({r["ranks"] for r in runs})
        scenarios = list(dict.fromkeys(r["scenario"] for r in runs))
        steps = max(len(rec["step_s"]) for r in runs for rec in r["records"] if "step_s" in rec)
    with tempfile.TemporaryDirectory(prefix="aioready-e2e-scale-") as tmp:
        for S in sizes if not args.from_runs else ():
            t_cfg = args.torch.split(",") if args.torch else TORCH_ALL
            for spec in scenarios:
                full = S >= args.full_below and not args.quick and spec in full_specs
                a_cfg = (args.aioready.split(",") if args.aioready else
                         AIOREADY_FULL if full else AIOREADY_REDUCED)
                for seed in seeds[:1] if spec in one_seed else seeds:
                    run = run_one(spec=spec, ranks=S, seed=seed, task_ms=args.task_ms,
                                  warmup=args.warmup, steps=steps, aioready_configs=a_cfg,
                                  torch_configs=t_cfg, workdir=Path(tmp))
                    run["load_after"] = list(os.getloadavg())
                    runs.append(simulated(run))
                    print(f"[e2e_scale] S={S} {spec} seed {seed}: {run['wall_s']:.0f} s, "
                          f"load {run['load_after'][0]:.1f}", flush=True)
                    if args.runs_out:
                        Path(args.runs_out).write_text(json.dumps(
                            {"runs": runs, "load_start": load_start, "started_utc": started}))
    summary = summarize(runs)
    meta = {"task_ms": args.task_ms, "steps": steps, "warmup": args.warmup, "seeds": seeds,
            "sizes": sizes, "scenarios": scenarios, "load_start": load_start,
            "started_utc": started, "cores": os.cpu_count(),
            "load_end": runs[-1]["load_after"] if args.from_runs else list(os.getloadavg()),
            "quick": args.quick, "model": MODEL, "niceness": os.nice(0),
            "measured_by": args.measured_by if args.from_runs else None}
    RESULTS.mkdir(parents=True, exist_ok=True)
    shown = [("TEXT" if i and argv[i - 1] == "--measured-by" else a)  # said on the page
             for i, a in enumerate(argv or []) if a != "--scale"]
    cmd = " ".join(["python -m bench.e2e --scale", *shown])
    body = write_outputs(summary, runs, meta, RESULTS, args.name)
    write_result(args.name, body, cmd, load=load_start)
    return {"summary": summary, "runs": runs}


if __name__ == "__main__":
    main(sys.argv[1:])
