"""aioready: a readiness-first, asyncio-native runtime for pipeline-parallel training.

The schedule is a hint: each rank runs the best-ranked ready task the moment its dependencies
resolve. Importing this package does not import torch or mpi4py; they load with the parts that
need them.
"""

from __future__ import annotations

from typing import Any

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
from .launch import run_loop as run
from .placement import Placement
from .runtime import choosers as _choosers
from .tasks import Kind, Task

__all__ = [
    "Pipeline", "split", "HintOrder", "Placement", "Task", "Kind", "run", "make_hint", "tune",
    "AutoHint",
    "AioreadyError", "ConfigError", "HintError", "TraceError", "ProtocolError", "StageError",
    "PeerLostError", "StallError", "CheckpointError", "CoordinationError", "InternalError",
]

__version__ = "0.1.0"


def _sim_chooser() -> Any:
    from .sim.tune import SimChooser
    return SimChooser()


def _policy_chooser() -> Any:
    from .sim.tune import policy_chooser
    return policy_chooser()


# hint="auto" in a Pipeline chooses by simulation; the runtime sits below the simulator, so the
# facade, which spans every layer, hands it the simulator's chooser (runtime/choosers.py)
_choosers.CHOOSERS.setdefault("simulate", _sim_chooser)
_choosers.CHOOSERS.setdefault("policy", _policy_chooser)  # policy="auto"


def __getattr__(name: str) -> Any:
    if name == "Pipeline":
        from .runtime.pipeline import Pipeline
        return Pipeline
    if name == "split":
        from .modeling.split import split
        return split
    if name == "AutoHint":
        from .runtime.autotune import AutoHint
        return AutoHint
    if name == "make_hint":
        from .schedulers import make_hint
        return make_hint
    if name == "simulate":
        from .sim.simulator import simulate
        return simulate
    if name == "tune":
        from .sim.tune import tune
        return tune
    raise AttributeError(f"module 'aioready' has no attribute {name!r}")
