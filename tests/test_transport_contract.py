"""What every transport promises a receiver (transports/base.py): messages arrive with the rank
that sent them, and a failure while receiving reaches the receiver's `on_failure`. The in-process
transport and TorchDistTransport (over an in-process gloo world) are checked alike."""

from __future__ import annotations

import asyncio
from typing import Callable

import pytest

from aioready.clock import run_virtual
from aioready.devices.sim import SimDevice
from aioready.errors import InternalError
from aioready.runtime.pipeline import Pipeline
from aioready.telemetry.instruments import InstrumentedTransport, Instruments
from aioready.transports.base import Message, MessageKind, Transport
from aioready.transports.inproc import InprocWorld

pytestmark = pytest.mark.timeout(60)


class _Torch:
    """Endpoints of TorchDistTransport over a 3-rank gloo world in this process."""

    def __init__(self, n: int) -> None:
        from aioready.testing.gloo import gloo_world
        from aioready.transports.torchdist import TorchDistTransport
        self.ends = [TorchDistTransport(g) for g in gloo_world(n)]

    def endpoint(self, rank: int) -> Transport:
        return self.ends[rank]  # type: ignore[return-value]

    async def close(self) -> list[BaseException | None]:
        """Close every rank at once; what each close raised (a receive error is raised again)."""
        return await asyncio.gather(*(t.close() for t in self.ends), return_exceptions=True)


class _Inproc:
    def __init__(self, n: int) -> None:
        self.world = InprocWorld(n)

    def endpoint(self, rank: int) -> Transport:
        return self.world.endpoint(rank)

    async def close(self) -> list[BaseException | None]:
        return []


WORLDS = {"inproc": _Inproc, "torchdist": _Torch}
BROKE = {"inproc": "receiver broke",  # a real transport says where, as MPITransport does
         "torchdist": "rank 1: deliver raised ValueError: receiver broke"}


@pytest.mark.parametrize("kind", sorted(WORLDS))
def test_endpoints_are_transports(kind: str) -> None:
    assert isinstance(WORLDS[kind](2).endpoint(0), Transport)


@pytest.mark.parametrize("kind", sorted(WORLDS))
@pytest.mark.parametrize("instrumented", [False, True])
async def test_delivers_with_the_source_and_reports_failures(instrumented: bool,
                                                             kind: str) -> None:
    world = WORLDS[kind](3)
    got: list[Message] = []
    failures: list[BaseException] = []

    def deliver(msg: Message) -> None:
        got.append(msg)
        if msg.microbatch == 7:
            raise ValueError("receiver broke")
    receiver: Transport = world.endpoint(1)
    if instrumented:  # a wrapper passes both on
        receiver = InstrumentedTransport(receiver, Instruments())
    receiver.open(deliver, on_failure=failures.append)
    sent = Message(0, MessageKind.ACTIVATION, 1, 3)
    world.endpoint(2).send_nowait(1, sent)
    await world.endpoint(2).wait_sent()
    await _until(lambda: len(got) == 1)
    world.endpoint(0).send_nowait(1, Message(0, MessageKind.ACTIVATION, 1, 7))
    await world.endpoint(0).wait_sent()
    await _until(lambda: len(got) == 2)
    closed = await world.close()
    assert [(m.source, m.microbatch) for m in got] == [(2, 3), (0, 7)]
    assert sent.source is None  # the sender's message is untouched
    assert len(failures) == 1 and str(failures[0]) == BROKE[kind]
    if closed:  # the receiver's close raises the error again, its peers close cleanly
        assert [None if c is None else str(c) for c in closed] == [None, BROKE[kind], None]


async def _until(cond: Callable[[], bool]) -> None:
    """A send completed does not mean delivered on a real network: wait for the receiver."""
    while not cond():
        await asyncio.sleep(0.001)


def test_a_failing_control_handler_stops_the_receivers_step() -> None:
    pipe = Pipeline([None] * 2, None, microbatches=4, hint="1f1b", stall_timeout=None,
                    device=SimDevice(lambda info: 1.0, run_compute=False))
    seen: list[Message] = []

    def broken(msg: Message) -> None:
        seen.append(msg)
        raise ValueError("control handler broke")
    pipe.runtimes[1].add_control_handler(broken)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.call_later(2.5, pipe.runtimes[0].transport.send_nowait, 1,
                        Message(0, MessageKind.CONTROL, 0, 0))
        await pipe.step()
    with pytest.raises(InternalError) as info:
        run_virtual(main())
    assert "ValueError in the runtime: control handler broke" in str(info.value)
    assert [m.source for m in seen] == [0]
