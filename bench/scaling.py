"""Scaling of readiness-first over fixed-order execution, simulated with the real runtime.

For S stages (one per rank), M = 4S microbatches, jitter `lognormal:0.5` and `multimodal:0.3:3`,
and several seeds, each configuration runs on the virtual clock (aioready.simulate):

  strict 1f1b         the fixed-order baseline (unsplit backward, F=1 B=2)
  ready 1f1b          readiness-first with the 1F1B hint and its own cap (the 1F1B peak)
  ready 1f1b cap 2x   the same with twice the 1F1B peak in flight (memory for speed)
  strict bfw          the BFW rule's derived sequence, split backward (F=B=W=1)
  ready bfw           readiness-first with the BFW rule, its default cap (its sequence's peak
                      on each rank: twice the 1F1B peak of that rank)
  ready bfw cap 2S    the same with 2S on every rank (twice the largest 1F1B peak, rank 0's)
  ready bfw cap 3S    the same with 3S on every rank
  ready bfw cap M     the same with every microbatch allowed in flight (GPipe's memory)

Reported: the median over seeds of each configuration's efficiency (lower bound / step time) and
of the per-seed speedups (baseline step time / step time). The BFW rows need the `bfw` hint
(issue 3's hint library); without it they are left out and the table says so.

Run: python -m bench.scaling [--quick] [--stages 4,8,...] [--seeds N] [--jobs N] [--timing]
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from functools import lru_cache
from typing import Any

from aioready.hints import HintOrder
from aioready.schedulers import HINTS, make_hint
from aioready.sim.simulator import simulate

from .common import RESULTS, write_result

JITTERS = ("lognormal:0.5", "multimodal:0.3:3")
BFW = "bfw" in HINTS


def configs(M: int) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {
        "strict 1f1b": dict(hint="1f1b", mode="strict"),
        "ready 1f1b": dict(hint="1f1b", mode="ready"),
        "ready 1f1b cap 2x": dict(hint="1f1b", mode="ready", cap="2x"),
    }
    if BFW:
        out["strict bfw"] = dict(hint="bfw", mode="strict", split_backward=True)
        out["ready bfw"] = dict(hint="bfw", mode="ready", split_backward=True)
        S = M // 4
        out["ready bfw cap 2S"] = dict(hint="bfw", mode="ready", split_backward=True, cap=2 * S)
        out["ready bfw cap 3S"] = dict(hint="bfw", mode="ready", split_backward=True, cap=3 * S)
        out["ready bfw cap M"] = dict(hint="bfw", mode="ready", split_backward=True, cap=M)
    return out


SPEEDUPS = [  # (label, configuration, baseline)
    ("ready/strict 1f1b", "ready 1f1b", "strict 1f1b"),
    ("ready 1f1b cap 2x / strict 1f1b", "ready 1f1b cap 2x", "strict 1f1b"),
    ("ready/strict bfw", "ready bfw", "strict bfw"),
    ("ready bfw / strict 1f1b", "ready bfw", "strict 1f1b"),
    ("ready bfw cap 2S / strict 1f1b", "ready bfw cap 2S", "strict 1f1b"),
    ("ready bfw cap 3S / strict 1f1b", "ready bfw cap 3S", "strict 1f1b"),
    ("ready bfw cap M / strict 1f1b", "ready bfw cap M", "strict 1f1b"),
]


@lru_cache(maxsize=None)
def hint(name: str, S: int, M: int, split: bool) -> HintOrder:
    """Built once per process: a rule's derived strict sequence costs seconds at S=128."""
    return make_hint(name, num_stages=S, num_microbatches=M, split_backward=split)


