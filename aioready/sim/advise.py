"""Advice: from a recorded run to the one change that would shorten its step most.

Every option is a simulation of the real runtime (`simulate`, on the virtual clock) on the
recorded durations, changed only where the option changes them:

- other hints, modes and policies, and memory budgets of 1x, 1.5x and 2x the current caps: the
  candidates of `sim/choice.py` (the table `aioready tune` ranks), each filed under the smallest
  budget its simulated peak in-flight count fits;
- microbatch counts M/2 and 2M: each stage's per-microbatch durations are averaged over the
  recorded microbatches and scaled by M / M' (the same batch cut finer; a fixed per-task overhead
  is not modelled, so finer cuts look a little better than they are);
- moving k layers from a stage to a neighbouring one: a stage's per-layer cost is its recorded
  duration divided by its layer count, per task, and a moved layer keeps the cost it had (it is
  the layers that are heavy, not the device); the receiver's tasks grow by k such layers;
- halving the message latency, when the spans show one: the median gap between an activation's
  send (its F's end) and the consumer's F becoming ready, replayed as a `comm:` term.

Activation memory is counted in microbatches of the recorded size: peak in-flight x M / M'.
What it leaves out: durations are replayed as they were (the recorded steps' jitter); a moved
layer's activation size; communication bandwidth (the latency term is one delay per message).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..caps import CapSpec, resolve_caps
from ..errors import AioreadyError, ConfigError
from ..hints import HintOrder
from ..schedulers import make_hint
from ..tasks import Kind
from ..telemetry.metrics import step_metrics
from ..telemetry.spans import StepReport
from .choice import Tuning
from .simulator import SimResult, simulate
from .traces import Trace, trace_from_reports
from .tune import tune

__all__ = ["Option", "Advice", "Recording", "advise", "message_latency_ms", "plot_advice"]

KINDS = ("now", "hint", "memory", "microbatches", "layers", "latency")


@dataclass(frozen=True, slots=True)
class Recording:
    """A recorded run: its step reports and the settings it ran with."""

    reports: tuple[StepReport, ...]
    unit_ms: float = 1000.0  # ms per unit of the reports' clock (1000: a real loop)
    hint: str = "1f1b"
    mode: str = "ready"
    policy: str = "reserve"
    cap: CapSpec = None
    layers_per_stage: tuple[int, ...] | None = None
    source: str = "recorded run"


@dataclass(frozen=True, slots=True)
class Option:
    """One simulated change; times in ms, memory in recorded-size microbatches per rank."""

    kind: str  # one of KINDS
    label: str
    step_time: float
    lower_bound: float
    activations: tuple[float, ...]
    change: dict[str, Any] = field(default_factory=dict)
    command: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "label": self.label, "step_time": self.step_time,
                "lower_bound": self.lower_bound, "activations": list(self.activations),
                "change": self.change, "command": self.command}


@dataclass(frozen=True, slots=True)
class Advice:
    """The recorded figures, the simulated present, every option ranked, and the one advised."""

    recorded_step_time: float
    recorded_lower_bound: float
    now: Option
    options: tuple[Option, ...]  # fastest first
    best: Option  # `now` when no option gains at least `min_gain`
    latency_ms: float

    def gain(self, option: Option) -> float:
        return 1.0 - option.step_time / self.now.step_time

    def table(self) -> str:
        lines = [f"recorded: step {self.recorded_step_time:.4g} ms, lower bound "
                 f"{self.recorded_lower_bound:.4g} ms; simulated now: "
                 f"{self.now.step_time:.4g} ms",
                 f"{'':1} {'change':<44} {'step ms':>9} {'gain':>7} {'LB ms':>8}  activations"]
        for opt in (self.now, *self.options):
            mark = "*" if opt is self.best else " "
            lines.append(f"{mark:1} {opt.label:<44} {opt.step_time:>9.4g} "
                         f"{self.gain(opt):>+7.1%} {opt.lower_bound:>8.4g}  "
                         f"{[round(a, 2) for a in opt.activations]}")
        lines.append(f"advice: {self.best.label}" + (f"\n  {self.best.command}"
                                                      if self.best.command else ""))
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {"time_unit": "ms", "recorded_step_time": self.recorded_step_time,
                "recorded_lower_bound": self.recorded_lower_bound,
                "latency_ms": self.latency_ms, "now": self.now.as_dict(),
                "options": [o.as_dict() for o in self.options], "best": self.best.as_dict()}


def message_latency_ms(reports: Sequence[StepReport], unit_ms: float) -> float:
    """Median gap between an activation's producer F ending and its consumer F becoming ready
    on another rank (0 when no activation crosses ranks); negative gaps count as 0."""
    gaps = []
    for report in reports:
        ends = {(s.stage, s.microbatch): (s.end, s.rank) for s in report.spans
                if s.kind is Kind.F}
        for s in report.spans:
            up = ends.get((s.stage - 1, s.microbatch)) if s.kind is Kind.F else None
            if up is not None and up[1] != s.rank:
                gaps.append(max(0.0, s.ready - up[0]) * unit_ms)
    return float(np.median(gaps)) if gaps else 0.0


class _Advisor:
    """The recording's shape, and one `simulate` call per option."""

    def __init__(self, rec: Recording, steps: int) -> None:
        reports = list(rec.reports)[-steps:]
        spans = [s for r in reports for s in r.spans]
        if not spans:
            raise ConfigError(f"{rec.source}: no spans to advise on", expected="recorded steps",
                              got="none")
        self.rec = rec
        self.split = any(s.kind is Kind.W for s in spans)
        self.stages = 1 + max(s.stage for s in spans)
        self.ranks = 1 + max(s.rank for s in spans)
        self.mb = 1 + max(s.microbatch for s in spans)
        self.order = make_hint(rec.hint, num_stages=self.stages, num_ranks=self.ranks,
                               num_microbatches=self.mb, split_backward=self.split)
        self.trace = trace_from_reports(reports, placement=self.order.placement,
                                        num_microbatches=self.mb, split_backward=self.split,
                                        unit_ms=rec.unit_ms, source=rec.source)
        self.caps = tuple(resolve_caps(rec.cap, self.order))
        self.latency = message_latency_ms(reports, rec.unit_ms)
        mean_task = float(np.mean([s.end - s.start for s in spans])) * rec.unit_ms
        self.jitter = f"comm:{self.latency!r}" if self.latency > 5e-3 * mean_task else "none"
        metrics = [step_metrics(r) for r in reports]
        self.recorded = (float(np.mean([m.step_time for m in metrics])) * rec.unit_ms,
                         float(np.mean([m.lower_bound for m in metrics])) * rec.unit_ms)

    def run(self, *, hint: str | HintOrder | None = None, trace: Trace | None = None,
            cap: CapSpec = None, mode: str | None = None, policy: str | None = None,
            jitter: str | None = None) -> SimResult:
        trace = trace or self.trace
        return simulate(stages=self.stages, microbatches=trace.num_microbatches,
                        hint=hint or self.order, mode=mode or self.rec.mode,
                        policy=policy or self.rec.policy, trace=trace,
                        jitter=jitter or self.jitter, cap=list(self.caps) if cap is None else cap,
                        split_backward=self.split, steps=trace.num_steps, ranks=self.ranks)

    def option(self, kind: str, label: str, result: SimResult, change: dict[str, Any],
               scale: float = 1.0) -> Option:
        return Option(kind, label, result.step_time, result.lower_bound,
                      tuple(p * scale for p in result.peak_in_flight), change,
                      self.command(change))

    def command(self, change: dict[str, Any]) -> str:
        if not change:
            return ""
        if "layers_per_stage" in change:
            style = self.order.placement.style
            where = "" if style == "linear" else f", placement={style!r}"
            return (f"aioready.split(model, stages={self.stages}, "
                    f"balance={list(change['layers_per_stage'])}{where})")
        if "latency_ms" in change:
            return f"(a network whose message latency is {change['latency_ms']:.3g} ms)"
        cfg = {"stages": self.stages, "microbatches": self.mb, "hint": self.rec.hint,
               "mode": self.rec.mode, "policy": self.rec.policy,
               "cap": ",".join(str(c) for c in self.caps)}
        cfg.update({k: (",".join(str(c) for c in v) if k == "cap" else v)
                    for k, v in change.items()})
        line = "aioready train " + " ".join(f"--{k} {v}" for k, v in cfg.items()
                                              if not (k == "policy" and cfg["mode"] == "strict"))
        return line + (" --split-backward" if self.split else "")


