"""Sized microbatches on real ranks: `python -m bench.e2e --sized`.

bench.e2e's multimodal scenario makes some microbatches FACTOR x heavier in every task (the
trace's sleeps), but no runtime was told which, so readiness could not place them: the
simulator's large multimodal gains come from ordering by a cost known before the step
(docs/policy.md "The microbatch order"). Here each step's sizes are written next to the trace
(`JitterModel.sizes`: FACTOR for a heavy microbatch, 1 otherwise, the same draw as the sleeps),
and every aioready rank passes them as `step(costs=...)`, as a data loader that knows its
microbatches' tokens or images would; the rows that can use them are a cost order
(`hint/mode+middle`) and hint="auto", which may choose one. The sleeps are the same on both
sides: the microbatch id travels with the data (aioready/testing/inject.py), so a reordered
microbatch sleeps its own durations, and torch's Schedule1F1B runs them in the given order.

The rows are side by side in each launch (one mpiexec for aioready, one torchrun for torch),
at 1F1B's memory and at twice it; `--launches` repeats the whole run for the median and the
spread. Writes bench/results/e2e_sized.md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

from .common import RESULTS, median, write_result

__all__ = ["SIZED_AIOREADY", "SIZED_TORCH", "split_order", "write_sizes", "read_sizes",
           "step_costs", "twin", "main"]

# at 1F1B's memory (its own caps), then at twice it; "+ORDER": the pipeline's microbatch_order
SIZED_AIOREADY = ["1f1b/strict", "1f1b/strict+middle", "1f1b/ready", "1f1b/ready+middle",
                  "1f1b/ready@2x", "1f1b/ready@2x+middle", "auto/ready@2x"]
SIZED_TORCH = ["Schedule1F1B"]


def split_order(config: str) -> tuple[str, str | None]:
    """'hint/mode[...]+ORDER' -> ('hint/mode[...]', ORDER); no suffix: None (the pipeline's
    default: the given order, or for hint auto an order it may choose)."""
    from aioready.schedulers.order import ORDERS

    rest, plus, order = config.partition("+")
    if not plus:
        return config, None
    if order not in ORDERS or rest.startswith("auto/"):
        raise SystemExit(f"bad aioready config {config!r}: expected hint/mode[...]+ORDER with "
                         f"ORDER one of {', '.join(ORDERS)} (auto chooses its own)")
    return rest, order


def write_sizes(spec: str, *, seed: int, groups: int, microbatches: int, steps: int,
                path: Path) -> bool:
    """Write each step's microbatch sizes of `spec` as JSON; False (nothing written) where the
    spec has no per-microbatch term."""
    from aioready.placement import Placement
    from aioready.sim.variability import JitterModel

    from .e2e import split_spec
    model = JitterModel(split_spec(spec)[0], seed=seed, num_microbatches=microbatches,
                        placement=Placement(groups, groups, "linear"))
    if model.sizes(0) is None:
        return False
    path.write_text(json.dumps({"spec": spec, "seed": seed, "sizes": [
        [float(v) for v in model.sizes(step)] for step in range(steps)]}))
    return True


def read_sizes(path: str | Path) -> list[list[float]]:
    return [list(map(float, row)) for row in json.loads(Path(path).read_text())["sizes"]]


def step_costs(sizes: Sequence[Sequence[float]] | None, step: int, pipe: Any
               ) -> list[float] | None:
    """The costs a rank passes to `pipe.step` in `step`: that step's sizes in the caller's
    microbatch order, where the pipeline uses them; else None."""
    if sizes is None or not pipe.takes_costs:
        return None
    return list(sizes[step])


def twin(configs: Sequence[str], spec: str, trace_path: str | Path,
         sizes: Sequence[Sequence[float]], *, groups: int, ranks: int, microbatches: int,
         warmup: int, steps: int) -> dict[str, tuple[float, str]]:
    """Each aioready row on the simulator's virtual clock, on the same sleeps of the measured
    steps and no compute: (median step seconds, what ran). The simulator's auto chooses on the
    very durations it is scored on (hindsight); the ranks' auto chose on step 0."""
    import numpy as np

    import aioready
    from aioready.placement import Placement
    from aioready.schedulers import HINTS
    from aioready.sim.traces import Trace, read_trace

    from .e2e import split_spec
    from .e2e_worker import AIOREADY_SPLIT, RunShape, parse_config, parse_straggler, stage_seconds
    group = read_trace(trace_path, placement=Placement(groups, groups, "linear"))
    straggler = parse_straggler(split_spec(spec)[1])
    measured = range(warmup, warmup + steps)
    out = {}
    for config in configs:
        base, order = split_order(config)
        hint, mode, policy, cap = parse_config(base)
        split, spec_ = AIOREADY_SPLIT[hint], HINTS["1f1b" if hint == "auto" else hint]
        shape = RunShape(Placement(ranks * spec_.chunks, ranks, spec_.style), groups, split)
        trace = Trace(np.stack([stage_seconds(group.table(s), shape, straggler) * 1e3
                                for s in measured]), placement=shape.placement,
                      split_backward=split, sizes=np.array([sizes[s] for s in measured]))
        r = aioready.simulate(stages=shape.placement.num_stages, ranks=ranks,
                              microbatches=microbatches, trace=trace, steps=steps,
                              hint="auto:1f1b" if hint == "auto" else hint, mode=mode,
                              policy=policy, cap=cap, split_backward=split, order=order)
        how = r.mode if r.mode == "strict" else f"{r.mode}/{r.policy}"
        label = r.hint if "+" in r.hint or r.order == "given" else f"{r.hint}+{r.order}"
        out[config] = (median(s.step_time for s in r.per_step) * 1e-3,
                       f"{label} {how} caps {list(r.cap)}")
    return out


