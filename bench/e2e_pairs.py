"""CPU per task, aioready against torch.distributed.pipelining on the same schedule, measured in
launch pairs.

bench.e2e runs one aioready launch (mpiexec) and then one torch launch (torchrun) and divides one
side's CPU per task by the other's. On a shared host that ratio follows the load of the moment:
over ten quiet runs torch's own figure moved by more than a third while the code did not change.
Here each pair runs the two launches back to back, the order swapped every pair (pair 0 aioready
first, pair 1 torch first, ...), so a drift in the load falls on both sides alike and on each
side first as often as second; the figure is the per-pair ratio, with its median and spread, not
a ratio of two separate runs. The launches, the records and the per-task arithmetic are
bench.e2e's own (`run_scenario`, `summarize`, `cpu_us_per_task`, `same_schedule`).

Run: python -m bench.e2e_pairs [--pairs 8] [--steps 8] [--scenarios none]
       [--aioready 1f1b/ready,1f1b/strict,zbv/strict] [--torch Schedule1F1B,ScheduleZBVZeroBubble]
Writes bench/results/NAME.md and NAME.json (`--out NAME`, default e2e_pairs). Not part of
`python -m bench all`: the default size is about a minute of both launches per pair.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

from . import common
from .e2e import SCENARIOS, cpu_us_per_task, run_scenario, same_schedule, summarize

__all__ = ["SIDES", "order_of", "pair_ratios", "config_stats", "page", "run_pairs", "main"]

SIDES = ("aioready", "torch")
RANKS, GROUPS = 4, 8
TIMEOUT_S = 7200.0  # the runner's limit when named (`python -m bench e2e_pairs`)


def order_of(pair: int) -> tuple[str, str]:
    """The launch order of pair `pair`: aioready first in even pairs, torch first in odd ones."""
    return SIDES if pair % 2 == 0 else SIDES[::-1]


def pair_ratios(rows: list[dict[str, Any]], microbatches: int,
                ranks: int = RANKS) -> list[dict[str, Any]]:
    """One pair's figures: per aioready config with a same-schedule torch row, each side's us
    per task (plain and beyond compute) and aioready / torch of both, from this pair's rows."""
    out = []
    for a_row, t_row in same_schedule(rows):
        a, t = (cpu_us_per_task(r, microbatches, ranks) for r in (a_row, t_row))
        ab, tb = (cpu_us_per_task(r, microbatches, ranks, beyond_compute=True)
                  for r in (a_row, t_row))
        out.append({"config": a_row["name"], "torch": t_row["name"], "aioready_us": a,
                    "torch_us": t, "ratio": a / t, "aioready_beyond_us": ab,
                    "torch_beyond_us": tb, "ratio_beyond": ab / tb,
                    "caps": a_row.get("caps"), "peak_activations": {
                        "aioready": a_row.get("peak_activations"),
                        "torch": t_row.get("peak_activations")}})
    return out


COLUMNS = ("aioready_us", "torch_us", "ratio", "aioready_beyond_us", "torch_beyond_us",
           "ratio_beyond")


def spread(xs: list[float]) -> dict[str, float]:
    return {"median": common.median(xs), "min": min(xs), "max": max(xs)}


