"""SecureTransport's segments: a message larger than one segment travels as several inner
messages sealed and opened in worker threads; it round-trips exactly in any arrival order, and
a segment altered, moved to another index, taken from another message, cut short, replayed or
given another count is refused with a ProtocolError naming the sender."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from aioready.errors import ConfigError, ProtocolError
from aioready.transports.base import Message, MessageKind
from aioready.transports.inproc import InprocWorld
from aioready.transports.secure import SecureTransport
from tests.test_secure import KEY, SESSION, Tap

pytestmark = pytest.mark.timeout(60)
SEG = 64 << 10


@pytest.fixture(params=[False, True], ids=["on the loop", "in threads"])
def threads(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


async def _pair(threads: bool) -> tuple[Tap, SecureTransport, SecureTransport, list[Message],
                           list[BaseException]]:
    world = InprocWorld(2)
    tap = Tap(world.endpoints[0])
    sender = SecureTransport(tap, key=KEY, session=SESSION, segment_bytes=SEG, threads=threads)
    receiver = SecureTransport(world.endpoints[1], key=KEY, session=SESSION, segment_bytes=SEG,
                               threads=threads)
    got: list[Message] = []
    errors: list[BaseException] = []
    sender.open(lambda m: None)
    receiver.open(got.append, on_failure=errors.append)
    return tap, sender, receiver, got, errors


def _msg(mb: int, *tensors: Any) -> Message:
    return Message(3, MessageKind.ACTIVATION, 1, mb, tuple(tensors))


async def _settle(receiver: SecureTransport) -> None:
    """Until the open worker has finished what it was given and its results are handled."""
    for _ in range(3):
        if receiver.threads:  # one worker: a no-op after the queued segments ends after them
            await asyncio.get_running_loop().run_in_executor(receiver._worker("open"),
                                                             lambda: None)
        await asyncio.sleep(0)


async def _sealed(tap: Tap, sender: SecureTransport, msg: Message) -> list[Message]:
    tap.hold = True
    before = len(tap.sent)
    sender.send_nowait(1, msg)
    await sender.wait_sent()
    return [m for _, m in tap.sent[before:]]


def _with_blob(m: Message, blob: torch.Tensor) -> Message:
    return Message(m.step, m.kind, m.stage, m.microbatch, (blob,), m.tag)


async def test_segmented_messages_round_trip_exactly_in_any_order(threads: bool) -> None:
    tap, sender, receiver, got, errors = await _pair(threads)
    gen = torch.Generator().manual_seed(3)
    cases = [(torch.randn(SEG // 4 * 5 + 3, generator=gen),),  # 6 segments, the last short
             (torch.randn(SEG // 8 * 2, dtype=torch.float64, generator=gen),),  # exactly 2
             (torch.randn(300, 200, generator=gen).t(), None, torch.arange(40000))]
    for mb, tensors in enumerate(cases):
        sender.send_nowait(1, _msg(mb, *tensors))
    await sender.wait_sent()
    await _settle(receiver)
    assert not errors, errors
    assert [m.microbatch for m in got] == [0, 1, 2]
    for m, tensors in zip(got, cases):
        assert m.source == 0 and len(m.tensors) == len(tensors)
        for a, b in zip(m.tensors, tensors):
            assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b))
    assert len(tap.sent) == 6 + 2 + 9  # one inner message per segment (9: 240000 + 320000 B)
    secret = cases[0][0].numpy().tobytes()[:4096]
    assert all(secret not in m.tensors[0].numpy().tobytes() for _, m in tap.sent)
    # the network delivers the segments of two messages interleaved and backwards
    parts = await _sealed(tap, sender, _msg(3, cases[0][0])) + \
        await _sealed(tap, sender, _msg(4, cases[1][0]))
    for m in reversed(parts):
        tap.inner.send_nowait(1, m)
    await asyncio.sleep(0)
    await _settle(receiver)
    assert not errors and [m.microbatch for m in got[3:]] == [3, 4]
    assert torch.equal(got[3].tensors[0], cases[0][0])


def _swap_bodies(parts: list[Message]) -> list[Message]:
    """Segments 0 and 1 exchange their ciphertext, each keeping its own prefix."""
    a, b = (p.tensors[0].clone() for p in parts[:2])
    head = 48
    a[head:], b[head:] = parts[1].tensors[0][head:], parts[0].tensors[0][head:]
    return [_with_blob(parts[0], a), _with_blob(parts[1], b), *parts[2:]]


def _flip_body(parts: list[Message]) -> list[Message]:
    blob = parts[2].tensors[0].clone()
    blob[100] ^= 1
    return [*parts[:2], _with_blob(parts[2], blob), *parts[3:]]


def _cut_last(parts: list[Message]) -> list[Message]:
    return [*parts[:-1], _with_blob(parts[-1], parts[-1].tensors[0][:-7])]


def _count(parts: list[Message]) -> list[Message]:
    blob = parts[1].tensors[0].clone()
    blob[16] += 1  # the count (after seq 8, descriptor length 4, segment bytes 4)
    return [parts[0], _with_blob(parts[1], blob), *parts[2:]]


def _huge_seq(parts: list[Message]) -> list[Message]:
    blob = parts[0].tensors[0].clone()
    blob[7] = 0xFF  # seq >= 2**56: no room for the segment index in the nonce
    return [_with_blob(parts[0], blob)]


def _replay(parts: list[Message]) -> list[Message]:
    return [parts[0], parts[1], parts[1], *parts[2:]]


@pytest.mark.parametrize("tamper, what", [
    (_swap_bodies, "segment [01] of 6 of message from rank 0 failed authentication"),
    (_flip_body, "segment 2 of 6 of message from rank 0 failed authentication"),
    (_cut_last, "message from rank 0 was truncated or padded"),
    (_count, "message from rank 0 has a bad segment count"),
    (_replay, "message from rank 0 was replayed.*segment 1 of sequence 0"),
    (_huge_seq, "message from rank 0 has a bad sealed prefix.*sequence 1837"),
])
async def test_a_tampered_segment_is_refused_naming_the_sender(tamper: Any, what: str,
                                                               threads: bool) -> None:
    tap, sender, receiver, got, errors = await _pair(threads)
    x = torch.randn(SEG // 4 * 5 + 3)
    parts = await _sealed(tap, sender, _msg(0, x))
    assert len(parts) == 6
    raised: list[BaseException] = []
    for m in tamper(parts):
        try:
            receiver._arrive(m.received_from(0))
        except ProtocolError as exc:
            raised.append(exc)
    await _settle(receiver)
    failures = raised + errors
    assert failures and all(isinstance(e, ProtocolError) for e in failures), failures
    assert __import__("re").search(what, str(failures[0])), failures[0]
    if tamper is not _replay:
        assert not got  # nothing of an altered message reaches the runtime


async def test_a_segment_of_another_message_is_refused(threads: bool) -> None:
    tap, sender, receiver, got, errors = await _pair(threads)
    first = await _sealed(tap, sender, _msg(0, torch.randn(SEG // 2)))
    second = await _sealed(tap, sender, _msg(1, torch.randn(SEG // 2)))
    seq1 = second[1].tensors[0].clone()
    seq1[48:] = first[1].tensors[0][48:]  # message 1's segment 1 carrying message 0's bytes
    for m in [*first, second[0], _with_blob(second[1], seq1)]:
        tap.inner.send_nowait(1, m)
    await asyncio.sleep(0)
    await _settle(receiver)
    assert [m.microbatch for m in got] == [0]
    assert "segment 1 of 2 of message from rank 0 failed authentication" in str(errors[0])


async def test_a_missing_segment_holds_the_message_and_later_ones(threads: bool) -> None:
    """A lost segment is a lost message: nothing is delivered from it or after it (the stall
    watchdog or the peer timeout ends the step, docs/security.md)."""
    tap, sender, receiver, got, errors = await _pair(threads)
    parts = await _sealed(tap, sender, _msg(0, torch.randn(SEG // 2)))
    later = await _sealed(tap, sender, _msg(1, torch.randn(4)))
    for m in [parts[0], *later]:
        tap.inner.send_nowait(1, m)
    await asyncio.sleep(0)
    await _settle(receiver)
    assert not got and not errors


def test_segment_size_is_bounded() -> None:
    with pytest.raises(ConfigError, match="segment_bytes"):
        SecureTransport(InprocWorld(2).endpoints[0], key=KEY, session=SESSION,
                        segment_bytes=100)
