"""The hint library: pure functions from (placement, microbatches) to a HintOrder.

Each family lives in its own module, imported on first use: gpipe, onefoneb (1f1b),
interleaved (interleaved-1f1b, interleaved-zb), zb (zb-h1, zb-h2), zbv, rules (bf, bfw), and
from_torch (import of a torch.distributed.pipelining order). `make_hint` resolves a hint given as
a name, a path to a hint file, or a HintOrder. No asyncio, torch or communication in here (the
torch import loads torch inside its functions only).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, replace
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
    style: str = "linear"  # placement style it builds for (a rule: the default one)
    chunks: int = 1  # chunks per rank (for interleaved: the default v)
    needs_split: bool | None = None  # True/False: forces split backward; None: either
    rule: bool = False  # a priority rule: any placement, documented caps, derived sequence


HINTS: dict[str, HintSpec] = {
    "gpipe": HintSpec("gpipe:gpipe"),
    "1f1b": HintSpec("onefoneb:one_f_one_b"),
    "interleaved-1f1b": HintSpec("interleaved:interleaved_1f1b", "interleaved", 2),
    "interleaved-zb": HintSpec("interleaved:interleaved_zb", "interleaved", 2, True),
    "zb-h1": HintSpec("zb:zb_h1", needs_split=True),
    "zb-h2": HintSpec("zb:zb_h2", needs_split=True),
    "zbv": HintSpec("zbv:zbv", "v", 2, True),
    "bf": HintSpec("rules:bf", rule=True),
    "bfw": HintSpec("rules:bfw", needs_split=True, rule=True),
}


def hint_names() -> list[str]:
    return sorted(HINTS)


def _function(spec: HintSpec) -> Callable[..., HintOrder]:
    module, func = spec.target.split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), func)  # type: ignore[no-any-return]


def _from_file(path: Path, num_stages: int, num_ranks: int | None, num_microbatches: int,
               split_backward: bool) -> HintOrder:
    hint = HintOrder.load(path)
    p = hint.placement
    got = (p.num_stages, p.num_ranks, hint.num_microbatches, hint.split_backward)
    want = (num_stages, num_ranks or p.num_ranks, num_microbatches, split_backward)
    if got != want:
        raise HintError(
            f"hint file {str(path)!r} was written for another pipeline shape",
            expected=f"stages={want[0]} ranks={want[1]} microbatches={want[2]} "
            f"split_backward={want[3]}",
            got=f"stages={got[0]} ranks={got[1]} ({p.num_ranks} rank lines) "
            f"microbatches={got[2]} split_backward={got[3]}")
    if not hint.is_sequence and hint.sequence is None:
        from .listsched import list_schedule
        derived = list_schedule(p, hint.num_microbatches, hint.split_backward, hint.orders,
                                hint.default_caps or ())
        hint = replace(hint, sequence=derived.orders)
    return hint


def make_hint(
    hint: str | HintOrder | Path,
    *,
    num_stages: int,
    num_ranks: int | None = None,
    num_microbatches: int,
    split_backward: bool = False,
    placement: str | None = None,
) -> HintOrder:
    """Resolve `hint` (a name, a hint file path, `torch:<Schedule>`, or a HintOrder).

    `torch:Interleaved1F1B` (any torch.distributed.pipelining schedule name) imports torch's
    compute order for this shape (from_torch.py; loads torch).

    `placement` chooses the placement style of a priority rule (bf, bfw work on any); an order
    hint has its own and refuses another.
    """
    if isinstance(hint, HintOrder):
        return hint
    key = str(hint)
    if key.lower().startswith("torch:"):
        from .from_torch import from_torch_for_shape
        return from_torch_for_shape(key[6:], num_stages=num_stages, num_ranks=num_ranks,
                                    num_microbatches=num_microbatches,
                                    split_backward=split_backward)
    spec = HINTS.get(key.lower())
    if spec is None:
        path = Path(key)
        if path.exists():
            return _from_file(path, num_stages, num_ranks, num_microbatches, split_backward)
        raise HintError(
            "unknown hint", expected=f"one of {', '.join(hint_names())} or a hint file path",
            got=repr(key), fix="or torch:<Schedule> for a torch.distributed.pipelining order",
        )
    if spec.needs_split is not None and spec.needs_split != split_backward:
        raise HintError(
            f"hint {key!r} needs split_backward={spec.needs_split}",
            expected=f"split_backward={spec.needs_split}", got=f"split_backward={split_backward}",
        )
    style = spec.style
    if placement is not None and placement != spec.style:
        if not spec.rule:
            raise HintError(f"hint {key!r} has its own placement", expected=spec.style,
                            got=placement)
        style = placement
    if num_ranks is None:
        chunks = 1 if style == "linear" else (2 if style == "v" else spec.chunks or 2)
        num_ranks = num_stages // chunks
        if num_ranks < 1 or num_ranks * chunks != num_stages:
            raise HintError(f"hint {key!r} cannot place {num_stages} stages",
                            expected=f"a multiple of {chunks} stages ({style} placement)",
                            got=num_stages)
    return _function(spec)(Placement(num_stages, num_ranks, style), num_microbatches,
                           split_backward=split_backward)
