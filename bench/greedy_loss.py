"""Where greedy readiness loses to strict, shown: the decision that cost the time.

For S=4, M=8, 1F1B at its own cap, lognormal:0.5 jitter, each seed runs strict, ready/greedy and
ready/reserve on identical durations (the real runtime, in-process, on the virtual clock; the
second step of two, so the reserving policy has its estimates). The seed where greedy loses most
is drawn as three timelines (bench/results/greedy_loss.png) and exported for Perfetto
(greedy_loss.json). The losing decision is found from the spans: on some rank, greedy started a
task X while the task the hint names next there, h, was still on its way; h arrived while X ran
and waited for X to end. The largest such wait is reported with the ranks downstream that then
waited for h's output.

Run: python -m bench.greedy_loss [--seeds N]
"""

from __future__ import annotations

import argparse

import aioready
from aioready.clock import run_virtual
from aioready.devices.sim import SimDevice
from aioready.placement import Placement
from aioready.sim.durations import device_duration
from aioready.sim.variability import JitterModel
from aioready.tasks import Task
from aioready.telemetry.export import write_chrome_trace
from aioready.telemetry.plots import plot_compare
from aioready.telemetry.spans import Span, StepReport

from .common import RESULTS, median, write_result

S, M, HINT, JITTER = 4, 8, "1f1b", "lognormal:0.5"
RUNS = [("strict", "strict", "reserve"), ("greedy", "ready", "greedy"),
        ("reserve", "ready", "reserve")]


def step(seed: int, mode: str, policy: str) -> StepReport:
    """The second of two steps on the seed's durations (both steps draw their own)."""
    model = JitterModel(JITTER, seed=seed, placement=Placement.linear(S), num_microbatches=M,
                        split_backward=False)

    async def main() -> StepReport:
        pipe = aioready.Pipeline([None] * S, None, microbatches=M, hint=HINT, mode=mode,
                                 policy=policy, device=SimDevice(device_duration(model, 1.0),
                                                                 run_compute=False))
        for _ in range(2):
            await pipe.step()
        assert pipe.last_step is not None
        return pipe.last_step
    return run_virtual(main())


def losing_decisions(report: StepReport, hint: aioready.HintOrder) -> list[tuple[float, str]]:
    """(wait, text) for every task X that started before the hint's next task h on its rank
    became ready, and made h wait after it arrived."""
    out = []
    t0 = report.start
    for rank in range(S):
        mine = sorted((s for s in report.spans if s.rank == rank), key=lambda s: s.start)
        by_task = {Task(s.kind, s.microbatch, s.chunk): s for s in mine}
        done: set[Task] = set()
        order = hint.strict_order(rank)
        pos = 0
        for span in mine:
            while pos < len(order) and order[pos] in done:
                pos += 1
            task = Task(span.kind, span.microbatch, span.chunk)
            h = order[pos] if pos < len(order) else None
            if h is not None and task != h:
                hs: Span = by_task[h]
                if span.start < hs.ready < span.end:
                    wait = span.end - hs.ready
                    out.append((wait, f"rank {rank} started {span.label} at "
                                f"{span.start - t0:.2f} ms; {hs.label}, the hint's next task "
                                f"there, arrived at {hs.ready - t0:.2f} ms and waited "
                                f"{wait:.2f} ms for it"))
            done.add(task)
    return sorted(out, reverse=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    args = parser.parse_args()
    hint = aioready.make_hint(HINT, num_stages=S, num_microbatches=M)
    rows, worst = [], None
    for seed in range(args.seeds):
        reports = {name: step(seed, mode, policy) for name, mode, policy in RUNS}
        strict = reports["strict"].step_time
        ratios = {name: strict / r.step_time for name, r in reports.items()}
        rows.append((seed, ratios))
        if worst is None or ratios["greedy"] < worst[1]["greedy"]:
            worst = (seed, ratios, reports)
    assert worst is not None
    seed, ratios, reports = worst
    RESULTS.mkdir(parents=True, exist_ok=True)
    png = plot_compare([reports[n] for n, _, _ in RUNS], RESULTS / "greedy_loss.png",
                       labels=[f"{n} (seed {seed})" for n, _, _ in RUNS], clock_unit_s=1e-3)
    write_chrome_trace([reports["greedy"]], RESULTS / "greedy_loss.json", clock_unit_s=1e-3)
    decisions = losing_decisions(reports["greedy"], hint)
    med = {n: median([r[n] for _, r in rows]) for n, _, _ in RUNS}
    low = {n: min(r[n] for _, r in rows) for n, _, _ in RUNS}
    lines = [f"S={S}, M={M}, hint {HINT} at its own cap, {JITTER}, {args.seeds} seeds; strict "
             "step time / configuration's (>1: faster than strict); times in ms.", "",
             "| configuration | median | worst seed |", "| --- | --- | --- |"]
    lines += [f"| {n} | {med[n]:.3f} | {low[n]:.3f} |" for n, _, _ in RUNS]
    lines += ["", f"Worst seed for greedy: {seed} (greedy {ratios['greedy']:.3f}, reserve "
              f"{ratios['reserve']:.3f}). Timelines: [greedy_loss.png]({png.name}); greedy's "
              "step for Perfetto: greedy_loss.json. Times below are from the step's start.", "",
              "Decisions where greedy ran another task while the hint's next task arrived "
              "(largest waits first):", ""]
    lines += [f"- {text}" for _, text in decisions[:5]] or ["- none"]
    lines += ["", "Every such wait delays the task the order put on the critical path, and the "
              "ranks downstream wait for its output in turn; the reserving policy does not "
              "start X unless it is predicted to end before h can arrive (docs/policy.md)."]
    body = "\n".join(lines)
    print(body)
    write_result("greedy_loss", body, f"python -m bench.greedy_loss --seeds {args.seeds}")


if __name__ == "__main__":
    main()
