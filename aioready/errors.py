"""The exception classes of aioready.

Every error carries the fields that say where it happened (rank, step, task) and what was expected
and what was got, and builds its message from them, so that a message that crossed ranks as plain
text still reads the same. Errors cross ranks as fields or text, never pickles.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AioreadyError",
    "ConfigError",
    "HintError",
    "TraceError",
    "ProtocolError",
    "StageError",
    "PeerLostError",
    "StallError",
    "CheckpointError",
    "CoordinationError",
    "DivergedError",
    "InternalError",
]


class AioreadyError(Exception):
    """Base of every aioready error; carries rank, step, task, expected and got."""

    def __init__(
        self,
        what: str,
        *,
        rank: int | None = None,
        step: int | None = None,
        task: Any = None,
        expected: Any = None,
        got: Any = None,
        fix: str | None = None,
    ) -> None:
        self.what = what
        self.rank = rank
        self.step = step
        self.task = task
        self.expected = expected
        self.got = got
        self.fix = fix
        super().__init__(self._format())

    def locate(self, *, rank: int | None = None, step: int | None = None) -> "AioreadyError":
        """Fill in where it happened (fields still unknown) and rebuild the message."""
        if self.rank is None:
            self.rank = rank
        if self.step is None:
            self.step = step
        self.args = (self._format(),)
        return self

    def _format(self) -> str:
        where = []
        if self.rank is not None:
            where.append(f"rank {self.rank}")
        if self.step is not None:
            where.append(f"step {self.step}")
        if self.task is not None:
            where.append(f"task {self.task}")
        text = self.what
        if where:
            text = f"{', '.join(where)}: {text}"
        if self.expected is not None or self.got is not None:
            text += f" (expected {self.expected}, got {self.got})"
        if self.fix:
            text += f"; {self.fix}"
        return text


class ConfigError(AioreadyError, ValueError):
    """Raised when a parameter of Pipeline, simulate or the CLI is out of range or inconsistent."""


class HintError(AioreadyError, ValueError):
    """Raised when a hint order is unknown, malformed, incomplete or violates a dependency."""


class TraceError(AioreadyError, ValueError):
    """Raised when a duration trace or jitter spec cannot be parsed or lacks a task."""


class ProtocolError(AioreadyError):
    """Raised when a message does not match any task this rank expects (header, dtype, shape)."""


class _PeerFailure(AioreadyError):
    """An error that may name a peer: `lost_rank` is the peer this rank lost (None: this rank's
    own failure), `remote` says the error was raised on that peer and reached this rank as text
    (such an error is not broadcast again)."""

    def __init__(self, what: str, *, lost_rank: int | None = None, remote: bool = False,
                 **where: Any) -> None:
        self.lost_rank = lost_rank
        self.remote = remote
        super().__init__(what, **where)


class StageError(_PeerFailure):
    """Raised when a stage's forward or backward raised; carries the original message. On the
    other ranks it is raised with `remote=True` and `lost_rank` the rank whose stage raised."""


class PeerLostError(_PeerFailure):
    """Raised when a peer rank died or stopped answering within the configured bound, or failed
    (`remote=True`: its error text reached this rank); `lost_rank` names that peer."""

    def __init__(self, what: str, *, lost_rank: int, remote: bool = False,
                 **where: Any) -> None:
        super().__init__(what, lost_rank=lost_rank, remote=remote, **where)


class StallError(AioreadyError):
    """Raised when a step made no progress for the configured time; the message holds the dump."""


class CheckpointError(AioreadyError, ValueError):
    """Raised when a checkpoint is missing, corrupt, or belongs to another model or stage count."""


class CoordinationError(AioreadyError):
    """Raised when members of a tensor-parallel group disagree on the task they run."""


class DivergedError(AioreadyError):
    """Raised when a training loss is not finite (NaN or inf) and the run was asked to stop on
    it (`aioready train --on-nan stop`)."""


class InternalError(AioreadyError):
    """Raised when an invariant of the runtime broke: a bug in aioready, please file it."""
