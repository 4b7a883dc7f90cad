"""Task durations: the one protocol both sources implement, and its adapters to devices.

Durations come from a seeded jitter model (sim/variability.py: order-free draws, so every rank
computes the same durations with no communication) or a trace replayed exactly (sim/traces.py).
Both are `Durations`: per-step tables in ms. This module adapts them to what consumes them: a
device's `duration(TaskInfo) -> seconds` (the sim device, paced real runs), and the
`duration(stage, microbatch, kind)` form of the lower bound; `paced_duration` picks one source
from the CLI's options (train, demo, examples), with base durations scaled from one number.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Protocol

import numpy as np

from ..devices.base import TaskInfo
from ..errors import ConfigError
from ..placement import Placement
from ..tasks import Kind
from .traces import read_trace
from .variability import BaseDurations, JitterModel

__all__ = ["Durations", "device_duration", "step_duration", "paced_duration", "base_durations"]

DurationFn = Callable[[TaskInfo], float]


def base_durations(task_ms: float) -> BaseDurations:
    """F = task_ms; B = 2F unsplit; B = W = F split (docs/architecture.md "Variability and
    traces")."""
    if task_ms < 0 or not math.isfinite(task_ms):
        raise ConfigError("task duration must be a finite number of ms >= 0", expected=">= 0",
                          got=task_ms)
    return BaseDurations(f=task_ms, b=2 * task_ms, b_split=task_ms, w=task_ms)


def paced_duration(*, placement: Placement, num_microbatches: int, split_backward: bool,
                   task_ms: float, jitter: str | None = None, seed: int = 0,
                   trace: str | Path | None = None, steps: int = 1) -> tuple[DurationFn, str]:
    """A duration function (seconds) and a one-line description of where durations come from."""
    if trace is not None:
        durations = read_trace(trace, placement=placement)
        durations.check(placement, num_microbatches, split_backward, steps)
        return device_duration(durations, 1e-3), f"trace {trace}"
    spec = jitter or "none"
    model = JitterModel(spec, seed=seed, placement=placement, num_microbatches=num_microbatches,
                        split_backward=split_backward, base=base_durations(task_ms))
    return device_duration(model, 1e-3), f"jitter {spec}, F={task_ms:g} ms"


class Durations(Protocol):
    """What the simulator and the sim device need: per-step tables of task durations in ms."""

    placement: Placement
    num_microbatches: int
    split_backward: bool

    def table(self, step: int) -> np.ndarray:
        """Durations of one step, shape (stages, microbatches, 3) indexed by Kind."""
        ...

    def ms(self, step: int, stage: int, microbatch: int, kind: Kind) -> float: ...


def device_duration(durations: Durations, scale: float = 1e-3) -> Callable[[TaskInfo], float]:
    """A SimDevice duration function: ms x `scale` in the loop clock's unit.

    Real loops count seconds (scale 1e-3, the default); the simulator's virtual clock counts
    trace units (scale 1.0), so its step times read in ms.
    """
    ms = durations.ms

    def duration(info: TaskInfo) -> float:
        return ms(info.step, info.stage, info.microbatch, info.kind) * scale
    return duration


def step_duration(durations: Durations, step: int) -> Callable[[int, int, Kind], float]:
    """`duration(stage, microbatch, kind)` of one step, the form `telemetry.bounds.lower_bound` takes."""
    rows = durations.table(step).tolist()
    return lambda stage, mb, kind: rows[stage][mb][kind]  # type: ignore[no-any-return]
