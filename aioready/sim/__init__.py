"""Simulation: the real runtime on a virtual clock, and where task durations come from.

`simulator.simulate` runs every rank of a pipeline in one process on the virtual clock
(aioready/clock.py); `variability` holds the seeded jitter models, `traces` the duration CSVs
replayed exactly, `durations` the protocol both implement and its adapters to devices.
"""

from __future__ import annotations

from .simulator import SimResult, StepStats, resolve_caps, simulate

__all__ = ["simulate", "SimResult", "StepStats", "resolve_caps"]
