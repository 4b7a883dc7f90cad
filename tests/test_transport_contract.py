"""What every transport promises a receiver (transports/base.py): messages arrive with the rank
that sent them, and a failure while receiving reaches the receiver's `on_failure`."""

from __future__ import annotations

import pytest

from aioready.telemetry.instruments import InstrumentedTransport, Instruments
from aioready.transports.base import Message, MessageKind, Transport
from aioready.transports.inproc import InprocWorld

pytestmark = pytest.mark.timeout(60)


def test_inproc_endpoints_are_transports() -> None:
    assert isinstance(InprocWorld(2).endpoint(0), Transport)


@pytest.mark.parametrize("instrumented", [False, True])
async def test_inproc_delivers_with_the_source_and_reports_failures(instrumented: bool) -> None:
    world = InprocWorld(3)
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
    world.endpoint(0).send_nowait(1, Message(0, MessageKind.ACTIVATION, 1, 7))
    await world.endpoint(2).wait_sent()
    await world.endpoint(0).wait_sent()
    assert [(m.source, m.microbatch) for m in got] == [(2, 3), (0, 7)]
    assert sent.source is None  # the sender's message is untouched
    assert len(failures) == 1 and str(failures[0]) == "receiver broke"