# -- the run and its page -----------------------------------------------------------------------
def _aggregate(summaries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per config over the launches: the median of each launch's median step."""
    by_name: dict[str, list[dict[str, Any]]] = {}
    for s in summaries:
        for r in s["rows"]:
            by_name.setdefault(r["name"], []).append(r)
    rows = []
    for name, runs in by_name.items():
        steps = [r["median_s"] for r in runs]
        last = runs[-1]
        rows.append({"name": name, "side": last["side"], "launch_median_s": steps,
                     "median_s": median(steps), "min_s": min(steps), "max_s": max(steps),
                     "efficiency": median([r["efficiency"] for r in runs]),
                     "lower_bound_s": last["lower_bound_s"], "split": last["split_backward"],
                     "caps": [r.get("caps") for r in runs], "order": [r.get("order")
                                                                     for r in runs],
                     "chosen": [r.get("chosen") for r in runs],
                     "peak": [r["peak_activations"] for r in runs],
                     "loss": [r["loss"] for r in runs], "grad_sq": [r["grad_sq"] for r in runs]})
    return rows


def _memory(name: str) -> str:
    return "2x 1F1B" if "@2x" in name else "1F1B's"


def _cells(values: list[Any]) -> str:
    """One value if every launch agrees, else each launch's."""
    shown = [str(v) for v in values]
    return shown[0] if len(set(shown)) == 1 else " / ".join(shown)


def _loss_note(rows: list[dict[str, Any]]) -> str:
    """Whether reordering changed the step's loss: bitwise, or by how much and on which rows."""
    by_value: dict[float, list[str]] = {}
    for r in rows:
        for v in sorted(set(r["loss"])):
            by_value.setdefault(v, []).append(r["name"])
    grads = [v for r in rows for v in r["grad_sq"]]
    gspread = (max(grads) - min(grads)) / max(abs(g) for g in grads)
    if len(by_value) == 1:
        head = f"The loss is bitwise identical on every row and launch ({next(iter(by_value))!r})."
    else:
        values = sorted(by_value)
        head = ("The loss is not bitwise identical across rows: "
                + "; ".join(f"{v!r} on {', '.join(by_value[v])}" for v in values)
                + f" (largest difference {values[-1] - values[0]:.3g}, relative "
                f"{(values[-1] - values[0]) / abs(values[0]):.2g}: the same microbatch losses "
                "summed in another order, or by another runtime, in float32).")
    return (head + f" The squared gradient norm (summed over ranks) differs by at most "
            f"{gspread:.3g} relative across rows and launches.")


def _body(rows: list[dict[str, Any]], args: argparse.Namespace, launches: int,
          sizes: list[list[float]], load: list[list[float]]) -> str:
    strict = next((r for r in rows if r["name"] == "1f1b/strict"), None)
    heavy = sum(1 for row in sizes[args.warmup:] for v in row if v > 1)
    lines = [
        f"S=4 ranks, M={args.microbatches} microbatches, scenario `{args.scenario}` (seed "
        f"{args.seed}; {heavy} of {args.microbatches * args.steps} measured microbatches heavy), "
        f"the GPT-style model of bench.e2e (8 layer groups, dim 32, seq 16, 2 sequences per "
        f"microbatch, float32). Injected sleeps per linear stage: F = {args.task_ms:g} ms, "
        f"B = {2 * args.task_ms:g} ms unsplit (B = W = {args.task_ms:g} ms split), times the "
        "scenario's factor: a heavy microbatch sleeps FACTOR x in every task. Every aioready rank "
        "passes each step's sizes (FACTOR or 1 per microbatch) as `step(costs=...)` where the "
        "pipeline orders by them (`+middle` rows and auto); the sleeps follow the microbatch, "
        "whichever slot it runs in, on both sides. "
        f"{launches} launch{'es' if launches > 1 else ''}: each runs every aioready row in one "
        "mpiexec (MPITransport), then torch.distributed.pipelining's Schedule1F1B under torchrun "
        f"(gloo); per launch the median of {args.steps} measured steps after {args.warmup} "
        "warm-up steps (auto chooses after step 0 and runs its choice from step 1). Load average "
        "at each launch's start: " + "; ".join(" ".join(f"{x:.2f}" for x in la) for la in load)
        + ".", "",
        "| memory | config | split | caps per rank | peak in flight per rank | median step ms "
        "| launches (min-max) | vs 1f1b/strict | efficiency | auto chose | simulated ms "
        "| simulated vs strict |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    order = {n: i for i, n in enumerate(["1f1b/strict", "1f1b/strict+middle", "1f1b/ready",
                                         "1f1b/ready+middle", "Schedule1F1B"])}
    for r in sorted(rows, key=lambda r: ("@2x" in r["name"], order.get(r["name"], 9),
                                         r["name"])):
        caps = ("its schedule's" if r["side"] == "torch" else _cells(r["caps"]))
        peak = _cells([[round(p, 2) for p in per] for per in r["peak"]])
        vs = f"{strict['median_s'] / r['median_s']:.3f}x" if strict else "-"
        chose = _cells(r["chosen"]) if any(r["chosen"]) else ""
        sim = "| - | -"
        if "twin_s" in r:
            base = strict["twin_s"] if strict and "twin_s" in strict else None
            sim = f"| {r['twin_s'] * 1e3:.1f} | " + (f"{base / r['twin_s']:.3f}x" if base
                                                     else "-")
            sim += f" ({r['twin_ran']})" if r["name"].startswith("auto") else ""
        lines.append(f"| {_memory(r['name'])} | {r['name']} ({r['side']}) | "
                     f"{'yes' if r['split'] else 'no'} | {caps} | {peak} | "
                     f"{r['median_s'] * 1e3:.1f} | {r['min_s'] * 1e3:.1f}-{r['max_s'] * 1e3:.1f} "
                     f"| {vs} | {r['efficiency']:.3f} | {chose} {sim} |")
    lines += ["", "vs 1f1b/strict: its median step time / the row's (>1: faster). Peak in flight: "
              "(stage, microbatch) pairs a rank held at once, counted by the injector where "
              "both runtimes run them, in linear-stage microbatches (the same count for both "
              "sides). Efficiency: the trace's lower bound for the row's placement / its step "
              "time (sleeps only: the model's compute comes on top on both sides). Simulated: "
              "the row on the simulator's virtual clock on the same sleeps of the measured "
              "steps, no compute (`twin`); its auto chooses on those very durations (hindsight, "
              "and what it ran is in brackets), the ranks' auto chose on the times it measured "
              "in step 0, compute included.", "",
              _loss_note(rows), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from .e2e import run_scenario, summarize

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sized", action="store_true", help="(accepted: `bench.e2e --sized`)")
    ap.add_argument("--scenario", default="multimodal:0.3:3")
    ap.add_argument("--aioready", default=",".join(SIZED_AIOREADY))
    ap.add_argument("--torch", default=",".join(SIZED_TORCH))
    ap.add_argument("--microbatches", type=int, default=16)
    ap.add_argument("--task-ms", type=float, default=20.0)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--launches", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    ap.add_argument("--name", default="e2e_sized", help="write bench/results/NAME.md and .json")
    args = ap.parse_args(argv)
    ranks, groups = 4, 8
    configs = [c for c in args.aioready.split(",") if c]
    summaries, loads = [], []
    with tempfile.TemporaryDirectory(prefix="aioready-e2e-sized-") as tmp:
        for launch in range(args.launches):
            loads.append(list(os.getloadavg()))
            run = run_scenario(args.scenario, workdir=Path(tmp) / str(launch), ranks=ranks,
                               groups=groups, microbatches=args.microbatches,
                               task_ms=args.task_ms, warmup=args.warmup, steps=args.steps,
                               seed=args.seed, aioready_configs=configs,
                               torch_configs=[c for c in args.torch.split(",") if c],
                               timeout=args.timeout, sized=True)
            sizes = read_sizes(run["sizes"])
            summaries.append(summarize(run, groups=groups, microbatches=args.microbatches,
                                       warmup=args.warmup, ranks=ranks))
            print(f"[e2e_sized] launch {launch + 1}/{args.launches} done", file=sys.stderr)
        sim = twin(configs, args.scenario, run["trace"],
                   sizes, groups=groups, ranks=ranks, microbatches=args.microbatches,
                   warmup=args.warmup, steps=args.steps)
    rows = _aggregate(summaries)
    for r in rows:
        if r["name"] in sim:
            r["twin_s"], r["twin_ran"] = sim[r["name"]]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(
        {"scenario": args.scenario, "seed": args.seed, "microbatches": args.microbatches,
         "task_ms": args.task_ms, "steps": args.steps, "warmup": args.warmup, "ranks": ranks,
         "launches": args.launches, "loads": loads, "sizes": sizes, "rows": rows,
         "summaries": summaries, "cores": os.cpu_count(),
         "spread_note": "launch_median_s: each launch's median step, seconds"}, indent=1))
    cmd = " ".join(["python -m bench.e2e --sized", *[a for a in argv or [] if a != "--sized"]])
    write_result(args.name, _body(rows, args, args.launches, sizes, loads), cmd, load=loads[0])
    return {"rows": rows}


if __name__ == "__main__":
    main(sys.argv[1:])
