"""Telemetry overhead: what recording spans, instruments and metrics cost per task and per step.

Run: python -m bench.telemetry [--quick]

- per task, runtime with telemetry off (the runtime's own span per task only: it is always on)
  vs on (instrument hooks: device and transport wrapped, feeding the Prometheus instrument);
  a pure simulation (no compute, zero durations) on a real uvloop loop, so the figure is the
  runtime's own cost per task; medians of interleaved repeats, measured side by side;
- the span itself: building one Span and appending it (timeit);
- after a step: step_metrics (lower bound included), Chrome trace and CSV export per 1000 spans.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import timeit
from pathlib import Path
from typing import Any

import aioready
from aioready.devices.sim import SimDevice
from aioready.runtime.pipeline import Pipeline
from aioready.tasks import Kind
from aioready.telemetry.export import chrome_trace, write_csv
from aioready.telemetry.instruments import Instruments, instrument_pipeline
from aioready.telemetry.metrics import step_metrics
from aioready.telemetry.spans import Span, StepReport

from .common import median, write_result

STAGES, MICROBATCHES = 4, 64


def _pipe(instruments: Instruments | None) -> Pipeline:
    pipe = Pipeline([None] * STAGES, None, microbatches=MICROBATCHES, hint="1f1b", mode="ready",
                    device=SimDevice(lambda i: 0.0, run_compute=False))
    if instruments is not None:
        instrument_pipeline(pipe, instruments)
    return pipe


def per_task_us(kind: str, steps: int) -> float:
    """Median wall time per task (us) over `steps` steps of one pipeline."""
    inst = None
    if kind == "noop":
        inst = Instruments([_Noop()])
    elif kind == "prometheus":
        from aioready.telemetry.prometheus import PrometheusInstrument
        inst = Instruments([PrometheusInstrument()])
    pipe = _pipe(inst)

    async def main() -> list[float]:
        await pipe.step()  # warm-up
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            await pipe.step()
            times.append(time.perf_counter() - t)
        return times
    times = aioready.run(main())
    tasks = STAGES * MICROBATCHES * 2
    return median(times) / tasks * 1e6


class _Noop:
    """Every hook, doing nothing: the cost of the hook mechanism itself."""

    def before_task(self, info: Any) -> None:
        pass

    def after_task(self, info: Any, start: float, end: float) -> None:
        pass

    def message_sent(self, rank: int, dest: int, msg: Any, nbytes: int) -> None:
        pass


def span_append_ns(number: int) -> float:
    spans: list[Span] = []
    t = timeit.timeit(lambda: spans.append(Span(1, 1, 0, 3, Kind.F, 0.1, 0.2, 0.3)),
                      number=number)
    return t / number * 1e9


def _report() -> StepReport:
    pipe = _pipe(None)

    async def main() -> Any:
        await pipe.step()
        return pipe.last_step
    return aioready.run(main())  # type: ignore[no-any-return]


def after_step_ms(reps: int) -> dict[str, float]:
    rep = _report()
    n = len(rep.spans)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, fn in (("step_metrics", lambda: step_metrics(rep)),
                         ("chrome_trace", lambda: chrome_trace([rep])),
                         ("write_csv", lambda: write_csv([rep], Path(tmp) / "s.csv"))):
            ts = []
            for _ in range(reps):
                t = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t)
            out[name] = median(ts) * 1e3 * 1000 / n if name != "step_metrics" else \
                median(ts) * 1e3
    out["spans"] = n
    return out


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    rounds, steps = (5, 3) if args.quick else (15, 5)
    off, noop, on = [], [], []
    for _ in range(rounds):  # interleaved, so load changes hit all alike
        off.append(per_task_us("off", steps))
        noop.append(per_task_us("noop", steps))
        on.append(per_task_us("prometheus", steps))
    ratio = median(b / a for a, b in zip(off, on))
    span_ns = span_append_ns(20_000 if args.quick else 200_000)
    post = after_step_ms(5 if args.quick else 20)
    body = "\n".join([
        f"Pure simulation, S={STAGES}, M={MICROBATCHES}, ready 1f1b, zero durations, uvloop; "
        f"median of {rounds} interleaved rounds x {steps} steps.",
        "",
        "| telemetry | runtime cost per task (us) |",
        "|---|---|",
        f"| off (the runtime's own span per task only) | {median(off):.1f} |",
        f"| hooks that do nothing (device and transport wrapped) | {median(noop):.1f} |",
        f"| on (instrument hooks -> Prometheus counters) | {median(on):.1f} |",
        "",
        f"On / off ratio (median of per-round ratios): {ratio:.2f}x; "
        f"difference {median(on) - median(off):.1f} us per task, of which the hook mechanism "
        f"{median(noop) - median(off):.1f} us. A worst case: tasks here take no time; against "
        "a 1 ms task the difference is that many us per ms.",
        f"Building and appending one Span: {span_ns:.0f} ns "
        f"({span_ns / 1e3 / median(off):.1%} of the off cost per task).",
        "",
        f"After a step ({post['spans']:.0f} spans): step_metrics (lower bound included) "
        f"{post['step_metrics']:.2f} ms; Chrome trace {post['chrome_trace']:.2f} ms and CSV "
        f"{post['write_csv']:.2f} ms per 1000 spans.",
    ])
    print(body)
    cmd = "python -m bench.telemetry" + (" --quick" if args.quick else "")
    write_result("telemetry", body, cmd)
    return body


if __name__ == "__main__":
    main()
