"""In-process transport: every rank is an endpoint of one InprocWorld on one event loop.

A send is a `call_soon` (or, with a delay model, a `call_later`) of the receiver's deliver
function, so messages take the same route-by-header path as over MPI. Tensors are passed by
reference; the receiving stage detaches them. An exception from the receiver's deliver goes to
the receiver's `on_failure`, as a receive error would over MPI. Used by tests, the `sim` device
and the simulator.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from ..errors import ConfigError, ProtocolError
from .base import Deliver, Message, MessageKind, OnFailure, outside_world

__all__ = ["InprocWorld", "InprocTransport"]

DelayFn = Callable[[int, int, Message], float]
DropFn = Callable[[int, int, Message], bool]


class InprocWorld:
    """A set of in-process endpoints; `delay(src, dest, msg)` gives a per-message latency (s).

    `drop(src, dest, msg)` returning True loses that message (fault injection for tests): the
    send completes, nothing arrives.
    """

    def __init__(self, world_size: int, *, delay: DelayFn | None = None,
                 drop: DropFn | None = None) -> None:
        if world_size < 1:
            raise ConfigError("world size must be positive", expected=">= 1", got=world_size)
        self.world_size = world_size
        self.delay = delay
        self.drop = drop
        self.num_dropped = 0
        self._deliver: list[Deliver | None] = [None] * world_size
        self._on_failure: list[OnFailure | None] = [None] * world_size
        self.endpoints = [InprocTransport(self, r) for r in range(world_size)]
        self.num_messages = 0
        self.num_notices = 0  # forecast notices, counted apart from the step's data messages

    def endpoint(self, rank: int) -> "InprocTransport":
        return self.endpoints[rank]


class InprocTransport:
    """One rank's endpoint of an InprocWorld."""

    def __init__(self, world: InprocWorld, rank: int) -> None:
        self._world = world
        self._rank = rank
        self._pending = 0
        self._idle: asyncio.Future[None] | None = None
        self.num_sent = 0

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world.world_size

    @property
    def world(self) -> InprocWorld:
        return self._world

    def open(self, deliver: Deliver, *, on_failure: OnFailure | None = None) -> None:
        self._world._deliver[self._rank] = deliver
        self._world._on_failure[self._rank] = on_failure

    def send_nowait(self, dest: int, msg: Message) -> None:
        world = self._world
        if not 0 <= dest < world.world_size:
            raise outside_world(self._rank, world.world_size, dest)
        loop = asyncio.get_running_loop()
        self.num_sent += 1
        if msg.kind is MessageKind.NOTICE:
            world.num_notices += 1
        else:
            world.num_messages += 1
        if world.drop is not None and world.drop(self._rank, dest, msg):
            world.num_dropped += 1
            return
        self._pending += 1
        delay = world.delay(self._rank, dest, msg) if world.delay else 0.0
        if delay > 0:
            loop.call_later(delay, self._arrive, dest, msg)
        else:
            loop.call_soon(self._arrive, dest, msg)

    def _arrive(self, dest: int, msg: Message) -> None:
        deliver = self._world._deliver[dest]
        self._pending -= 1
        if self._pending == 0 and self._idle is not None and not self._idle.done():
            self._idle.set_result(None)
        if deliver is None:
            raise ProtocolError("message for a rank that has not opened its endpoint",
                                rank=dest, expected="an open endpoint", got=msg.describe())
        try:
            # a sender that named itself (the runtime does) is delivered as sent: one Message
            # per message, not two (docs/hot_path_measurements.md "The reserving policy's
            # share")
            deliver(msg if msg.source == self._rank else msg.received_from(self._rank))
        except Exception as exc:
            on_failure = self._world._on_failure[dest]
            if on_failure is None:
                raise
            on_failure(exc)

    async def wait_sent(self) -> None:
        if self._pending:
            self._idle = asyncio.get_running_loop().create_future()
            await self._idle

    async def close(self) -> None:
        self._world._deliver[self._rank] = None
        self._world._on_failure[self._rank] = None

    def __repr__(self) -> str:
        return f"<InprocTransport rank={self._rank}/{self.world_size} pending={self._pending}>"
