"""End to end, real processes: aioready (mpiexec, MPITransport) against torch.distributed.pipelining
(torchrun, gloo), same model, same microbatches, same injected task durations.

One duration trace per scenario is generated from a jitter spec and a seed (aioready.sim.variability)
for 8 layer groups of a small GPT-style model (F, B, W per group: TASK_MS/2 each, so a stage of
a 4-stage linear run has F = TASK_MS, B = 2 x TASK_MS unsplit). Every run maps the groups onto its
own placement (linear: 2 groups per stage; interleaved and V: 1 group per stage, 2 per rank) and
sleeps those durations inside the stage modules (aioready/testing/inject.py), so both runtimes see
exactly the same durations. A straggler term (`straggler:RANK:FACTOR`) slows the tasks of that
rank, whatever stages it holds in the run's placement.

Reported per config: median step time over the measured steps (first `--warmup` steps skipped;
step time = max over ranks after a barrier), the lower bound of the trace for that run's
placement (aioready.telemetry.bounds.lower_bound, median over steps), efficiency = lower bound / step time (median
over steps), and the CPU time each rank's process used per step (all its threads), and with a
byte-budget config (`hint/ready@memNx`) each rank's peak activation bytes. Writes
bench/results/e2e.md, e2e.json and e2e.png (`--out NAME`: NAME.md, .json, .png).

Run: python -m bench.e2e [--quick] [--scenarios none,multimodal:0.3:3] [--steps N]
     python -m bench.e2e --scale ...: S = 4, 8, 16 ranks, thin model, every torch schedule
     (bench/e2e_scale.py)
     python -m bench.e2e --sized ...: microbatch sizes known before the step, passed as
     step(costs=), 1F1B rows in the given and the "middle" order, auto (bench/e2e_sized.py)

`AIOREADY_E2E_DEVICE=inline` runs aioready's stage compute on the loop thread (InlineDevice)
instead of a worker thread. The launched processes inherit the environment, so aioready's
polling knobs can be tried as
`AIOREADY_SPIN_US=0 AIOREADY_PARK_US=3000 python -m bench.e2e` (progress.py; defaults otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from .common import RESULTS, median, write_result

__all__ = ["SCENARIOS", "AIOREADY_CONFIGS", "TORCH_CONFIGS", "generate_trace", "run_scenario",
           "summarize", "same_schedule", "main"]

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ["none", "lognormal:0.5", "multimodal:0.3:3", "straggler:1:1.5"]
AIOREADY_CONFIGS = [f"{h}/{m}" for h in ("gpipe", "1f1b", "zb-h1", "bfw", "interleaved-1f1b",
                                         "interleaved-zb", "zbv") for m in ("strict", "ready")]
# readiness needs slack to use (issue 5, bench/scaling): the same hints with more microbatches
# allowed in flight (memory for speed): bfw at 3S, zbv at twice its peak
AIOREADY_CONFIGS += ["bfw/ready@12", "zbv/ready@8"]
# both ready-mode policies at twice the hint's peak, and hint="auto" within 2x 1F1B's peak
AIOREADY_CONFIGS += ["1f1b/ready:greedy", "1f1b/ready@2x", "1f1b/ready:greedy@2x",
                     "auto/ready@2x"]
TORCH_CONFIGS = ["ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B",
                 "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble"]
QUICK_AIOREADY = ["1f1b/strict", "1f1b/ready", "zbv/ready", "bfw/ready@12"]
QUICK_TORCH = ["Schedule1F1B", "ScheduleZBVZeroBubble"]


def split_spec(spec: str) -> tuple[str, str]:
    """(jitter spec without straggler terms, 'RANK:FACTOR' or '')."""
    terms = [t.strip() for t in spec.split("+")]
    strag = [t for t in terms if t.split(":")[0] == "straggler"]
    rest = [t for t in terms if t.split(":")[0] != "straggler"]
    if len(strag) > 1:
        raise ValueError(f"one straggler term at most: {spec!r}")
    return "+".join(rest) or "none", (strag[0].split(":", 1)[1] if strag else "")


def generate_trace(spec: str, *, seed: int, groups: int, microbatches: int, steps: int,
                   task_ms: float, path: Path) -> None:
    """Write the group trace of `spec` (without its straggler term) as a trace CSV."""
    from aioready.placement import Placement
    from aioready.sim.traces import write_trace
    from aioready.sim.variability import BaseDurations, JitterModel

    jitter, _ = split_spec(spec)
    half = task_ms / 2
    model = JitterModel(jitter, seed=seed, placement=Placement(groups, groups, "linear"),
                        num_microbatches=microbatches, split_backward=True,
                        base=BaseDurations(f=half, b=2 * half, b_split=half, w=half))
    write_trace(path, model, steps=steps)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(cmd: list[str], timeout: float, log: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
    with open(log, "w") as out:
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=timeout, start_new_session=True)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"timed out after {timeout:.0f} s: {' '.join(cmd)}\n"
                               f"{log.read_text()[-3000:]}") from None
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {' '.join(cmd)}\n{log.read_text()[-3000:]}")


def mpiexec() -> str:
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else (shutil.which("mpiexec") or "mpiexec")


def run_scenario(spec: str, *, workdir: Path, ranks: int = 4, groups: int = 8,
                 microbatches: int = 8, task_ms: float = 20.0, warmup: int = 1, steps: int = 5,
                 seed: int = 0, aioready_configs: list[str], torch_configs: list[str],
                 model_args: list[str] | None = None, timeout: float = 900.0,
                 one_launch: bool = False, backends: tuple[str, ...] = ("mpi",),
                 sized: bool = False) -> dict[str, Any]:
    """Run both sides on one scenario; return the raw records and the trace path.

    Normally aioready runs under mpiexec and torch under torchrun, in separate processes;
    `one_launch` runs both, one after the other, in the same mpiexec-launched processes (gloo
    set up from the MPI ranks): half the start-up cost, for the test. `sized`: aioready's
    ranks are also told each step's microbatch sizes (bench/e2e_sized.py; the run's "sizes").
    """
    workdir.mkdir(parents=True, exist_ok=True)
    tag = spec.replace(":", "_").replace("+", "-")
    trace = workdir / f"trace-{tag}.csv"
    generate_trace(spec, seed=seed, groups=groups, microbatches=microbatches,
                   steps=warmup + steps, task_ms=task_ms, path=trace)
    _, straggler = split_spec(spec)
    common = ["--trace", str(trace), "--groups", str(groups), "--straggler", straggler,
              "--microbatches", str(microbatches), "--warmup", str(warmup), "--steps",
              str(steps), "--seed", str(seed), *(model_args or [])]
    out: dict[str, Any] = {"scenario": spec, "trace": str(trace), "records": []}
    if sized:
        from .e2e_sized import write_sizes
        sizes = workdir / f"sizes-{tag}.json"
        if not write_sizes(spec, seed=seed, groups=groups, microbatches=microbatches,
                           steps=warmup + steps, path=sizes):
            raise SystemExit(f"--sized: scenario {spec!r} has no per-microbatch sizes "
                             "(a multimodal term has)")
        common += ["--mb-sizes", str(sizes)]
        out["sizes"] = str(sizes)
    if one_launch:
        dest = workdir / f"both-{tag}.json"
        _launch([mpiexec(), "-n", str(ranks), sys.executable, "-m", "bench.e2e_worker", "both",
                 *common, "--configs", ",".join(aioready_configs), "--torch-configs",
                 ",".join(torch_configs), "--out", str(dest)], timeout,
                workdir / f"both-{tag}.log")
        out["records"] = json.loads(dest.read_text())["records"]
        return out
    for backend in backends if aioready_configs else ():
        dest = workdir / f"aioready-{backend}-{tag}.json"
        _launch([mpiexec(), "-n", str(ranks), sys.executable, "-m", "bench.e2e_worker",
                 "aioready", *common, "--configs", ",".join(aioready_configs), "--out",
                 str(dest), "--aioready-backend", backend], timeout,
                workdir / f"aioready-{backend}-{tag}.log")
        out["records"] += json.loads(dest.read_text())["records"]
    if torch_configs:
        dest = workdir / f"torch-{tag}.json"
        _launch([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
                 "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1",
                 "--master-port", str(_free_port()), "-m", "bench.e2e_worker", "torch", *common,
                 "--torch-configs", ",".join(torch_configs), "--out", str(dest)], timeout,
                workdir / f"torch-{tag}.log")
        out["records"] += json.loads(dest.read_text())["records"]
    return out


def summarize(run: dict[str, Any], *, groups: int, microbatches: int, warmup: int,
              ranks: int) -> dict[str, Any]:
    """Median step time, lower bound and efficiency of each record; best of each side."""
    from aioready.placement import Placement
    from aioready.sim.traces import read_trace
    from aioready.telemetry.bounds import lower_bound_table

    from .e2e_worker import RunShape, parse_straggler, stage_seconds

    trace = read_trace(run["trace"], placement=Placement(groups, groups, "linear"))
    straggler = parse_straggler(split_spec(run["scenario"])[1])
    rows = []
    for rec in run["records"]:
        shape = RunShape(Placement(rec["num_stages"], ranks, rec["style"]), groups,
                         rec["split_backward"])
        lbs = [lower_bound_table(shape.placement,
                                 stage_seconds(trace.table(warmup + i), shape, straggler),
                                 shape.split_backward) for i in range(len(rec["step_s"]))]
        effs = [lb / t for lb, t in zip(lbs, rec["step_s"])]
        rows.append(dict(rec, median_s=median(rec["step_s"]), lower_bound_s=median(lbs),
                         efficiency=median(effs)))
    best = {}
    for side in ("aioready", "torch"):
        mine = [r for r in rows if r["side"] == side]
        if mine:
            best[side] = min(mine, key=lambda r: r["median_s"])
    ratio = (best["torch"]["median_s"] / best["aioready"]["median_s"]
             if len(best) == 2 else None)
    return {"scenario": run["scenario"], "rows": rows, "best": best,
            "speedup_vs_torch": ratio, "microbatches": microbatches}


def _table(summary: dict[str, Any]) -> list[str]:
    held = any(any(b is not None for b in r.get("peak_activation_bytes") or ())
               for r in summary["rows"])
    lines = [f"### Scenario `{summary['scenario']}`", "",
             "| side | config | placement | split | median step ms | lower bound ms | "
             "efficiency | CPU ms per step per rank | loss |"
             + (" peak activation KiB, max rank (per rank) | byte budget KiB per rank |"
                if held else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|---|" if held else "")]
    for r in sorted(summary["rows"], key=lambda r: (r["side"], r["median_s"])):
        name = r["name"] + (f" (chose {r['chosen']})" if r.get("chosen") else "")
        lines.append(f"| {r['side']} | {name} | {r['style']} x{r['num_stages']} | "
                     f"{'yes' if r['split_backward'] else 'no'} | {r['median_s'] * 1e3:.1f} | "
                     f"{r['lower_bound_s'] * 1e3:.1f} | {r['efficiency']:.3f} | "
                     f"{_mean(r.get('cpu_s_per_step', [])) * 1e3:.1f} | {r['loss']:.6f} |"
                     + (_bytes_cells(r) if held else ""))
    return lines + [""]


def _bytes_cells(row: dict[str, Any]) -> str:
    """Peak activation bytes (measured on aioready's stages; torch's are not) and the byte
    budget each rank ended under, in KiB."""
    peaks = [b for b in row.get("peak_activation_bytes") or () if b is not None]
    budgets = [b for b in row.get("memory_bytes") or () if b is not None]
    peak = f"{max(peaks) / 1024:.0f} ({_kib(peaks)})" if peaks else "-"
    return f" {peak} | {_kib(budgets) or '-'} |"


def _kib(values: list[int]) -> str:
    return ", ".join(f"{v / 1024:.0f}" for v in values)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _plot(summaries: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(summaries), figsize=(4.5 * len(summaries), 4.5),
                             squeeze=False)
    for ax, s in zip(axes[0], summaries):
        rows = sorted(s["rows"], key=lambda r: (r["side"], r["median_s"]))
        names = [r["name"].replace("Schedule", "torch:") for r in rows]
        colors = ["tab:blue" if r["side"] == "aioready" else "tab:orange" for r in rows]
        ax.barh(names, [r["median_s"] * 1e3 for r in rows], color=colors)
        lb = min(r["lower_bound_s"] for r in rows) * 1e3
        ax.axvline(lb, color="k", ls="--", lw=1, label=f"lowest lower bound {lb:.0f} ms")
        ax.set_title(s["scenario"], fontsize=10)
        ax.set_xlabel("median step ms (blue aioready, orange torch)", fontsize=8)
        ax.tick_params(axis="y", labelsize=7)
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> dict[str, Any]:
    if "--scale" in (argv or []):  # the deep-pipeline mode: bench/e2e_scale.py
        from .e2e_scale import main as scale
        return scale(argv)
    if "--sized" in (argv or []):  # sizes known before the step: bench/e2e_sized.py
        from .e2e_sized import main as sized
        return sized(argv)
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="2 scenarios, 3 aioready and 2 torch configs, 2 measured steps")
    ap.add_argument("--scenarios", default=None, help="comma-separated jitter specs")
    ap.add_argument("--aioready", default=None, help="hint/mode,... (default: all)")
    ap.add_argument("--torch", default=None, help="schedule class names (default: all)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--task-ms", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    ap.add_argument("--backend", choices=("mpi", "gloo", "both"), default="mpi",
                    help="aioready's transport: MPI, torch.distributed gloo (rows '+gloo'), or "
                    "both side by side")
    ap.add_argument("--out", default="e2e",
                    help="results name: bench/results/NAME.md, .json and .png")
    ap.add_argument("--one-launch", action="store_true",
                    help="run torch in the aioready mpiexec processes instead of under torchrun")
    args = ap.parse_args(argv)
    scenarios = (args.scenarios.split(",") if args.scenarios else
                 ["none", "multimodal:0.3:3"] if args.quick else SCENARIOS)
    a_cfg = (args.aioready.split(",") if args.aioready is not None else
             QUICK_AIOREADY if args.quick else AIOREADY_CONFIGS)
    t_cfg = (args.torch.split(",") if args.torch is not None else
             QUICK_TORCH if args.quick else TORCH_CONFIGS)
    steps = args.steps or (2 if args.quick else 5)
    ranks, groups = 4, 8
    summaries = []
    load_start = list(os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="aioready-e2e-") as tmp:
        for spec in scenarios:
            run = run_scenario(spec, workdir=Path(tmp), ranks=ranks, groups=groups,
                               microbatches=args.microbatches, task_ms=args.task_ms,
                               warmup=args.warmup, steps=steps, seed=args.seed,
                               aioready_configs=[c for c in a_cfg if c],
                               torch_configs=[c for c in t_cfg if c], timeout=args.timeout,
                               one_launch=args.one_launch,
                               backends=("mpi", "gloo") if args.backend == "both"
                               else (args.backend,))
            summaries.append(summarize(run, groups=groups, microbatches=args.microbatches,
                                       warmup=args.warmup, ranks=ranks))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(
        {"summaries": summaries, "task_ms": args.task_ms, "steps": steps, "warmup": args.warmup,
         "microbatches": args.microbatches, "ranks": ranks, "quick": args.quick,
         "load_start": load_start, "load_end": list(os.getloadavg()), "cores": os.cpu_count()},
        indent=1))
    has_png = _plot(summaries, RESULTS / f"{args.out}.png")
    cmd = "python -m bench.e2e" + (" " + " ".join(argv) if argv else "")
    write_result(args.out, _body(summaries, args, steps, has_png), cmd, load=load_start)
    return {"summaries": summaries}


def _body(summaries: list[dict[str, Any]], args: argparse.Namespace, steps: int,
          has_png: bool) -> str:
    lines = [
        f"S=4 ranks, M={args.microbatches} microbatches, a GPT-style model of 8 layer groups "
        f"(dim 32, seq 16, 2 sequences per microbatch, float32). Injected durations per linear "
        f"stage: F = {args.task_ms:g} ms, B = W = {args.task_ms:g} ms split "
        f"(B = {2 * args.task_ms:g} ms unsplit), times the scenario's jitter. They are sleeps, "
        "and each task's real compute comes on top of its sleep, on both sides, so no run can "
        "reach efficiency 1 against the sleep-only lower bound (this run does not measure the "
        "compute alone: `--task-ms 0` does). "
        f"Median of {steps} measured steps after {args.warmup} warm-up step(s). "
        "aioready runs under mpiexec with MPITransport; torch.distributed.pipelining with gloo, "
        + ("in the same mpiexec-launched processes, after aioready." if args.one_launch else
           "under torchrun, in separate processes.") + " " + _knobs(), "",
        "## Summary", "",
        "| scenario | aioready best | ms | eff | torch best | ms | eff | torch best / aioready best |",
        "|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        a, t = s["best"].get("aioready"), s["best"].get("torch")
        cell = (lambda r: (f"{r['name']} | {r['median_s'] * 1e3:.1f} | {r['efficiency']:.3f}"
                           if r else "- | - | -"))
        ratio = f"{s['speedup_vs_torch']:.3f}x" if s["speedup_vs_torch"] else "-"
        lines.append(f"| `{s['scenario']}` | {cell(a)} | {cell(t)} | {ratio} |")
    lines.append("")
    if has_png:
        lines += [f"![median step times]({args.out}.png)", ""]
    lines += ["## Per config", "", "Efficiency = the trace's lower bound for that run's "
              "placement / measured step time (median over steps). CPU: process time (all "
              "threads) per measured step, mean over ranks: what each runtime costs on top of "
              "the sleeps. Loss: the same model and data on both sides.", ""]
    if any(r.get("peak_activation_bytes") for s in summaries for r in s["rows"]):
        lines += ["Peak activation KiB: the most bytes autograd kept for backward on each rank "
                  "in any measured step (measured on aioready's stages, on every aioready row "
                  "of a launch with a byte budget; torch's are not measured). Byte budget: "
                  "what each rank's gate held it to at the end (a `memNx` row; `Nx` alone "
                  "is a count of microbatches).", ""]
    for s in summaries:
        lines += _table(s)
    lines += _per_task(summaries, args.microbatches)
    lines += ["## Not run", "", _not_run(summaries)]
    return "\n".join(lines)


SAME_SCHEDULE = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                 "interleaved-1f1b": "ScheduleInterleaved1F1B",
                 "interleaved-zb": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble"}


def same_schedule(rows: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(aioready row, torch row) for each aioready config whose schedule torch ran, by name, at
    the schedule's own caps (a `@CAP` config holds other caps than torch's: it has no twin)."""
    torch_rows = {r["name"]: r for r in rows if r["side"] == "torch"}
    out = []
    for r in sorted(rows, key=lambda r: r["name"]):
        other = torch_rows.get(SAME_SCHEDULE.get(r["name"].split("/")[0], ""))
        if r["side"] == "aioready" and other is not None and "@" not in r["name"]:
            out.append((r, other))
    return out


