"""Caps: how many microbatches each rank may hold in flight, from one written form.

`Pipeline(cap=...)`, `aioready.simulate(cap=...)`, `aioready train --cap` and `aioready simulate
--cap` all accept the same forms, parsed here and nowhere else:

    None          every rank its default cap (the hint's own peak in-flight count, hints.py)
    4  or "4"     every rank 4
    "2x"          2 times each rank's default, rounded up ("1.5x" too)
    [4, 3, None]  one per rank (None: that rank's default); as text "4,3,2,1"

`parse_cap` checks the form alone (a command line can refuse a bad value before any work);
`resolve_caps` turns a form into one int per rank of a hint.
"""

from __future__ import annotations

import math
import operator
from typing import Sequence, Union

from .errors import ConfigError
from .hints import HintOrder

__all__ = ["CapSpec", "parse_cap", "resolve_caps", "parse_factor"]

CapSpec = Union[int, str, Sequence[Union[int, None]], None]
"""What a caller may pass as `cap` (see the module's note)."""

FORMS = ("None, an int >= 1, 'Nx' (N times the hint's peak in-flight), or one int per rank "
         "(a list, or text like '4,3,2,1')")


def _count(value: object, cap: object, rank: int | None = None) -> int:
    """One per-rank count: an integer >= 1 (bool and float are refused, not rounded)."""
    if isinstance(value, bool):
        raise ConfigError("cap", rank=rank, expected=FORMS, got=repr(cap))
    try:
        count = operator.index(value)  # type: ignore[call-overload]
    except TypeError:
        raise ConfigError("cap", rank=rank, expected=FORMS, got=repr(cap)) from None
    if count < 1:
        raise ConfigError("cap must admit at least one microbatch", rank=rank,
                          expected=">= 1", got=repr(cap))
    return count


def parse_factor(text: str, what: str, expected: str) -> float:
    """'2x' -> 2.0, '1.5X' -> 1.5: a positive finite multiple (the "Nx" form of caps and of
    memory budgets); a ConfigError naming `what` and `expected` otherwise."""
    try:
        factor = float(text.strip().lower()[:-1])
    except ValueError:
        factor = math.nan
    if not (factor > 0 and math.isfinite(factor)):
        raise ConfigError(what, expected=expected, got=repr(text))
    return factor


def _parse_text(text: str) -> int | str | tuple[int | None, ...]:
    form = text.strip().lower()
    if form.endswith("x"):
        parse_factor(text, "cap factor", "a positive multiple of the hint's peak in-flight, "
                     "like '2x' or '1.5x'")
        return form
    words = form.split(",")
    if not all(w.strip().isdigit() for w in words):
        raise ConfigError("cap", expected=FORMS, got=repr(text))
    if len(words) == 1:
        return _count(int(words[0]), text)
    return tuple(_count(int(w), text, rank) for rank, w in enumerate(words))


def parse_cap(cap: CapSpec) -> int | str | tuple[int | None, ...] | None:
    """Check the form of `cap`; text becomes what it says ("4" -> 4, "4,3" -> (4, 3)), a factor
    stays text ("2x": it needs a hint). Raise ConfigError naming the value otherwise."""
    if cap is None:
        return None
    if isinstance(cap, str):
        return _parse_text(cap)
    if isinstance(cap, Sequence) and not isinstance(cap, bytes):
        return tuple(None if c is None else _count(c, cap, rank) for rank, c in enumerate(cap))
    return _count(cap, cap)


def resolve_caps(cap: CapSpec, hint: HintOrder) -> list[int]:
    """One cap per rank of `hint`, from any form `parse_cap` accepts."""
    form = parse_cap(cap)
    defaults = list(hint.default_caps or ())
    if form is None:
        return defaults
    if isinstance(form, int):
        return [form] * hint.num_ranks
    if isinstance(form, str):  # "Nx"; the epsilon keeps a product like 1.1 * 10 at 11, not 12
        factor = float(form[:-1])
        return [max(1, math.ceil(factor * c - 1e-9)) for c in defaults]
    if len(form) != hint.num_ranks:
        raise ConfigError("cap: one per rank", expected=f"{hint.num_ranks} caps",
                          got=f"{len(form)} ({cap!r})")
    return [d if c is None else c for c, d in zip(form, defaults)]
