"""PNG timelines of steps: ranks as rows, F/B/W boxes in the Chrome trace's colours.

Drawn with matplotlib's object API on an Agg canvas (no pyplot, no global backend switch), so it
works headless and inside services. Each box carries its microbatch number when wide enough;
a rank's idle time shows as hatched grey behind the boxes: the bubbles. `plot_compare` stacks two
timelines of the same durations (strict above ready) on one time axis.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from ..errors import ConfigError
from ..tasks import Kind
from .export import KIND_COLOR
from .metrics import step_metrics
from .spans import StepReport

__all__ = ["plot_timeline", "plot_compare", "draw_timeline"]


def _figure(rows: int, num_ranks: int) -> tuple[Any, list[Any]]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError("PNG timelines need matplotlib", expected="matplotlib installed",
                          got="not importable", fix="pip install 'aioready[telemetry]'") from None
    fig = Figure(figsize=(12, 0.45 * num_ranks * rows + 1.3 * rows + 0.4), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, 1, squeeze=False, sharex=True)[:, 0]
    return fig, list(axes)


def _title(report: StepReport, label: str, ms: float) -> str:
    m = step_metrics(report)
    return (f"{label}step {report.step}: {m.step_time * ms:.1f} ms, lower bound "
            f"{m.lower_bound * ms:.1f} ms, efficiency {m.efficiency:.2f}, bubbles "
            f"{m.bubble_fraction:.0%}")


def draw_timeline(ax: Any, report: StepReport, *, title: str | None = None,
                  xmax_ms: float | None = None, clock_unit_s: float = 1.0) -> None:
    """Draw one step on a matplotlib Axes (times in ms from the step's start).
    `clock_unit_s`: seconds per unit of the report's clock (the simulator's counts ms: 1e-3)."""
    from matplotlib.patches import Patch
    ms = 1e3 * clock_unit_s
    n = max(report.num_ranks, 1 + max((s.rank for s in report.spans), default=0))
    t0 = report.start
    span_ms = report.step_time * ms
    for r in range(n):
        ax.broken_barh([(0, span_ms)], (r - 0.4, 0.8), facecolors="#f2f2f2",
                       edgecolor="#bbbbbb", hatch="///", linewidth=0)
    for s in report.spans:
        x, w = (s.start - t0) * ms, (s.end - s.start) * ms
        ax.broken_barh([(x, w)], (s.rank - 0.4, 0.8), facecolors=KIND_COLOR[s.kind],
                       edgecolor="black", linewidth=0.5)
        if w > 0.012 * (xmax_ms or span_ms):
            text = str(s.microbatch) if not s.chunk else f"{s.microbatch}.{s.chunk}"
            ax.text(x + w / 2, s.rank, text, ha="center", va="center", fontsize=7)
    ax.set_ylim(n - 0.5, -0.5)
    ax.set_yticks(range(n), [f"rank {r}" for r in range(n)])
    ax.set_xlim(0, xmax_ms or span_ms)
    ax.set_xlabel("ms from step start")
    if title:
        ax.set_title(title, fontsize=10, loc="left")
    kinds = sorted({s.kind for s in report.spans})
    handles = [Patch(facecolor=KIND_COLOR[k], edgecolor="black", label=_KIND_NAMES[k])
               for k in kinds]
    handles.append(Patch(facecolor="#f2f2f2", edgecolor="#bbbbbb", hatch="///", label="idle"))
    ax.legend(handles=handles, loc="upper right", fontsize=7, ncol=len(handles),
              bbox_to_anchor=(1.0, 1.16), frameon=False)


_KIND_NAMES = {Kind.F: "F forward", Kind.B: "B backward", Kind.W: "W weight grad"}


def plot_timeline(report: StepReport, path: str | Path, *, label: str = "",
                  clock_unit_s: float = 1.0) -> Path:
    """Write one step's timeline PNG; the title gives step time, lower bound and efficiency."""
    _check(report)
    fig, (ax,) = _figure(1, report.num_ranks)
    draw_timeline(ax, report, title=_title(report, label, 1e3 * clock_unit_s),
                  clock_unit_s=clock_unit_s)
    return _save(fig, path)


def plot_compare(reports: Sequence[StepReport], path: str | Path,
                 labels: Sequence[str] = ("strict", "ready"), *,
                 clock_unit_s: float = 1.0) -> Path:
    """Timelines of the same step under different modes, one above the other, one time axis."""
    if len(reports) != len(labels):
        raise ConfigError("one label per report", expected=len(reports), got=len(labels))
    for r in reports:
        _check(r)
    ms = 1e3 * clock_unit_s
    xmax = max(r.step_time for r in reports) * ms
    fig, axes = _figure(len(reports), max(r.num_ranks for r in reports))
    for ax, rep, lab in zip(axes, reports, labels):
        draw_timeline(ax, rep, title=_title(rep, f"{lab}: ", ms), xmax_ms=xmax,
                      clock_unit_s=clock_unit_s)
    if len(reports) == 2:
        a, b = (r.step_time for r in reports)
        fig.suptitle(f"same durations: {labels[0]} {a * ms:.1f} ms, {labels[1]} "
                     f"{b * ms:.1f} ms, speedup {a / b:.2f}x", fontsize=11)
    return _save(fig, path)


def _check(report: StepReport) -> None:
    if not report.spans:
        raise ConfigError("nothing to plot", expected="a step with spans",
                          got=f"step {report.step} with none")


def _save(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path