def one_seed(S: int, jitter: str, seed: int, only: tuple[str, ...] = ()) -> dict[str, Any]:
    """Every configuration (or those in `only`) for one (S, jitter, seed)."""
    M = 4 * S
    row: dict[str, Any] = {}
    for name, kw in configs(M).items():
        if only and name not in only:
            continue
        kw = {**kw, "hint": hint(kw["hint"], S, M, kw.get("split_backward", False))}
        cpu = time.process_time()
        r = simulate(stages=S, microbatches=M, jitter=jitter, seed=seed, **kw)
        row[name] = {"step_time": r.step_time, "efficiency": r.efficiency,
                     "cap0": r.cap[0], "peak0": r.peak_in_flight[0],
                     "cpu_s": time.process_time() - cpu, "num_tasks": r.num_tasks}
    return row


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    names = list(rows[0])
    out: dict[str, Any] = {"seeds": len(rows), "efficiency": {n: statistics.median(r[n]["efficiency"] for r in rows)
                                          for n in names},
                           "cap0": {n: rows[0][n]["cap0"] for n in names}, "speedup": {},
                           "cpu_s": {n: statistics.median(r[n]["cpu_s"] for r in rows)
                                     for n in names},
                           "num_tasks": {n: rows[0][n]["num_tasks"] for n in names}}
    for label, a, b in SPEEDUPS:
        if a in rows[0] and b in rows[0]:
            out["speedup"][label] = statistics.median(
                r[b]["step_time"] / r[a]["step_time"] for r in rows)
    return out


def _order(results: dict[str, dict[str, Any]]) -> list[str]:
    return sorted(results, key=lambda k: (JITTERS.index(k.rsplit("@", 1)[0]),
                                          int(k.rsplit("@", 1)[1])))


def table(results: dict[str, dict[str, Any]]) -> str:
    keys = _order(results)
    first = max(results.values(), key=lambda r: len(r["efficiency"]))
    names = list(first["efficiency"])
    lines = ["## Median efficiency (lower bound / step time) over seeds, M = 4S", "",
             "| jitter | S | seeds | " + " | ".join(names) + " |",
             "|---|---|---|" + "---|" * len(names)]
    for key in keys:
        res = results[key]
        jitter, S = key.rsplit("@", 1)
        lines.append(f"| {jitter} | {S} | {res['seeds']} | " + " | ".join(
            f"{res['efficiency'][n]:.3f}" if n in res["efficiency"] else "-"
            for n in names) + " |")
    labels = list(first["speedup"])
    lines += ["", "## Median speedup (baseline step time / step time, per seed)", "",
              "| jitter | S | seeds | " + " | ".join(labels) + " |",
              "|---|---|---|" + "---|" * len(labels)]
    for key in keys:
        res = results[key]
        jitter, S = key.rsplit("@", 1)
        lines.append(f"| {jitter} | {S} | {res['seeds']} | " + " | ".join(
            f"{res['speedup'][n]:.3f}x" if n in res["speedup"] else "-"
            for n in labels) + " |")
    full = [k for k in keys if results[k]["efficiency"].keys() == first["efficiency"].keys()]
    lines += ["", f"Cap on rank 0 (the largest), at S={full[0].rsplit('@', 1)[1]}: " + ", ".join(
        f"{n}: {c}" for n, c in results[full[0]]["cap0"].items()) + ".",
        "", "`-`: not run at that size (to fit the time on a shared 2-core machine)."]
    costly = [k for k in keys if "cpu_s" in results[k]]
    if costly:
        top = max(int(k.rsplit("@", 1)[1]) for k in costly)
        lines += ["", f"## Simulator cost at S={top}, M={4 * top}: median CPU seconds of one "
                  "simulated step (the hint built beforehand; wall time on this shared machine was "
                  "several times longer)", "", "| jitter | configuration | tasks | CPU s |",
                  "|---|---|---|---|"]
        for k in costly:
            if int(k.rsplit("@", 1)[1]) == top:
                for n, v in results[k]["cpu_s"].items():
                    lines.append(f"| {k.rsplit('@', 1)[0]} | {n} | "
                                 f"{results[k]['num_tasks'][n]} | {v:.1f} |")
    commands = sorted({results[k].get("command", "?") for k in keys})
    lines += ["", "Rows made by: " + "; ".join(f"`{c}`" for c in commands) + "."]
    if not BFW:
        lines += ["", "The `bfw` hint is not in this checkout's hint registry: BFW rows omitted."]
    return "\n".join(lines)


