"""policy="auto" against the two rules it chooses between, at each hint's own cap.

For each hint, jitter and seed, four in-process pipelines (the real runtime on the virtual
clock, SimDevice durations from the seeded jitter model) run two steps on identical durations:
strict, ready/reserve, ready/greedy and ready/auto. Auto runs the first step under reserve and
then the policy its chooser finds faster on that step's spans, so the second step is where it
is read: each ratio is strict's second step / the configuration's second step (> 1: faster
than strict), median and worst over seeds. The caps are the hint's own, so every row holds the
same memory as strict.

Run: python -m bench.policy_choice [--stages 8 16] [--seeds N] [--jobs N] [--quick]
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ProcessPoolExecutor

import aioready
from aioready.clock import run_virtual
from aioready.devices.sim import SimDevice
from aioready.schedulers import make_hint
from aioready.sim.durations import device_duration
from aioready.sim.variability import JitterModel

from .common import RESULTS, median, write_result

HINTS = ("1f1b", "bf", "zb-h1", "zb-h2", "bfw", "interleaved-1f1b", "interleaved-zb")
JITTERS = ("lognormal:0.5", "multimodal:0.3:3", "lognormal:0.2+straggler:1:1.5")
RUNS = (("strict", "strict", "reserve"), ("reserve", "ready", "reserve"),
        ("greedy", "ready", "greedy"), ("auto", "ready", "auto"))
SPLIT = {"zb-h1", "zb-h2", "bfw", "interleaved-zb"}


def second_steps(case: tuple[int, str, str, int]) -> dict[str, object]:
    """The second step's time of each run of RUNS, and the policy auto chose."""
    S, hint, jitter, seed = case
    M, split = 4 * S, hint in SPLIT
    order = make_hint(hint, num_stages=S, num_microbatches=M, split_backward=split)
    model = JitterModel(jitter, seed=seed, placement=order.placement, num_microbatches=M,
                        split_backward=split)
    out: dict[str, object] = {"S": S, "hint": hint, "jitter": jitter, "seed": seed}
    for name, mode, policy in RUNS:
        async def main() -> aioready.Pipeline:
            pipe = aioready.Pipeline([None] * S, None, microbatches=M, hint=hint, mode=mode,
                                     policy=policy, split_backward=split,
                                     device=SimDevice(device_duration(model, 1.0),
                                                      run_compute=False))
            for _ in range(2):
                await pipe.step()
            return pipe
        pipe = run_virtual(main())
        assert pipe.last_step is not None
        out[name] = pipe.last_step.step_time
        if name == "auto":
            assert pipe.auto is not None
            out["chose"] = pipe.auto.choices[-1][1].policy
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.policy_choice", description=__doc__)
    p.add_argument("--stages", type=int, nargs="+", default=[8, 16])
    p.add_argument("--seeds", type=int, default=6)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="S=8, 2 seeds")
    args = p.parse_args(argv)
    if args.quick:
        args.stages, args.seeds = [8], 2
    cases = [(S, h, j, s) for S in args.stages for j in JITTERS for h in HINTS
             for s in range(args.seeds)]
    with ProcessPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(second_steps, cases))
    lines = [f"M = 4S, {args.seeds} seeds, each hint at its own cap (the same memory on every "
             "row); ratio: strict's second step / the row's second step, median (worst seed); "
             "`auto chose`: how many seeds auto ran greedy from the second step.", ""]
    for S in args.stages:
        for jitter in JITTERS:
            lines += [f"### S={S}, {jitter}", "",
                      "| hint | reserve | greedy | auto | auto chose greedy |",
                      "|---|---|---|---|---|"]
            for hint in HINTS:
                mine = [r for r in rows if (r["S"], r["jitter"], r["hint"]) == (S, jitter, hint)]
                cells = []
                for name in ("reserve", "greedy", "auto"):
                    x = [float(r["strict"]) / float(r[name]) for r in mine]  # type: ignore[arg-type]
                    cells.append(f"{median(x):.3f} ({min(x):.3f})")
                greedy = sum(r["chose"] == "greedy" for r in mine)
                lines.append(f"| {hint} | " + " | ".join(cells) + f" | {greedy}/{len(mine)} |")
            lines.append("")
    command = "python -m bench.policy_choice " + " ".join(argv or [])
    write_result("policy_choice", "\n".join(lines), command.strip())
    (RESULTS / "policy_choice.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
