"""Task durations for paced runs (train, demo, examples): a jitter spec or a trace, in seconds.

The models belong to aioready.variability (seeded, order-free draws: every rank computes the same
durations with no communication; trace CSVs replayed exactly); this module only picks one from
the CLI's options and adapts it to a device's `duration(TaskInfo) -> seconds`, with base
durations scaled from one number, the F duration in ms.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

from .devices.base import TaskInfo
from .errors import ConfigError
from .placement import Placement
from .variability import BaseDurations, JitterModel, device_duration, read_trace

__all__ = ["paced_duration", "base_durations"]

DurationFn = Callable[[TaskInfo], float]


def base_durations(task_ms: float) -> BaseDurations:
    """F = task_ms; B = 2F unsplit; B = W = F split (DESIGN.md's textbook ratios)."""
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