def config_stats(pairs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (scenario, config): each column's median [min-max] over the pairs, how many pairs
    have aioready at or below torch (ratio <= 1.00, plain and beyond compute), and the median
    ratio beyond compute of the pairs each side went first in (a gap between the two says the
    launch order itself moves the figure)."""
    by: dict[tuple[str, str], list[tuple[str, dict[str, Any]]]] = {}
    for p in pairs:
        for fig in p["figures"]:
            by.setdefault((p["scenario"], fig["config"]), []).append((p["order"][0], fig))
    out = []
    for (scenario, config), firsts_figs in by.items():
        figs = [f for _, f in firsts_figs]
        first = {side: [f["ratio_beyond"] for s, f in firsts_figs if s == side] for side in SIDES}
        out.append({"scenario": scenario, "config": config, "torch": figs[0]["torch"],
                    "pairs": len(figs), **{c: spread([f[c] for f in figs]) for c in COLUMNS},
                    "at_or_below": sum(f["ratio"] <= 1.0 for f in figs),
                    "at_or_below_beyond": sum(f["ratio_beyond"] <= 1.0 for f in figs),
                    "beyond_by_first": {side: common.median(xs) if xs else None
                                        for side, xs in first.items()}})
    return out


def _cell(s: dict[str, float], fmt: str) -> str:
    return f"{s['median']:{fmt}} [{s['min']:{fmt}}-{s['max']:{fmt}}]"


def _config_table(data: dict[str, Any], st: dict[str, Any]) -> list[str]:
    """One config's pairs, then the median [min-max] of each column."""
    lines = [f"### `{st['scenario']}`: {st['config']} against {st['torch']}", "",
             "| pair | first | aioready us/task | torch us/task | aioready / torch | "
             "aioready beyond compute | torch beyond compute | aioready / torch beyond compute |",
             "|---|---|---|---|---|---|---|---|"]
    for p in data["pairs"]:
        for f in p["figures"]:
            if p["scenario"] == st["scenario"] and f["config"] == st["config"]:
                lines.append(f"| {p['pair']} | {p['order'][0]} | {f['aioready_us']:.0f} | "
                             f"{f['torch_us']:.0f} | {f['ratio']:.2f} | "
                             f"{f['aioready_beyond_us']:.0f} | {f['torch_beyond_us']:.0f} | "
                             f"{f['ratio_beyond']:.2f} |")
    lines.append("| median [min-max] | | " + " | ".join(
        _cell(st[c], ".2f" if c.startswith("ratio") else ".0f") for c in COLUMNS) + " |")
    return lines + ["", f"Pairs at or below 1.00: {st['at_or_below']} of {st['pairs']} "
                    f"(plain), {st['at_or_below_beyond']} of {st['pairs']} (beyond compute).", ""]


def _memory(data: dict[str, Any]) -> list[str]:
    """What each compared config held: its caps and the peak activations measured per rank."""
    lines = ["| scenario | config | aioready caps, rank by rank | aioready peak "
             "activations per rank | torch schedule | torch peak activations per rank |",
             "|---|---|---|---|---|---|"]
    seen = set()
    for p in data["pairs"]:
        for f in p["figures"]:
            if (p["scenario"], f["config"]) in seen:
                continue
            seen.add((p["scenario"], f["config"]))
            peak = f["peak_activations"]
            lines.append(f"| `{p['scenario']}` | {f['config']} | {f['caps'] or '-'} | "
                         f"{_peaks(peak['aioready'])} | {f['torch']} | {_peaks(peak['torch'])} |")
    return lines + [""]


def _peaks(values: list[float | None] | None) -> str:
    return ", ".join("-" if v is None else f"{v:g}" for v in values) if values else "-"


def _done(data: dict[str, Any]) -> str:
    done = len({p["pair"] for p in data["pairs"]})
    return str(done) if done == data["pairs_asked"] else (
        f"{done} of the {data['pairs_asked']} asked (the run stopped or is still going)")


def page(data: dict[str, Any]) -> str:
    """The results page: set-up, launches with their load, per-config pairs, summary, gaps."""
    lines = [
        f"S={data['ranks']} ranks, M={data['microbatches']} microbatches, bench.e2e's GPT-style "
        f"model of {data['groups']} layer groups, injected F = {data['task_ms']:g} ms per linear "
        f"stage (B = 2F, or B = W = F split), scenario(s) {data['scenarios']}. "
        f"{_done(data)} launch pairs: each pair runs one aioready "
        f"launch (mpiexec, MPITransport; {data['aioready']}) and one "
        f"torch.distributed.pipelining launch (torchrun, gloo; {data['torch']}) back to back, "
        "pair 0 aioready first, the order swapped every pair. Each launch: "
        f"{data['warmup']} warm-up step(s), then {data['steps']} measured steps per config.", "",
        "us/task: a rank's process CPU (all threads) per measured step divided by its tasks per "
        "step, mean over ranks, as bench.e2e's \"CPU per task on the same schedule\". Beyond "
        "compute: the same less the thread CPU measured inside the model's forward, backward "
        "and loss, alike on both sides. Ratio: aioready / torch within one pair; at or below "
        "1.00, aioready spent no more CPU per task than torch in that pair. The last column of "
        "the summary splits the pairs by which side went first.", "",
        "Memory: every row runs at its schedule's own caps (aioready's caps are the hint's, "
        "torch's are its schedule's; no `@CAP` config is compared). Peak activations: the most "
        "activations a rank held at once, in linear-stage microbatches, as measured in the "
        "first pair.", ""]
    lines += _memory(data)
    lines += ["## Summary", "",
              "| scenario | config | torch | pairs | aioready / torch, median [min-max] | "
              "at or below 1.00 | beyond compute, median [min-max] | at or below 1.00 | "
              "beyond compute, aioready first; torch first |",
              "|---|---|---|---|---|---|---|---|---|"]
    for st in data["configs"]:
        by_first = "; ".join("-" if x is None else f"{x:.2f}"
                             for x in (st["beyond_by_first"][s] for s in SIDES))
        lines.append(f"| `{st['scenario']}` | {st['config']} | {st['torch']} | {st['pairs']} | "
                     f"{_cell(st['ratio'], '.2f')} | {st['at_or_below']} | "
                     f"{_cell(st['ratio_beyond'], '.2f')} | {st['at_or_below_beyond']} | "
                     f"{by_first} |")
    lines += ["", "## Per pair", ""]
    for st in data["configs"]:
        lines += _config_table(data, st)
    lines += ["## Launches", "", "Load average (1 minute) read before and after each launch "
              f"({data['cores']} cores).", "",
              "| pair | scenario | order | aioready load before, after | "
              "torch load before, after |", "|---|---|---|---|---|"]
    for p in data["pairs"]:
        ld = {k: ", ".join(f"{x:.2f}" for x in v) for k, v in p["load"].items()}
        lines.append(f"| {p['pair']} | `{p['scenario']}` | {' then '.join(p['order'])} | "
                     f"{ld.get('aioready', '-')} | {ld.get('torch', '-')} |")
    return "\n".join(lines + ["", "## Not measured here", "", *_left_out(data)])


def _left_out(data: dict[str, Any]) -> list[str]:
    compared = {st["config"] for st in data["configs"]}
    other = [c for c in data["aioready"].split(",") if c and c not in compared]
    scenarios = [s for s in SCENARIOS if s not in data["scenarios"].split(",")]
    return ["- The CUDA device's path: both sides run on CPU here, where each task's compute "
            "is on the CPU too; on a GPU the runtime's CPU per task is what delays the next "
            "kernel launch, and it is not measured by this page.",
            "- Other scenarios: " + (", ".join(f"`{s}`" for s in scenarios) or "none") + ".",
            "- aioready configs with no same-schedule torch row at its own caps: "
            + (", ".join(other) or "none") + "."]


def run_pairs(args: argparse.Namespace, workdir: Path,
              on_pair: Callable[[list[dict[str, Any]]], None]) -> list[dict[str, Any]]:
    """Every pair of every scenario: the two launches in `order_of(pair)`, the load average
    (1 minute) read before and after each launch, and the pair's summarized rows. `on_pair`
    gets the pairs so far after each one, so a launch that fails late keeps the earlier ones."""
    configs = {"aioready": [c for c in args.aioready.split(",") if c],
               "torch": [c for c in args.torch.split(",") if c]}
    out = []
    for pair in range(args.pairs):
        for spec in args.scenarios.split(","):
            records: list[dict[str, Any]] = []
            load: dict[str, list[float]] = {}
            run: dict[str, Any] = {}
            for side in order_of(pair):
                before = os.getloadavg()[0]
                run = run_scenario(spec, workdir=workdir / f"pair{pair}-{side}",
                                   ranks=args.ranks, groups=GROUPS, microbatches=args.microbatches,
                                   task_ms=args.task_ms, warmup=args.warmup, steps=args.steps,
                                   seed=args.seed, timeout=args.timeout,
                                   aioready_configs=configs["aioready"] if side == "aioready"
                                   else [], torch_configs=configs["torch"]
                                   if side == "torch" else [])
                load[side] = [before, os.getloadavg()[0]]
                records += run["records"]
            summary = summarize(dict(run, records=records), groups=GROUPS,
                                microbatches=args.microbatches, warmup=args.warmup,
                                ranks=args.ranks)
            out.append({"pair": pair, "scenario": spec, "order": list(order_of(pair)),
                        "load": load, "rows": summary["rows"],
                        "figures": pair_ratios(summary["rows"], args.microbatches,
                                               args.ranks)})
            print(f"[e2e_pairs] pair {pair} `{spec}` ({' then '.join(order_of(pair))}): "
                  + ", ".join(f"{f['config']} {f['ratio_beyond']:.2f}"
                              for f in out[-1]["figures"]), flush=True)
            on_pair(out)
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=None,
                    help="launch pairs, the order swapped each pair (default 8; --quick 2)")
    ap.add_argument("--quick", action="store_true", help="2 pairs of 2 measured steps")
    ap.add_argument("--scenarios", default="none", help="comma-separated jitter specs")
    ap.add_argument("--aioready", default="1f1b/ready,1f1b/strict,zbv/strict",
                    help="hint/mode,...")
    ap.add_argument("--torch", default="Schedule1F1B,ScheduleZBVZeroBubble",
                    help="schedule class names")
    ap.add_argument("--steps", type=int, default=None,
                    help="measured steps per config in each launch (default 8; --quick 2)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=RANKS,
                    help=f"ranks on each side (default {RANKS}; the model has {GROUPS} groups)")
    ap.add_argument("--task-ms", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    ap.add_argument("--out", default="e2e_pairs",
                    help="results name: bench/results/NAME.md and NAME.json")
    args = ap.parse_args(argv)
    args.pairs = (2 if args.quick else 8) if args.pairs is None else args.pairs
    args.steps = (2 if args.quick else 8) if args.steps is None else args.steps
    if args.pairs < 1 or args.steps < 1:
        ap.error(f"--pairs and --steps must be at least 1, got {args.pairs} and {args.steps}")
    if args.ranks < 2 or GROUPS % args.ranks:
        ap.error(f"--ranks must be at least 2 and divide the model's {GROUPS} groups, "
                 f"got {args.ranks}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    load_start = list(os.getloadavg())
    cmd = "python -m bench.e2e_pairs" + (" " + " ".join(argv) if argv else "")
    data: dict[str, Any] = {}

    def save(pairs: list[dict[str, Any]]) -> None:
        """The JSON and the page of the pairs so far (rewritten after every pair)."""
        data.update(pairs=pairs, configs=config_stats(pairs), pairs_asked=args.pairs,
                    ranks=args.ranks, groups=GROUPS, load_start=load_start,
                    load_end=list(os.getloadavg()), cores=os.cpu_count(),
                    **{k: getattr(args, k) for k in ("steps", "warmup", "microbatches",
                                                     "task_ms", "seed", "scenarios", "aioready",
                                                     "torch")})
        common.RESULTS.mkdir(parents=True, exist_ok=True)
        (common.RESULTS / f"{args.out}.json").write_text(json.dumps(data, indent=1))
        common.write_result(args.out, page(data), cmd, load=load_start)
    with tempfile.TemporaryDirectory(prefix="aioready-e2e-pairs-") as tmp:
        run_pairs(args, Path(tmp), save)
    return data


if __name__ == "__main__":
    main(sys.argv[1:])
