"""The transport protocol: what a runtime needs to move messages between ranks, and no more.

Message-driven: every message says what it is, so the receiver routes it to the task it unblocks
whatever the order it arrives in. How a message is written on the wire is transports/header.py.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

from ..errors import ProtocolError

__all__ = ["MessageKind", "Message", "Transport", "WrappedTransport", "Deliver", "OnFailure",
           "outside_world"]


class MessageKind(enum.IntEnum):
    """What a message carries; the value travels in the header."""

    ACTIVATION = 0  # output of F(s-1, m), for F(s, m)
    GRADIENT = 1  # input gradient of B(s+1, m), for B(s, m)
    DECISION = 2  # a tensor-parallel leader's choice
    CONTROL = 3  # errors, heartbeats, telemetry gathering
    NOTICE = 4  # "I started the task that feeds yours" (forecast.py): advisory, header only


@dataclass(frozen=True, slots=True)
class Message:
    """One message: `stage` is the stage it is for (the receiver's), `tensors` its payload.

    `source` is the rank that sent it. The receiving transport sets it from what it knows (MPI's
    status, the in-process sender), so it never travels in the header and cannot disagree with
    the true sender. A sender may name itself (the runtime does): the in-process transport then
    delivers that very object instead of a copy, and replaces any other value.
    """

    step: int
    kind: MessageKind
    stage: int
    microbatch: int
    tensors: tuple[Any, ...] = ()
    tag: int = 0  # kind-specific extra field (e.g. the decision's task kind)
    source: int | None = None

    def received_from(self, source: int) -> "Message":
        """This message as delivered: the same fields, with the rank that sent it."""
        return Message(self.step, self.kind, self.stage, self.microbatch, self.tensors,
                       self.tag, source)

    def describe(self) -> str:
        return (f"{self.kind.name.lower()} for stage {self.stage} microbatch {self.microbatch} "
                f"step {self.step}")


def _fast_init() -> Callable[..., None]:
    """`Message.__init__` through its slots' own setters: the frozen dataclass's generated one
    calls `object.__setattr__` for each field, 0.56 us a message here against 0.33 (a message
    is built for every send and every receive: docs/hot_path_measurements.md "The message
    path"). Same fields, same defaults, still frozen (assignment raises as before)."""
    s_step, s_kind, s_stage, s_mb, s_tensors, s_tag, s_source = (
        getattr(Message, name).__set__ for name in
        ("step", "kind", "stage", "microbatch", "tensors", "tag", "source"))

    def __init__(self: Message, step: int, kind: MessageKind, stage: int, microbatch: int,
                 tensors: tuple[Any, ...] = (), tag: int = 0, source: int | None = None) -> None:
        s_step(self, step)
        s_kind(self, kind)
        s_stage(self, stage)
        s_mb(self, microbatch)
        s_tensors(self, tensors)
        s_tag(self, tag)
        s_source(self, source)

    __init__.__qualname__ = "Message.__init__"
    return __init__


Message.__init__ = _fast_init()  # type: ignore[method-assign]


Deliver = Callable[[Message], None]
OnFailure = Callable[[BaseException], None]


@runtime_checkable
class Transport(Protocol):
    """The whole surface a runtime needs from a transport, and no more.

    - `open(deliver, on_failure=None)`: start receiving; `deliver` is called on the loop thread
      for every message, in arrival order, with `source` set, and must not block. An error found
      while receiving (a malformed message, `deliver` raising) is passed to `on_failure`, the
      receiver's way to stop its step; without one the transport raises it as it can.
    - `send_nowait(dest, msg)`: start a send and return at once; the payload stays untouched until
      the send completes.
    - `wait_sent()`: wait until every send started so far has completed.
    - `close()`: stop receiving and release resources.
    """

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def open(self, deliver: Deliver, *, on_failure: OnFailure | None = None) -> None: ...

    def send_nowait(self, dest: int, msg: Message) -> None: ...

    async def wait_sent(self) -> None: ...

    async def close(self) -> None: ...


class WrappedTransport:
    """A transport around another one (sealing, instrumenting): the identity, the receive side
    and the shutdown are the inner transport's unless a wrapper overrides them, so each wrapper
    writes only what it adds."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def world_size(self) -> int:
        return self.inner.world_size

    def open(self, deliver: Deliver, *, on_failure: OnFailure | None = None) -> None:
        self.inner.open(deliver, on_failure=on_failure)

    def send_nowait(self, dest: int, msg: Message) -> None:
        self.inner.send_nowait(dest, msg)

    async def wait_sent(self) -> None:
        await self.inner.wait_sent()

    async def close(self) -> None:
        await self.inner.close()


def outside_world(rank: int, world_size: int, dest: int) -> ProtocolError:
    """The error of a send to a rank that does not exist (every transport refuses it alike;
    the range test itself stays inline on the send path)."""
    return ProtocolError("send to a rank outside the world", rank=rank,
                         expected=f"0..{world_size - 1}", got=dest)
