"""How many measured steps should hint="auto" choose on? The window, tuned and validated.

Under per-task noise (lognormal) the step auto is scored on has noise that no earlier step
predicts, so a choice made on one measured step (`AutoHint(window=1)`, the default) picks the
candidate that was fastest on that step's draw, which is often not the fastest on the next one.
A window of k steps ranks the candidates by their mean step time over k draws, an estimate of
which is fastest on average. This bench measures what that buys, per k:

For S, M in CASES, each auto row of bench.policy (unsplit, split, split with 2S on every rank;
the 2x budget) and each seed, every fitting candidate of `choose_auto` (sim/choice.py) is
simulated on steps 0..STEPS-1 of the seed's jitter, each step as a one-step run (the scored
reading of bench.policy is a one-step run of step 0). Then, leave one out: each step j in turn
is the scored step, a window of k other steps (RESAMPLES random subsets, seeded) chooses the
candidate with the least mean (or, for comparison, the least worst) step time, and the row reads
the scored step's best candidate time / the chosen candidate's time there: 1.0 when the window
picked what hindsight picks, below when it picked a candidate slower on the scored step.
Reported per k, over seeds TUNE and VALIDATE apart (k was chosen on the first, the second checks
it): the mean of that ratio and its 10th percentile.

Run: python -m bench.policy_window [--quick] [--seeds N] [--jitter J]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from aioready.sim.choice import Candidate, choose_auto
from aioready.sim.simulator import simulate

from .common import write_result
from .policy import BUDGETS, CONFIGS, Config, _auto_budget
from .policy_held import WINDOW, choice_draw

CASES = ((4, 8), (4, 16), (8, 16))
STEPS = 9
WINDOWS = (1, 2, 3, 4, 5, 8)
RESAMPLES = 6
TUNE, VALIDATE = range(0, 5), range(5, 10)
QUICK = {"cases": ((4, 8),), "seeds": 2}


def _rows() -> list[Config]:
    """bench.policy's hindsight auto rows (their split and budget), chosen here on a window."""
    return [c for c in CONFIGS if c.hint == "auto"
            and dict(c.kwargs) in ({}, {"uniform": True})]


def step_times(S: int, M: int, jitter: str, seed: int, cfg: Config) -> np.ndarray:
    """(candidates, STEPS): each fitting candidate's step time on each step, as a one-step run."""
    split, budget = cfg.split_backward, _auto_budget(cfg, S, M, BUDGETS["2x"])
    per_step: list[dict[Candidate, float]] = []
    for step in range(STEPS):
        trace = choice_draw(jitter, seed, S, M, split, "step", step=step)

        def run(order: Any, mode: str, caps: tuple[int, ...], policy: str,
                bound: float | None = None, **how: Any) -> Any:
            return simulate(stages=S, microbatches=M, hint=order, mode=mode, policy=policy,
                            cap=list(caps), split_backward=split, trace=trace)
        tuning = choose_auto(run, "auto", num_stages=S, num_ranks=None, num_microbatches=M,
                             split_backward=split, budget=budget, prune=False)
        per_step.append({r.candidate: r.step_time for r in tuning.rows if r.fits})
    common = [c for c in per_step[0] if all(c in s for s in per_step)]
    return np.array([[s[c] for s in per_step] for c in common])


def regrets(T: np.ndarray, k: int, how: str) -> list[float]:
    """Leave one out: each step scored in turn, chosen on k of the others (the module's note)."""
    out = []
    score = (lambda x: x.mean(1)) if how == "mean" else (lambda x: x.max(1))
    for j in range(T.shape[1]):
        others = [i for i in range(T.shape[1]) if i != j]
        for rep in range(RESAMPLES):
            window = np.random.default_rng(1000 * rep + j).choice(others, size=k, replace=False)
            chosen = int(np.argmin(score(T[:, window])))
            out.append(float(T[:, j].min() / T[chosen, j]))
    return out


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"a reduced grid: {QUICK}")
    ap.add_argument("--seeds", type=int, default=None, help="seeds 0..N-1 (default 10)")
    ap.add_argument("--jitter", default="lognormal:0.5")
    args = ap.parse_args(argv)
    cases = QUICK["cases"] if args.quick else CASES
    seeds = args.seeds or (QUICK["seeds"] if args.quick else 10)
    began = time.process_time()
    found: dict[tuple[str, str, int], np.ndarray] = {}
    for S, M in cases:  # type: ignore[misc]
        for cfg in _rows():
            for seed in range(seeds):
                found[(f"{S}, {M}", cfg.name, seed)] = step_times(S, M, args.jitter, seed, cfg)
    lines = [f"{args.jitter}, 2x budget, S, M in {', '.join(f'{s},{m}' for s, m in cases)}, "
             f"seeds 0-{seeds - 1}, steps 0-{STEPS - 1}, {RESAMPLES} windows per scored step; "
             "ratio: the scored step's fastest candidate time / the chosen one's there (1.000: "
             f"hindsight's pick), mean (10th percentile). The bench.policy rows use k = {WINDOW}.",
             ""]
    head = ["rule", "k"] + [f"{name}: mean (p10)" for name, part in
                            (("tune, seeds 0-4", TUNE), ("validate, seeds 5-9", VALIDATE))
                            if any(s in part for s in range(seeds))]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for how in ("mean", "max"):
        for k in WINDOWS:
            if how == "max" and k == 1:
                continue  # the same choice as the mean of one step
            cells = [how, str(k)]
            for part in (TUNE, VALIDATE):
                got = [r for (_, _, seed), T in found.items() if seed in part
                       for r in regrets(T, k, how)]
                if got:
                    cells.append(f"{np.mean(got):.4f} ({np.percentile(got, 10):.4f})")
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Per case and row, mean over all seeds (k = 1 / 4 / 8):", ""]
    for case, row in dict.fromkeys((c, r) for c, r, _ in found):
        mine = [T for (c, r, _), T in found.items() if (c, r) == (case, row)]
        lines.append(f"- S, M = {case}, {row}: " + " / ".join(
            f"{np.mean([x for T in mine for x in regrets(T, k, 'mean')]):.4f}"
            for k in (1, 4, 8)))
    lines.append(f"\nCPU: {time.process_time() - began:.0f} s.")
    body = "\n".join(lines)
    write_result("policy_window", body, "python -m bench.policy_window "
                 + " ".join(argv if argv is not None else []))
    print(body)
    return body


if __name__ == "__main__":
    import sys
    main(sys.argv[1:])
