"""aioready: a readiness-first, asyncio-native runtime for pipeline-parallel training.

The schedule is a hint: each rank runs the best-ranked ready task the moment its dependencies
resolve. Importing this package does not import torch or mpi4py; they load with the parts that
need them.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, TypeVar

from .errors import (
    AioreadyError,
    CheckpointError,
    ConfigError,
    CoordinationError,
    HintError,
    InternalError,
    PeerLostError,
    ProtocolError,
    StageError,
    StallError,
    TraceError,
)
from .hints import HintOrder
from .placement import Placement
from .tasks import Kind, Task

__all__ = [
    "Pipeline", "HintOrder", "Placement", "Task", "Kind", "run", "make_hint",
    "AioreadyError", "ConfigError", "HintError", "TraceError", "ProtocolError", "StageError",
    "PeerLostError", "StallError", "CheckpointError", "CoordinationError", "InternalError",
]

__version__ = "0.1.0"

T = TypeVar("T")


def run(main: Awaitable[T], *, debug: bool | None = None) -> T:
    """`asyncio.run`, on a uvloop loop when uvloop is installed; never changes the loop policy."""
    try:
        import uvloop
        factory: Any = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(debug=debug, loop_factory=factory) as runner:
        return runner.run(main)  # type: ignore[arg-type]


def __getattr__(name: str) -> Any:
    if name == "Pipeline":
        from .runtime.pipeline import Pipeline
        return Pipeline
    if name == "make_hint":
        from .schedulers import make_hint
        return make_hint
    if name == "simulate":
        from .sim.simulator import simulate  # type: ignore[attr-defined]
        return simulate
    raise AttributeError(f"module 'aioready' has no attribute {name!r}")
