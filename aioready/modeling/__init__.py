"""Bring your own model: cut a model built as a sequence of blocks into pipeline stages.

`split.py` (`split`: stages by module names, balanced by parameters, measured time or given
counts, for any placement), `stages.py` (the stage module: the model's own forward up to its
first block on stage 0, a slice of blocks, the closing modules on the last stage, and the
per-rank store of per-microbatch context), `balance.py` (costs and the contiguous partition),
`context.py` (which microbatch the running stage computes), `memory.py` (`stage_memory`: what a
microbatch in flight costs each stage, with and without recompute). They need torch.
"""

from __future__ import annotations

__all__ = ["split", "SplitStages", "SplitStage"]


def __getattr__(name: str) -> object:
    if name in ("split", "SplitStages"):
        from . import split as _split
        return getattr(_split, name)
    if name == "SplitStage":
        from .stages import SplitStage
        return SplitStage
    raise AttributeError(f"module 'aioready.modeling' has no attribute {name!r}")
