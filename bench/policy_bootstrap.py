"""Choosing on resampled copies of the one measured step: does it make auto's held-out choice
more robust where one step misleads most (S=4, M=8, unsplit, lognormal:0.5)?

A runtime that chose on its one measured step (bench.policy's `held-out` rows) picks the
candidate fastest on that draw; under per-task noise that is often not the fastest on the next
step (docs/policy_measurements.md "Choosing on a window of steps"), and a window of k real steps
costs k - 1 steps under the start hint first. Resampling needs no more steps
(aioready/sim/resample.py, bench/policy_held.py `choice_draw(copies=)`): each (stage, kind) keeps
its measured durations but deals them to the microbatches in a seeded random order, per copy,
the known sizes staying with their microbatches. It is a choice rule only: the candidates,
budget and tie-breaks are `choose_auto`'s. One more rule is read beside it: the one measured
step with exact ties broken to the most memory (`roomy`).

Per seed: hindsight (chosen on the scored step 0), held out (chosen on step 1), bootstrap k
(chosen on step 1 and k - 1 copies of it, the mean of a k-step run per candidate, as
`aioready.simulate(hint="auto", trace=..., steps=k)` ranks), and window k (steps 1..k, the
bench's `held-out, window 4`), each chosen run on step 0; read against hindsight's step time and
against the CP-SAT best found of bench/results/policy_robust.json where it has that seed.

Run: python -m bench.policy_bootstrap [--cases 4x8,4x16] [--seeds 0-9] [--deals 4]
     [--jitter lognormal:0.5] [--copies 4,8,16] [--split] [--out policy_bootstrap] [--quick]
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from typing import Any

import numpy as np

from aioready.schedulers import make_hint
from aioready.sim.simulator import simulate
from aioready.sim.traces import Trace

from .common import RESULTS, median, write_result
from .policy_held import choice_draw


def roomy(rows: Any) -> Any:
    """The fitting row with the least step time, ties to the most memory (the largest peak,
    then the largest sum of peaks) instead of `choose_schedule`'s least: a tie on the measured
    steps means the extra memory did not help on those draws, not that it will not on the
    next."""
    fit = [r for r in rows if r.fits and not r.stopped]
    least = min(r.step_time for r in fit)
    tied = [r for r in fit if r.step_time <= least * (1 + 1e-12)]
    return min(tied, key=lambda r: (-max(r.peak or r.peak_in_flight),
                                    -sum(r.peak or r.peak_in_flight), r.key))


def _choose(trace: Trace, S: int, M: int, split: bool, budget: str, ties: str = "least"
            ) -> Any:
    """auto's choice ranked by the mean over the trace's steps (with `ties`: see `roomy`)."""
    r = simulate(stages=S, microbatches=M, hint="auto", trace=trace, steps=trace.num_steps,
                 split_backward=split, cap=budget)
    return (roomy(r.tuning.rows) if ties == "memory" else r.tuning.best).candidate


def _score(cand: Any, S: int, M: int, split: bool, jitter: str, seed: int) -> float:
    """The candidate's step time on the scored step (step 0 of the seed)."""
    c = cand.choice
    hint = make_hint(c.hint, num_stages=S, num_microbatches=M, split_backward=split,
                     placement=c.placement)
    kw = {} if cand.order == "given" else {"order": cand.order}
    return simulate(stages=S, microbatches=M, hint=hint, mode=c.mode, policy=c.policy,
                    cap=list(c.cap), split_backward=split, jitter=jitter, seed=seed,
                    **kw).step_time


def _optimum(jitter: str, S: int, M: int, split: bool) -> dict[int, float]:
    """Per seed, the shortest schedule CP-SAT found within the budget (2x of 1F1B per rank) on
    a linear placement, over every instance of bench/results/policy_robust*.json that fits it:
    each row there is read against the optimum at its own caps, and a held-out choice may run
    other caps than hindsight's, so one reference per seed is taken here."""
    name = "policy_robust" if jitter.startswith("lognormal") else "policy_robust_mm"
    path = RESULTS / f"{name}.json"
    if not path.exists():
        return {}
    units = json.loads(path.read_text())["optimum"].get(f"{S}@{M}@{jitter}", [])
    budget = [2 * (S - r) for r in range(S)]
    out: dict[int, float] = {}
    for i, u in enumerate(units):
        for row in u["rows"].values():
            style, _, sp, caps = row["key"].split("/")
            fits = all(c <= b for c, b in zip(json.loads(caps.replace("(", "[").replace(
                ")", "]").replace(",]", "]")), budget))
            if style == "linear" and int(sp) == int(split) and fits:
                out[i] = min(out.get(i, np.inf), row["opt_eff"] * row["t"])
    return out