def _schedules(adv: _Advisor) -> list[Option]:
    """The tuner's candidates under a 2x budget, each filed under the least budget it fits."""
    budgets = {f: tuple(max(1, int(np.ceil(f * c))) for c in adv.caps) for f in (1.0, 1.5, 2.0)}
    try:
        tuning: Tuning = tune(adv.trace, hint=f"auto:{adv.rec.hint}",
                              budget=list(budgets[2.0]), jitter=adv.jitter)
    except AioreadyError:
        return []  # a hint file or torch order: no library candidates on its placement
    best: dict[tuple[str, str], Any] = {}
    for row in tuning.rows:
        factor = next((f for f, b in budgets.items()
                       if all(p <= c for p, c in zip(row.peak_in_flight, b))), None)
        c = row.candidate.choice
        key = ("hint", f"{c.label} {c.how}") if factor == 1.0 else ("memory", f"{factor:g}x")
        if factor is not None and (key not in best or row.key < best[key].key):
            best[key] = row
    out = []
    for (kind, what), row in best.items():
        c = row.candidate.choice
        label = (f"hint {c.label} {c.how}" if kind == "hint" else
                 f"memory {what} caps: {c.label} {c.how}")
        result = adv.run(hint=c.build(num_stages=adv.stages, num_ranks=adv.ranks,
                                      num_microbatches=adv.mb, split_backward=adv.split),
                         cap=list(c.cap), mode=c.mode, policy=c.policy)
        out.append(adv.option(kind, label, result, {"hint": c.hint, "mode": c.mode,
                                                    "policy": c.policy, "cap": list(c.cap)}))
    return out


