"""Which microbatch the running stage computes, for stage modules that keep state per microbatch.

The executor sets it around every call of a stage module (forward and its recomputation); a
module reads it with `running_microbatch()`. A context variable rather than an argument, so
that stage modules keep the plain `forward(*inputs)` signature; it is per thread and per task,
so stages computing at once on different threads never see each other's value. Outside a
pipeline it is None.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

__all__ = ["running_microbatch", "microbatch_scope"]

_MICROBATCH: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "aioready_microbatch", default=None)


def running_microbatch() -> int | None:
    """The microbatch of the stage computation running in this context, or None."""
    return _MICROBATCH.get()


@contextlib.contextmanager
def microbatch_scope(mb: int) -> Iterator[None]:
    token = _MICROBATCH.set(mb)
    try:
        yield
    finally:
        _MICROBATCH.reset(token)
