"""Memory budgets: how many activation bytes each rank may hold, from one written form.

`Pipeline(memory=...)`, `aioready.simulate(memory=...)`, `aioready train --memory` and
`aioready simulate --memory` accept the same forms, parsed here and nowhere else:

    None                 no byte budget: the count cap (aioready.caps) gates alone
    "24GiB", "1.5GB"     bytes per rank; units B, kB/KB, MB, GB, TB (powers of 1000) and
                         KiB, MiB, GiB, TiB (powers of 1024), case-insensitive
    1073741824           an int of bytes
    "2x"                 2 times the bytes the hint's own order holds at its peak on each rank
                         (its peak in-flight count times the rank's mean bytes per microbatch,
                         measured: held_bytes.HeldBytes)
    ["8GiB", "6GiB"]     one per rank (a list, or text like "8GiB,6GiB")

A byte budget replaces the count cap: giving both `cap=` and `memory=` is refused (one gate,
one meaning). `parse_memory` checks the form alone (a command line refuses a bad value before
any work); `resolve_memory` gives one `Budget` per rank (docs/policy.md "Memory budgets").
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass
from typing import Sequence, Union

from .caps import parse_factor
from .errors import ConfigError

__all__ = ["MemorySpec", "Budget", "parse_memory", "resolve_memory", "parse_bytes",
           "format_bytes", "check_one_gate", "UNITS"]

MemorySpec = Union[int, str, Sequence[Union[int, str]], None]
"""What a caller may pass as `memory` (see the module's note)."""

UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
FORMS = ("None, bytes per rank ('24GiB', '512MiB', '1.5GB', an int >= 1), 'Nx' (N times the "
         "hint's own peak bytes), or one per rank (a list, or text like '8GiB,6GiB')")
_SIZE = re.compile(r"^\s*([+-]?[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class Budget:
    """One rank's budget: `bytes` fixed, or `factor` times its hint's peak bytes (measured).

    `count`: also at most this many microbatches in flight, checked wherever the bytes are (a
    count-capped schedule the tuner chose within a byte budget, with the byte gate kept as a
    backstop; under the reservation max(count, the order's peak + 1): docs/policy_measurements.md
    "Count caps within the bytes"); not a written form, a Budget is passed as it is."""

    bytes: int | None = None
    factor: float | None = None
    count: int | None = None

    def __str__(self) -> str:
        return f"{self.factor:g}x" if self.factor is not None else format_bytes(self.bytes or 0)


def format_bytes(n: float) -> str:
    """'1.5 GiB' and the like (reports and errors)."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if abs(n) >= UNITS[unit.lower()]:
            return f"{n / UNITS[unit.lower()]:.3g} {unit}"
    return f"{n:.0f} B"


def _bad(memory: object, rank: int | None = None) -> ConfigError:
    return ConfigError("memory", rank=rank, expected=FORMS, got=repr(memory))


def parse_bytes(value: object, memory: object = None, rank: int | None = None) -> int:
    """A byte count from an int or a text with a unit; >= 1 byte, finite, no bool or float."""
    shown = value if memory is None else memory
    if isinstance(value, bool):
        raise _bad(shown, rank)
    if isinstance(value, str):
        match = _SIZE.match(value)
        unit = match.group(2).lower() if match else ""
        if match is None or unit not in UNITS and unit != "":
            raise ConfigError("memory: a size with a known unit", rank=rank,
                              expected=f"a number and one of {', '.join(UNITS)} (like "
                              "'24GiB')", got=repr(shown))
        count = float(match.group(1)) * UNITS[unit or "b"]
        if not math.isfinite(count) or count < 1:
            raise ConfigError("memory must be at least one byte", rank=rank,
                              expected=">= 1 byte", got=repr(shown))
        return int(count)
    try:
        count = operator.index(value)  # type: ignore[call-overload]
    except TypeError:
        raise _bad(shown, rank) from None
    if count < 1:
        raise ConfigError("memory must be at least one byte", rank=rank, expected=">= 1 byte",
                          got=repr(shown))
    return int(count)


def _one(value: object, memory: object, rank: int | None = None) -> Budget:
    if isinstance(value, Budget):
        if value.count is not None and (isinstance(value.count, bool)
                                        or not isinstance(value.count, int) or value.count < 1):
            raise ConfigError("memory: a budget's microbatch count", rank=rank,
                              expected="an int >= 1 or None", got=repr(value.count))
        return value
    if isinstance(value, str) and value.strip().lower().endswith("x"):
        return Budget(factor=parse_factor(value, "memory factor", "a positive finite multiple "
                                          "of the hint's own peak bytes, like '2x' or '1.5x'"))
    return Budget(bytes=parse_bytes(value, memory, rank))


def parse_memory(memory: MemorySpec) -> Budget | tuple[Budget, ...] | None:
    """Check the form of `memory`: one Budget for every rank, one per rank, or None. Raise a
    ConfigError naming the value otherwise."""
    if memory is None:
        return None
    if isinstance(memory, str):
        words = memory.split(",")
        if len(words) == 1:
            return _one(memory, memory)
        return tuple(_one(w, memory, rank) for rank, w in enumerate(words))
    if isinstance(memory, Sequence) and not isinstance(memory, bytes):
        if not memory:
            raise _bad(memory)
        return tuple(_one(m, memory, rank) for rank, m in enumerate(memory))
    if isinstance(memory, float):
        raise _bad(memory)
    return _one(memory, memory)


def resolve_memory(memory: MemorySpec, num_ranks: int) -> list[Budget] | None:
    """One Budget per rank from any form `parse_memory` accepts (None: no byte budget)."""
    form = parse_memory(memory)
    if form is None:
        return None
    if isinstance(form, Budget):
        return [form] * num_ranks
    if len(form) != num_ranks:
        raise ConfigError("memory: one per rank", expected=f"{num_ranks} budgets",
                          got=f"{len(form)} ({memory!r})")
    return list(form)


def check_one_gate(cap: object, memory: object) -> None:
    """`cap=` counts microbatches, `memory=` bytes: one gate at a time, so both is refused."""
    if cap is not None and memory is not None:
        raise ConfigError("cap and memory both given", expected="cap= (microbatches in flight) "
                          "or memory= (activation bytes), not both", got=f"cap={cap!r}, "
                          f"memory={memory!r}", fix="drop one of them")
