"""The device protocol: where a task's compute runs and how its end is awaited.

A device receives the task's identity (for duration models and telemetry) and a plain callable
that does the torch work; it returns the callable's result when the work is done, without ever
blocking the event loop.
"""

from __future__ import annotations

from typing import Awaitable, Callable, NamedTuple, Protocol, TypeVar, runtime_checkable

from ..tasks import Kind

__all__ = ["TaskInfo", "Device"]

T = TypeVar("T")


class TaskInfo(NamedTuple):
    """Who runs what: used by duration models, the sim device and telemetry. A named tuple
    (immutable, like Span) because the runtime builds one per task: 0.16 us where a frozen
    dataclass took 0.5 (docs/hot_path_measurements.md "The pieces")."""

    step: int
    rank: int
    stage: int
    chunk: int
    microbatch: int
    kind: Kind


@runtime_checkable
class Device(Protocol):
    """`run(info, fn)` runs `fn` (the task's compute) and returns its result, awaitably."""

    def run(self, info: TaskInfo, fn: Callable[[], T]) -> Awaitable[T]: ...

    def close(self) -> None: ...
