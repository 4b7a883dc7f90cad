"""The hint library: pure functions from (placement, microbatches) to a HintOrder.

Each scheduler lives in its own module, imported on first use. `make_hint` resolves a hint given
as a name, a path to a hint file, or a HintOrder. No asyncio, torch or communication in here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import HintError
from ..hints import HintOrder
from ..placement import Placement

__all__ = ["HINTS", "HintSpec", "make_hint", "hint_names"]


@dataclass(frozen=True, slots=True)
class HintSpec:
    """Where a named hint lives and which placement it needs."""

    target: str  # "module:function" inside aioready.schedulers
    style: str = "linear"  # placement style it builds for
    chunks: int = 1  # chunks per rank (for interleaved: the default v)
    needs_split: bool | None = None  # True/False: forces split backward; None: either


HINTS: dict[str, HintSpec] = {
    "gpipe": HintSpec("gpipe:gpipe"),
    "1f1b": HintSpec("onefoneb:one_f_one_b"),
}


def hint_names() -> list[str]:
    return sorted(HINTS)


def _function(spec: HintSpec) -> Callable[..., HintOrder]:
    module, func = spec.target.split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), func)  # type: ignore[no-any-return]


def make_hint(
    hint: str | HintOrder | Path,
    *,
    num_stages: int,
    num_ranks: int | None = None,
    num_microbatches: int,
    split_backward: bool = False,
) -> HintOrder:
    """Resolve `hint` (a name, a hint file path, or a HintOrder) for this pipeline's shape."""
    if isinstance(hint, HintOrder):
        return hint
    key = str(hint)
    spec = HINTS.get(key.lower())
    if spec is None:
        path = Path(key)
        if path.exists():
            return HintOrder.load(path)
        raise HintError(
            "unknown hint", expected=f"one of {', '.join(hint_names())} or a hint file path",
            got=repr(key),
        )
    if spec.needs_split is not None and spec.needs_split != split_backward:
        raise HintError(
            f"hint {key!r} needs split_backward={spec.needs_split}",
            expected=f"split_backward={spec.needs_split}", got=f"split_backward={split_backward}",
        )
    if num_ranks is None:
        num_ranks = num_stages // spec.chunks if spec.style != "linear" else num_stages
    placement = Placement(num_stages, num_ranks, spec.style)
    return _function(spec)(placement, num_microbatches, split_backward=split_backward)
