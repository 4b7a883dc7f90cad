"""Task durations for paced runs (train, demo, examples): a jitter spec or a trace, in seconds.

The models themselves belong to aioready.variability (seeded, order-free draws; trace CSVs); this
module only adapts them to a device's `duration(TaskInfo) -> seconds`. When aioready.variability
is not in the build, a small fallback covers `none`, `lognormal:SIGMA` and
`multimodal:FRACTION:FACTOR` with the same properties (a hash of seed, step, stage, microbatch
and kind per draw, so every rank computes the same durations with no communication); traces then
need the variability module.
"""

from __future__ import annotations

import hashlib
import math
import random
import struct
from pathlib import Path
from typing import Callable

from .devices.base import TaskInfo
from .errors import ConfigError, TraceError
from .placement import Placement

__all__ = ["paced_duration", "base_ms"]

DurationFn = Callable[[TaskInfo], float]


def base_ms(task_ms: float, split_backward: bool) -> tuple[float, float, float]:
    """F, B, W base durations in ms: B = 2F unsplit; B = W = F split."""
    return (task_ms, task_ms, task_ms) if split_backward else (task_ms, 2 * task_ms, 0.0)


def paced_duration(*, placement: Placement, num_microbatches: int, split_backward: bool,
                   task_ms: float, jitter: str | None = None, seed: int = 0,
                   trace: str | Path | None = None) -> tuple[DurationFn, str]:
    """A duration function (seconds) and a one-line description of where durations come from."""
    if task_ms < 0 or not math.isfinite(task_ms):
        raise ConfigError("task duration must be a finite number of ms >= 0", expected=">= 0",
                          got=task_ms)
    try:
        from . import variability as var  # type: ignore[attr-defined]
    except ImportError:
        var = None
    if trace is not None:
        if var is None:
            raise ConfigError("replaying a trace needs aioready.variability", expected="a "
                              "build with the variability module", got="not importable")
        durations = var.read_trace(trace, placement=placement)
        return var.device_duration(durations, 1e-3), f"trace {trace}"
    spec = jitter or "none"
    f, b, w = base_ms(task_ms, split_backward)
    if var is not None:
        base = var.BaseDurations(f=f, b=2 * task_ms, b_split=task_ms, w=task_ms)
        model = var.JitterModel(spec, seed=seed, placement=placement,
                                num_microbatches=num_microbatches,
                                split_backward=split_backward, base=base)
        return var.device_duration(model, 1e-3), f"jitter {spec} (aioready.variability)"
    return _fallback(spec, seed, (f, b, w)), f"jitter {spec} (fallback model)"


def _uniform(*keys: int) -> float:
    digest = hashlib.blake2b(struct.pack(f"<{len(keys)}q", *keys), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) / float(1 << 53)


def _fallback(spec: str, seed: int, base: tuple[float, float, float]) -> DurationFn:
    name, *params = spec.split(":")
    try:
        values = [float(p) for p in params]
    except ValueError:
        values = []
        name = "?"
    shapes = {"none": 0, "lognormal": 1, "multimodal": 2}
    if shapes.get(name) != len(values):
        raise TraceError("unknown jitter spec", expected="none | lognormal:SIGMA | "
                         "multimodal:FRACTION:FACTOR", got=repr(spec))

    def duration(info: TaskInfo) -> float:
        ms = base[info.kind]  # F=0, B=1, W=2
        keys = (seed, info.step, info.stage, info.microbatch, int(info.kind))
        if name == "lognormal":
            sigma = values[0]
            z = random.Random(_uniform(*keys)).gauss(0.0, 1.0)
            ms *= math.exp(sigma * z - sigma * sigma / 2)
        elif name == "multimodal":
            heavy = _uniform(seed, info.step, info.microbatch, -1) < values[0]
            ms *= values[1] if heavy else 1.0
        return ms * 1e-3
    return duration