def _microbatches(adv: _Advisor) -> list[Option]:
    out = []
    tables = adv.trace.tables
    for count in sorted({max(1, adv.mb // 2), adv.mb * 2} - {adv.mb}):
        mean = tables.mean(axis=2, keepdims=True) * (adv.mb / count)
        trace = Trace(np.repeat(mean, count, axis=2), placement=adv.order.placement,
                      split_backward=adv.split, source=f"{adv.trace.source} at M={count}")
        try:
            order = make_hint(adv.rec.hint, num_stages=adv.stages, num_ranks=adv.ranks,
                              num_microbatches=count, split_backward=adv.split)
            cap = adv.rec.cap if not isinstance(adv.rec.cap, (list, tuple)) else list(adv.caps)
            result = adv.run(hint=order, trace=trace, cap=resolve_caps(cap, order))
        except AioreadyError:
            continue  # the hint (a file) is for M only, or cannot run at this count
        out.append(adv.option("microbatches", f"microbatches {adv.mb} -> {count}", result,
                              {"microbatches": count}, scale=adv.mb / count))
    return out


def _layers(adv: _Advisor) -> list[Option]:
    """For each stage and neighbour, the best k of moving k of its layers there."""
    layers = adv.rec.layers_per_stage
    if layers is None:
        return []
    if len(layers) != adv.stages:
        raise ConfigError("layers_per_stage: one count per stage",
                          expected=f"{adv.stages} counts", got=list(layers))
    out = []
    for src in range(adv.stages):
        for dst in (src - 1, src + 1):
            if not 0 <= dst < adv.stages:
                continue
            tried = []
            for k in range(1, layers[src]):
                tables = adv.trace.tables.copy()
                moved = adv.trace.tables[:, src] * (k / layers[src])
                tables[:, src] -= moved
                tables[:, dst] += moved
                counts = list(layers)
                counts[src] -= k
                counts[dst] += k
                trace = Trace(tables, placement=adv.order.placement, split_backward=adv.split,
                              source=f"{adv.trace.source} with {counts} layers")
                tried.append(adv.option("layers", f"move {k} layer{'s' * (k > 1)} from stage "
                                        f"{src} to {dst}", adv.run(trace=trace),
                                        {"layers_per_stage": counts}))
            if tried:
                out.append(min(tried, key=lambda o: o.step_time))
    return out


def _latency(adv: _Advisor) -> list[Option]:
    if adv.jitter == "none":
        return []
    half = adv.latency / 2
    return [adv.option("latency", f"message latency {adv.latency:.3g} -> {half:.3g} ms",
                       adv.run(jitter=f"comm:{half!r}"), {"latency_ms": half})]


def advise(rec: Recording, *, steps: int = 4, min_gain: float = 0.01) -> Advice:
    """Simulate every option on the last `steps` recorded steps; advise the fastest that gains
    at least `min_gain` (a fraction of the simulated present step time), else no change."""
    adv = _Advisor(rec, steps)
    now = adv.option("now", f"now: {rec.hint} {rec.mode}", adv.run(), {})
    options = [*_schedules(adv), *_microbatches(adv), *_layers(adv), *_latency(adv)]
    options.sort(key=lambda o: (o.step_time, max(o.activations), KINDS.index(o.kind), o.label))
    best = next((o for o in options if o.step_time <= now.step_time * (1 - min_gain)), now)
    return Advice(adv.recorded[0], adv.recorded[1], now, tuple(options), best, adv.latency)


def plot_advice(advice: Advice, path: str | Path, *, top: int = 16) -> Path:
    """A PNG of the `top` fastest options as horizontal bars, with the simulated present and
    its lower bound as lines; the advised option is highlighted."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError("the advice chart needs matplotlib", expected="matplotlib installed",
                          got="not importable", fix="pip install 'aioready[telemetry]'") from None
    shown = list(advice.options[:top])[::-1]
    fig = Figure(figsize=(10, 1.6 + 0.32 * len(shown)), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    colors = ["#E15759" if o is advice.best else "#4C78A8" for o in shown]
    ax.barh([o.label for o in shown], [o.step_time for o in shown], color=colors)
    ax.axvline(advice.now.step_time, color="black", linestyle="--",
               label=f"now {advice.now.step_time:.4g} ms")
    ax.axvline(advice.now.lower_bound, color="grey", linestyle=":",
               label=f"lower bound now {advice.now.lower_bound:.4g} ms")
    ax.set_xlabel("simulated step time (ms)")
    ax.set_title(f"aioready advise: {advice.best.label} "
                 f"({advice.gain(advice.best):+.1%})", fontsize=10)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, fontsize=8)
    ax.tick_params(axis="y", labelsize=8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path