def one_seed(S: int, M: int, jitter: str, seed: int, split: bool, copies: list[int],
             window: int, deals: int) -> dict[str, Any]:
    """Each rule's choice (bench/policy_held.py's draws, the scored step's sizes known) and its
    step times on the scored step: one, or for a resampled rule one per draw of the copies."""
    def draw(**how: int) -> Trace:
        return choice_draw(jitter, seed, S, M, split, "sizes", **how)
    rules = {"hindsight": [draw(step=0)], "held-out": [draw()],
             f"window {window}": [draw(window=window)],
             **{f"bootstrap {k}": [draw(copies=k - 1, deal=d) for d in range(deals)]
                for k in copies}}
    out: dict[str, Any] = {"seed": seed}
    for name, traces in rules.items():
        for ties, suffix in (("least", ""), ("memory", ", ties to memory")):
            if suffix and name != "held-out":
                continue
            chosen = [_choose(trace, S, M, split, "2x", ties) for trace in traces]
            out[name + suffix] = [_score(c, S, M, split, jitter, seed) for c in chosen]
            out[name + suffix + " label"] = "; ".join(
                f"{c.label} {c.choice.how} {c.factor:g}x" for c in chosen)
    return out


def _vs(ref: float, times: list[float]) -> float:
    """`ref` over the step time, the mean over the draws of the copies where there are some."""
    return float(np.mean([ref / t for t in times]))


def case_page(S: int, M: int, args: argparse.Namespace, seeds: list[int]) -> list[str]:
    """One (S, M): the summary over seeds, then each seed's step times and choices."""
    copies = [int(x) for x in args.copies.split(",")]
    opt = _optimum(args.jitter, S, M, args.split)
    rows = [one_seed(S, M, args.jitter, s, args.split, copies, args.window, args.deals)
            for s in seeds]
    names = ["hindsight", "held-out", "held-out, ties to memory", f"window {args.window}",
             *(f"bootstrap {k}" for k in copies)]
    lines = ["| seed | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for d in rows:
        cells = []
        for n in names:
            ref = opt.get(d["seed"])
            t = float(np.mean(d[n]))
            cells.append(f"{t:.2f} ({'-' if ref is None else f'{_vs(ref, d[n]):.3f}'}) "
                         f"{d[n + ' label']}")
        lines.append(f"| {d['seed']} | " + " | ".join(cells) + " |")
    summary = ["| rule | vs hindsight: median (worst) | vs CP-SAT best found: median (worst) | "
               "mean vs CP-SAT, tuning seeds 0-4 / 5-9 |", "|---|---|---|---|"]
    for n in names:
        vs_h = [_vs(d["hindsight"][0], d[n]) for d in rows]
        vs_o = [_vs(opt[d["seed"]], d[n]) for d in rows if d["seed"] in opt]
        tune = [_vs(opt[d["seed"]], d[n]) for d in rows if d["seed"] in opt and d["seed"] < 5]
        val = [_vs(opt[d["seed"]], d[n]) for d in rows if d["seed"] in opt and d["seed"] >= 5]
        summary.append(f"| {n} | {median(vs_h):.3f} ({min(vs_h):.3f}) | "
                       + (f"{median(vs_o):.3f} ({min(vs_o):.3f}) | "
                          f"{np.mean(tune) if tune else float('nan'):.3f} / "
                          f"{np.mean(val) if val else float('nan'):.3f} |" if vs_o else "- | - |"))
    print("\n".join(summary), flush=True)
    return [f"## S={S}, M={M}", "", *summary, "", *lines, ""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="4x8", help="S x M, comma-separated")
    ap.add_argument("--seeds", default="0-9")
    ap.add_argument("--jitter", default="lognormal:0.5")
    ap.add_argument("--copies", default="4,8,16")
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--deals", type=int, default=4,
                    help="draws of the copies per resampled rule; its figures are their mean")
    ap.add_argument("--split", action="store_true")
    ap.add_argument("--out", default="policy_bootstrap")
    ap.add_argument("--quick", action="store_true",
                    help="S, M = 4, 8, seeds 0-1, 2 draws, into policy_bootstrap_quick")
    args = ap.parse_args()
    if args.quick:
        args.cases, args.seeds, args.deals, args.out = "4x8", "0-1", 2, "policy_bootstrap_quick"
    began = time.perf_counter()
    lo, _, hi = args.seeds.partition("-")
    seeds = list(range(int(lo), int(hi or lo) + 1))
    pages = []
    for case in args.cases.split(","):
        S, M = (int(x) for x in case.split("x"))
        pages += case_page(S, M, args, seeds)
    body = "\n".join([
        f"{'Split' if args.split else 'Unsplit'} backward, {args.jitter}, auto within 2x of "
        f"1F1B per rank, seeds {args.seeds}. Each rule chooses, then its choice runs on step 0 "
        "(the scored step). hindsight: chosen on step 0; held-out: on step 1 with step 0's "
        "sizes; ties to memory: the same, exact ties to the most memory; window k: steps 1..k; "
        "bootstrap k: step 1 and k - 1 resampled copies of it, each figure the mean over "
        f"{args.deals} draws of the copies (bench/policy_held.py `choice_draw(copies=)`, "
        "aioready/sim/resample.py). "
        "CP-SAT best found: the shortest schedule bench/results/policy_robust*.json found "
        "within the budget for that seed. Per seed: step ms (CP-SAT best found / it) and the "
        "choice.", "", *pages,
        f"Running time {time.perf_counter() - began:.0f} s (one process)."])
    print(body)
    write_result(args.out, body, shlex.join(["python", "-m", "bench.policy_bootstrap",
                                             *sys.argv[1:]]))


if __name__ == "__main__":
    main()
