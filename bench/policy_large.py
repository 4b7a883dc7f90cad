"""The policy at S=128 (M=512, one seed): what `hint="auto"` at twice 1F1B's memory would pick.

Running `hint="auto"` itself at this size means simulating every candidate (minutes each), so
this runs the candidates that win at S <= 32 (bench/results/policy.md): bfw, zb-h1, zb-h2 in
ready mode under both policies, each at twice its own peak but capped at twice the 1F1B peak
per rank (auto's budget "2x" of its 1F1B start hint) and, for reference, at four times it (bfw's
own peak is already twice 1F1B's), beside strict 1F1B with the same split backward, on the same
durations. The best of them is what auto would choose among them; auto's other candidates
can only be faster. Each configuration's peak in-flight is reported (memory, microbatches).

Run: python -m bench.policy_large [--stages 128] [--seed 0] [--jitters a,b]
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from aioready.caps import resolve_caps
from aioready.schedulers import make_hint
from aioready.sim.simulator import simulate

from .common import write_result

CANDIDATES = [(h, p) for h in ("bfw", "zb-h1", "zb-h2") for p in ("reserve", "greedy")]
BUDGETS = ("2x", "4x")  # of 1F1B's peak per rank; 4x is twice bfw's own default


def one(S: int, jitter: str, seed: int, hint: str, mode: str, policy: str, budget: str
        ) -> tuple[str, str, str, str, str, float, float, int]:
    M = 4 * S
    base = make_hint("1f1b", num_stages=S, num_microbatches=M, split_backward=True)
    limit = resolve_caps(budget, base)
    order = make_hint(hint, num_stages=S, num_microbatches=M, split_backward=True)
    caps = None if mode == "strict" else [min(c, m) for c, m in zip(resolve_caps("2x", order),
                                                                      limit)]
    r = simulate(stages=S, microbatches=M, hint=order, mode=mode, policy=policy,
                 jitter=jitter, seed=seed, split_backward=True, cap=caps)
    return (jitter, budget, hint, mode, policy, r.step_time, r.efficiency,
            max(r.peak_in_flight))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jitters", default="lognormal:0.5,multimodal:0.3:3")
    args = ap.parse_args()
    jitters = args.jitters.split(",")
    jobs = [(j, "1f1b", "strict", "reserve", "1x") for j in jitters]
    jobs += [(j, h, "ready", p, b) for j in jitters for b in BUDGETS for h, p in CANDIDATES]
    began = time.perf_counter()
    with ProcessPoolExecutor(2) as pool:
        rows = list(pool.map(one, *zip(*[(args.stages, j, args.seed, h, m, p, b)
                                          for j, h, m, p, b in jobs])))
    lines = [f"S={args.stages}, M={4 * args.stages}, seed {args.seed}, split backward (F=B=W=1 "
             "before jitter); speedup = strict 1F1B step time / step time; peak = the largest "
             "in-flight count on any rank (strict 1F1B's is S).", ""]
    for jitter in jitters:
        mine = [r for r in rows if r[0] == jitter]
        strict = next(r for r in mine if r[3] == "strict")[5]
        lines += [f"### {jitter}", "", "| budget (x 1F1B peak) | configuration | step | speedup "
                  "| efficiency | peak |", "|---|---|---|---|---|---|"]
        for _, budget, hint, mode, policy, t, eff, peak in sorted(mine, key=lambda r: (r[1],
                                                                                       r[5])):
            name = f"{mode} {hint}" + (f" ({policy})" if mode == "ready" else "")
            lines.append(f"| {budget} | {name} | {t:.1f} | {strict / t:.3f}x | {eff:.3f} | "
                         f"{peak} |")
        lines.append("")
    lines.append(f"Running time {time.perf_counter() - began:.0f} s (2 processes).")
    body = "\n".join(lines)
    print(body)
    write_result("policy_large", body, shlex.join(["python", "-m", "bench.policy_large",
                                                    *sys.argv[1:]]))


if __name__ == "__main__":
    main()
