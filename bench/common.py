"""Small helpers shared by the benchmarks: medians, machine description, result files."""

from __future__ import annotations

import datetime as _dt
import gc
import os
import platform
import statistics
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator

RESULTS = Path(__file__).resolve().parent / "results"


def median(xs: Iterable[float]) -> float:
    return statistics.median(list(xs))


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name"))
        cpu = model
    except (OSError, StopIteration):
        pass
    return f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, {platform.system()}"


def other_load() -> str:
    try:
        with open("/proc/loadavg") as f:
            return "load average " + " ".join(f.read().split()[:3])
    except OSError:
        return "load unknown"


def write_result(name: str, body: str, command: str,
                 load: list[float] | None = None) -> Path:
    """Write bench/results/<name>.md with the command, the machine and the date.

    `load`: the load average read when the benchmark started (os.getloadavg()); without it the
    header gives the load now, at the end of the run, and says so."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                                ".", ":!bench/results", ":!bench/RESULTS.md"],
                               capture_output=True, text=True, timeout=10,
                               cwd=RESULTS.parent.parent).stdout.strip()
        commit += " with uncommitted changes" if dirty else ""
    except (OSError, subprocess.SubprocessError):
        commit = "?"
    when = (f"load average {' '.join(f'{x:.2f}' for x in load)} at the start" if load
            else f"{other_load()} at the end")
    head = (f"Command: `{command}`  \nMachine: {machine()}; {when}  \n"
            f"Date: {_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M} UTC, commit {commit}\n\n")
    path = RESULTS / f"{name}.md"
    path.write_text(head + body.rstrip() + "\n")
    return path


def lean_gc() -> None:
    """For simulation workers: collect garbage less often (the event loop makes many short-lived
    objects and few cycles), about 6 % less CPU per simulation on the benches' sizes."""
    gc.freeze()
    gc.set_threshold(50_000, 50, 100)


@contextmanager
def step_reports() -> Iterator[list[Any]]:
    """Every rank's StepReport of each step simulated inside the block, in order (a step's ranks
    together): the simulator's per-step statistics hook, wrapped and then restored. SimResult
    keeps only statistics, so the benches that draw or dissect a step's spans read them here."""
    import aioready.sim.simulator as simulator
    seen: list[Any] = []
    stats = simulator._step_stats

    def keep(reports: Any, table: Any, hint: Any) -> Any:
        seen.extend(reports)
        return stats(reports, table, hint)
    simulator._step_stats = keep  # type: ignore[assignment]
    try:
        yield seen
    finally:
        simulator._step_stats = stats  # type: ignore[assignment]
