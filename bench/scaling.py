"""Scaling of readiness-first over fixed-order execution, simulated with the real runtime.

For S stages (one per rank), M = 4S microbatches, jitter `lognormal:0.5` and `multimodal:0.3:3`,
and several seeds, each configuration runs on the virtual clock (aioready.simulate):

  strict 1f1b         the fixed-order baseline (unsplit backward, F=1 B=2)
  ready 1f1b          readiness-first with the 1F1B hint and its own cap (the 1F1B peak)
  ready 1f1b cap 2x   the same with twice the 1F1B peak in flight (memory for speed)
  strict bfw          the BFW rule's derived sequence, split backward (F=B=W=1)
  ready bfw           readiness-first with the BFW rule, its default cap (its sequence's peak)
  ready bfw cap M     the same with every microbatch allowed in flight (GPipe's memory)

Reported: the median over seeds of each configuration's efficiency (lower bound / step time) and
of the per-seed speedups (baseline step time / step time). The BFW rows need the `bfw` hint
(issue 3's hint library); without it they are left out and the table says so.

Run: python -m bench.scaling [--quick] [--stages 4,8,...] [--seeds N] [--jobs N] [--timing]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from functools import lru_cache
from typing import Any

from aioready.hints import HintOrder
from aioready.schedulers import HINTS, make_hint
from aioready.sim import simulate

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
        out["ready bfw cap M"] = dict(hint="bfw", mode="ready", split_backward=True, cap=M)
    return out


SPEEDUPS = [  # (label, configuration, baseline)
    ("ready/strict 1f1b", "ready 1f1b", "strict 1f1b"),
    ("ready 1f1b cap 2x / strict 1f1b", "ready 1f1b cap 2x", "strict 1f1b"),
    ("ready/strict bfw", "ready bfw", "strict bfw"),
    ("ready bfw / strict 1f1b", "ready bfw", "strict 1f1b"),
    ("ready bfw cap M / strict 1f1b", "ready bfw cap M", "strict 1f1b"),
]


@lru_cache(maxsize=None)
def hint(name: str, S: int, M: int, split: bool) -> HintOrder:
    """Built once per process: a rule's derived strict sequence costs seconds at S=128."""
    return make_hint(name, num_stages=S, num_microbatches=M, split_backward=split)


def one_seed(S: int, jitter: str, seed: int) -> dict[str, Any]:
    """Every configuration for one (S, jitter, seed): step time, efficiency, caps."""
    M = 4 * S
    row: dict[str, Any] = {}
    for name, kw in configs(M).items():
        kw = {**kw, "hint": hint(kw["hint"], S, M, kw.get("split_backward", False))}
        r = simulate(stages=S, microbatches=M, jitter=jitter, seed=seed, **kw)
        row[name] = {"step_time": r.step_time, "efficiency": r.efficiency,
                     "cap0": r.cap[0], "peak0": r.peak_in_flight[0]}
    return row


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    names = list(rows[0])
    out: dict[str, Any] = {"seeds": len(rows), "efficiency": {n: statistics.median(r[n]["efficiency"] for r in rows)
                                          for n in names},
                           "cap0": {n: rows[0][n]["cap0"] for n in names}, "speedup": {}}
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
    first = results[keys[-1]]
    names = list(first["efficiency"])
    lines = ["## Median efficiency (lower bound / step time) over seeds, M = 4S", "",
             "| jitter | S | seeds | " + " | ".join(names) + " |",
             "|---|---|---|" + "---|" * len(names)]
    for key in keys:
        res = results[key]
        jitter, S = key.rsplit("@", 1)
        lines.append(f"| {jitter} | {S} | {res['seeds']} | " + " | ".join(
            f"{res['efficiency'][n]:.3f}" for n in names) + " |")
    labels = list(first["speedup"])
    lines += ["", "## Median speedup (baseline step time / step time, per seed)", "",
              "| jitter | S | seeds | " + " | ".join(labels) + " |",
              "|---|---|---|" + "---|" * len(labels)]
    for key in keys:
        res = results[key]
        jitter, S = key.rsplit("@", 1)
        lines.append(f"| {jitter} | {S} | {res['seeds']} | " + " | ".join(
            f"{res['speedup'][n]:.3f}x" for n in labels) + " |")
    lines += ["", "Cap on rank 0 (the largest): " + ", ".join(
        f"{n}: {c}" for n, c in first["cap0"].items()) + f" (at S={keys[-1].rsplit('@', 1)[1]})."]
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
        for name in results[keys[0]]["efficiency"]:
            axes[0][col].plot(xs, [results[k]["efficiency"][name] for k in keys], "o-",
                              label=name)
        for name in results[keys[0]]["speedup"]:
            axes[1][col].plot(xs, [results[k]["speedup"][name] for k in keys], "o-", label=name)
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
    ap.add_argument("--append", action="store_true",
                    help="merge into bench/results/scaling.json (points run again are replaced)")
    args = ap.parse_args(argv)
    stages = [int(s) for s in args.stages.split(",")] if args.stages else (
        [4, 8, 16] if args.quick else [4, 8, 16, 32, 64, 128])
    seeds = args.seeds or (3 if args.quick else 10)
    cmd = "python -m bench.scaling" + "".join(
        f" {a}" for a in (argv if argv is not None else __import__("sys").argv[1:]))
    store = RESULTS / "scaling.json"
    results: dict[str, dict[str, Any]] = (json.loads(store.read_text())
                                          if args.append and store.exists() else {})
    body = ""
    with ProcessPoolExecutor(args.jobs) as pool:
        for S in stages:
            for jitter in JITTERS:
                began = time.perf_counter()
                rows = list(pool.map(one_seed, [S] * seeds, [jitter] * seeds, range(seeds)))
                results[f"{jitter}@{S}"] = {**summarise(rows), "command": cmd}
                print(f"S={S} {jitter}: {time.perf_counter() - began:.1f} s", flush=True)
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