def cpu_us_per_task(row: dict[str, Any], microbatches: int, ranks: int = 4,
                    beyond_compute: bool = False) -> float:
    """A rank's process CPU per step divided by the tasks it runs in a step (F, B and, split,
    W, for each chunk it holds): the runtime's CPU per task, on top of the same model compute
    on both sides (docs/hot_path_measurements.md "The quiet path's doorbells, and the measure
    checked"). `beyond_compute`: less that compute as measured on the rank
    (bench/e2e_compute.py); NaN for a record without it."""
    tasks = microbatches * (3 if row["split_backward"] else 2) * row["num_stages"] // ranks
    cpu = _mean(row.get("cpu_s_per_step", []))
    if beyond_compute:
        compute = row.get("compute_s_per_step")
        cpu = cpu - _mean(compute) if compute else float("nan")
    return cpu / tasks * 1e6


def _per_task(summaries: list[dict[str, Any]], microbatches: int) -> list[str]:
    """CPU per task, aioready against torch.distributed.pipelining on the same schedule."""
    lines = ["## CPU per task on the same schedule", "",
             "A rank's CPU per step / its tasks per step, in us (both sides run the same model "
             "compute, so the difference is the runtime's). Beyond compute: the same less the "
             "thread CPU measured inside the stage modules' forward, autograd's backward and "
             "grad and the loss, alike on both sides (bench/e2e_compute.py): what each runtime "
             "spends per task beyond the model.", "",
             "| scenario | schedule | aioready config | aioready us/task | torch us/task | "
             "aioready / torch | aioready beyond compute | torch beyond compute | "
             "aioready / torch beyond compute |", "|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        for r, other in same_schedule(s["rows"]):
            hint = r["name"].split("/")[0]
            a, t = cpu_us_per_task(r, microbatches), cpu_us_per_task(other, microbatches)
            ab = cpu_us_per_task(r, microbatches, beyond_compute=True)
            tb = cpu_us_per_task(other, microbatches, beyond_compute=True)
            if t:
                lines.append(f"| `{s['scenario']}` | {hint} | {r['name']} | {a:.0f} | "
                             f"{t:.0f} | {a / t:.2f} | {ab:.0f} | {tb:.0f} | {ab / tb:.2f} |")
    return lines + [""]


def _knobs() -> str:
    knobs = sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith("AIOREADY_"))
    return ("aioready's settings from the environment: " + ", ".join(knobs) + "." if knobs
            else "aioready runs with its default polling settings.")


def _not_run(summaries: list[dict[str, Any]]) -> str:
    ran = {r["name"] for s in summaries for r in s["rows"]}
    missing = [c for c in TORCH_CONFIGS + AIOREADY_CONFIGS if c not in ran]
    if not missing:
        return "Every configured schedule ran."
    return ("Not in this run (not selected, e.g. by --quick): " + ", ".join(missing) + ".")


if __name__ == "__main__":
    main(sys.argv[1:])