def plot(results: dict[str, dict[str, Any]], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, len(JITTERS), figsize=(12, 8), squeeze=False)
    for col, jitter in enumerate(JITTERS):
        keys = [k for k in _order(results) if k.rsplit("@", 1)[0] == jitter]
        xs = [int(k.rsplit("@", 1)[1]) for k in keys]
        if not keys:
            continue
        for row, what in ((0, "efficiency"), (1, "speedup")):
            for name in results[keys[0]][what]:
                pts = [(x, results[k][what][name]) for x, k in zip(xs, keys)
                       if name in results[k][what]]
                axes[row][col].plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=name)
        axes[0][col].axhline(0.9, color="grey", ls=":", lw=1)
        axes[1][col].axhline(1.0, color="grey", ls=":", lw=1)
        axes[0][col].set_title(f"{jitter}: efficiency")
        axes[1][col].set_title(f"{jitter}: speedup")
        for row in (0, 1):
            axes[row][col].set_xscale("log", base=2)
            axes[row][col].set_xlabel("stages S (M = 4S)")
    axes[0][0].legend(fontsize=8)
    axes[1][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def timing(jobs: int) -> str:
    """Wall and CPU seconds of one simulated step at S=128, M=512."""
    lines = ["## Simulator speed: one step, S=128, M=512, lognormal:0.5, seed 0", "",
             "| hint | mode | tasks | wall s | CPU s |", "|---|---|---|---|---|"]
    cases = [("1f1b", "strict", False), ("1f1b", "ready", False)]
    if BFW:
        cases.append(("bfw", "ready", True))
    for hint, mode, split in cases:
        wall, cpu = time.perf_counter(), time.process_time()
        r = simulate(stages=128, microbatches=512, hint=hint, mode=mode, jitter="lognormal:0.5",
                     seed=0, split_backward=split)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        lines.append(f"| {hint} | {mode} | {r.num_tasks} | {wall:.1f} | {cpu:.1f} |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="S up to 16, 3 seeds")
    ap.add_argument("--stages", default=None, help="comma-separated S values")
    ap.add_argument("--seeds", type=int, default=None, help="seeds per point (default 10)")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes")
    ap.add_argument("--timing", action="store_true", help="also time S=128, M=512")
    ap.add_argument("--only", default="", help="comma-separated configuration names to run")
    ap.add_argument("--append", action="store_true",
                    help="merge into bench/results/scaling.json (points run again are replaced)")
    args = ap.parse_args(argv)
    stages = [int(s) for s in args.stages.split(",")] if args.stages else (
        [4, 8, 16] if args.quick else [4, 8, 16, 32, 64, 128])
    seeds = args.seeds or (3 if args.quick else 10)
    cmd = shlex.join(["python", "-m", "bench.scaling",
                      *(argv if argv is not None else sys.argv[1:])])
    store = RESULTS / "scaling.json"
    results: dict[str, dict[str, Any]] = (json.loads(store.read_text())
                                          if args.append and store.exists() else {})
    body = ""
    with ProcessPoolExecutor(args.jobs) as pool:
        only = tuple(n.strip() for n in args.only.split(",") if n.strip())
        for S in stages:
            began = time.perf_counter()
            pairs = [(j, seed) for j in JITTERS for seed in range(seeds)]
            rows = list(pool.map(one_seed, [S] * len(pairs), [p[0] for p in pairs],
                                 [p[1] for p in pairs], [only] * len(pairs)))
            for jitter in JITTERS:
                mine = [r for r, p in zip(rows, pairs) if p[0] == jitter]
                results[f"{jitter}@{S}"] = {**summarise(mine), "command": cmd}
            print(f"S={S}: {time.perf_counter() - began:.1f} s", flush=True)
            if args.append and store.exists():  # another run may have written meanwhile
                results = {**json.loads(store.read_text()), **results}
            body = table(results)
            store.write_text(json.dumps(results, indent=1) + "\n")
            write_result("scaling", body + "\n\n![scaling](scaling.png)\n", cmd)
            plot(results, str(RESULTS / "scaling.png"))
    if args.timing:
        body += "\n\n" + timing(args.jobs)
        write_result("scaling", body + "\n\n![scaling](scaling.png)\n", cmd)
    print(body)
    return body


if __name__ == "__main__":
    main()
