"""Devices: `cpu` (a worker thread), `sim` (given durations), `cuda` (streams and events)."""

from __future__ import annotations

from .base import Device, TaskInfo
from .cpu import CPUDevice
from .inline import InlineDevice
from .sim import SimDevice

__all__ = ["Device", "TaskInfo", "CPUDevice", "InlineDevice", "SimDevice"]
