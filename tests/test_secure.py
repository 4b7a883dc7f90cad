"""SecureTransport in one process: sealed messages round-trip exactly, a sealed pipeline computes
what the unsplit model does, and tampered, replayed, truncated, unsealed or mis-keyed messages
are refused with a ProtocolError naming the sender; reordered ones are delivered in order. The
key file must be readable by its owner only."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from aioready.errors import ConfigError, ProtocolError
from aioready.runtime.pipeline import Pipeline
from aioready.testing.helpers import make_mlp_stages, max_grad_diff, mse_loss, reference_step
from aioready.transports.base import Message, MessageKind
from aioready.transports.inproc import InprocWorld
from aioready.transports.secure import SecureTransport, key_fingerprint, load_key

pytestmark = pytest.mark.timeout(60)
KEY, SESSION = bytes(range(32)), b"session-1"


class Tap:
    """A transport between the sealing layer and the wire that lets a test touch what passes."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.sent: list[tuple[int, Message]] = []
        self.hold = False
        self.rank, self.world_size = inner.rank, inner.world_size

    def open(self, deliver: Any, *, on_failure: Any = None) -> None:
        self.inner.open(deliver, on_failure=on_failure)

    def send_nowait(self, dest: int, msg: Message) -> None:
        self.sent.append((dest, msg))
        if not self.hold:
            self.inner.send_nowait(dest, msg)

    async def wait_sent(self) -> None:
        await self.inner.wait_sent()

    async def close(self) -> None:
        await self.inner.close()


def _pair(key1: bytes = KEY, session1: bytes = SESSION) -> tuple[Tap, SecureTransport,
                                                                 list[Message], list[BaseException]]:
    world = InprocWorld(2)
    tap = Tap(world.endpoints[0])
    sender = SecureTransport(tap, key=KEY, session=SESSION)
    receiver = SecureTransport(world.endpoints[1], key=key1, session=session1)
    got: list[Message] = []
    errors: list[BaseException] = []
    sender.open(lambda m: None)
    receiver.open(got.append, on_failure=errors.append)
    return tap, sender, got, errors


def _msg(mb: int, *tensors: Any) -> Message:
    return Message(3, MessageKind.ACTIVATION, 1, mb, tuple(tensors))


async def test_sealed_messages_round_trip_exactly() -> None:
    tap, sender, got, errors = _pair()
    cases = [(torch.randn(4, 5, dtype=torch.float64),), (torch.arange(7), None),
             (torch.randn(3, 2).t(), torch.zeros(0, 3), torch.ones((), dtype=torch.bfloat16)),
             (), (torch.tensor([True, False]), torch.randn(2, dtype=torch.complex64))]
    for mb, tensors in enumerate(cases):
        sender.send_nowait(1, _msg(mb, *tensors))
    await sender.wait_sent()
    await asyncio.sleep(0)
    assert not errors, errors
    assert [m.microbatch for m in got] == list(range(len(cases)))
    for m, tensors in zip(got, cases):
        assert m.source == 0 and (m.step, m.kind, m.stage) == (3, MessageKind.ACTIVATION, 1)
        assert len(m.tensors) == len(tensors)
        for a, b in zip(m.tensors, tensors):
            assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b))
    # on the wire: one uint8 payload, none of the plaintext bytes in it
    secret = cases[0][0]
    blob = tap.sent[0][1].tensors[0]
    assert blob.dtype == torch.uint8 and secret.numpy().tobytes() not in blob.numpy().tobytes()


async def test_sealed_pipeline_matches_the_unsplit_model() -> None:
    world = InprocWorld(4)
    stages = make_mlp_stages(4, seed=7)
    ref = make_mlp_stages(4, seed=7)
    pipes = [Pipeline([stages[r]], mse_loss, microbatches=4, hint="1f1b", num_stages=4,
                      transport=SecureTransport(world.endpoints[r], key=KEY, session=SESSION))
             for r in range(4)]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 16, generator=gen, dtype=torch.float64)
    y = torch.randn(8, 16, generator=gen, dtype=torch.float64)
    losses = await asyncio.gather(*(p.step(x if r == 0 else None, y if r == 3 else None)
                                    for r, p in enumerate(pipes)))
    ref_loss, ref_stages = reference_step(ref, mse_loss, list(x.split(2)), list(y.split(2)))
    assert float(losses[3]) == pytest.approx(float(ref_loss), abs=1e-12)
    assert max_grad_diff(stages, ref_stages) < 1e-12
    for p in pipes:
        p.close()


def _mutate_blob(msg: Message, fn: Callable[[torch.Tensor], torch.Tensor]) -> Message:
    return Message(msg.step, msg.kind, msg.stage, msg.microbatch, (fn(msg.tensors[0]),), msg.tag)


def _flip(at: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def fn(blob: torch.Tensor) -> torch.Tensor:
        blob = blob.clone()
        blob[at] ^= 1
        return blob
    return fn


@pytest.mark.parametrize("tamper, what", [
    (lambda m: _mutate_blob(m, _flip(-20)), "failed authentication"),  # a ciphertext byte
    (lambda m: _mutate_blob(m, _flip(-1)), "failed authentication"),  # the tag
    (lambda m: _mutate_blob(m, _flip(13)), "failed authentication"),  # the segment size
    (lambda m: _mutate_blob(m, _flip(25)),
     "failed authentication|bad shape|truncated|segment count"),  # descriptors
    (lambda m: _mutate_blob(m, lambda b: b[:-5]), "truncated"),
    (lambda m: Message(m.step + 1, m.kind, m.stage, m.microbatch, m.tensors, m.tag),
     "failed authentication"),  # a header field
    (lambda m: Message(m.step, m.kind, m.stage, m.microbatch + 1, m.tensors, m.tag),
     "failed authentication"),
    (lambda m: _msg(0, torch.zeros(3)), "is not sealed"),
])
async def test_tampered_message_is_refused_naming_the_sender(tamper: Any, what: str) -> None:
    tap, sender, got, errors = _pair()
    tap.hold = True
    sender.send_nowait(1, _msg(0, torch.randn(4, 4)))
    dest, sealed = tap.sent[0]
    tap.inner.send_nowait(dest, tamper(sealed))
    await asyncio.sleep(0)
    assert not got and len(errors) == 1, (got, errors)
    assert isinstance(errors[0], ProtocolError) and "from rank 0" in str(errors[0])
    assert __import__("re").search(what, str(errors[0])), errors[0]


async def test_replayed_message_is_refused_and_reordered_ones_come_in_order() -> None:
    tap, sender, got, errors = _pair()
    tap.hold = True
    for mb in range(3):
        sender.send_nowait(1, _msg(mb, torch.full((2,), float(mb))))
    for i in (2, 0, 1):  # the network reorders: the receiver restores the sealed order
        tap.inner.send_nowait(1, tap.sent[i][1])
    await asyncio.sleep(0)
    assert [m.microbatch for m in got] == [0, 1, 2] and not errors
    tap.inner.send_nowait(1, tap.sent[1][1])  # a replay
    await asyncio.sleep(0)
    assert len(errors) == 1 and "message from rank 0 was replayed" in str(errors[0])
    assert len(got) == 3


@pytest.mark.parametrize("key, session", [(bytes(32), SESSION), (KEY, b"another run")])
async def test_another_key_or_session_is_refused(key: bytes, session: bytes) -> None:
    tap, sender, got, errors = _pair(key, session)
    sender.send_nowait(1, _msg(0, torch.randn(3)))
    await asyncio.sleep(0)
    assert not got and "failed authentication" in str(errors[0])


def test_key_file_must_be_private(tmp_path: Path) -> None:
    path = tmp_path / "key"
    path.write_text(KEY.hex() + "\n")
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="readable by others.*chmod 600"):
        load_key(path)
    os.chmod(path, 0o600)
    assert load_key(path) == KEY
    path.write_bytes(KEY)
    assert load_key(path) == KEY
    path.write_bytes(b"short")
    with pytest.raises(ConfigError, match="does not hold a key"):
        load_key(path)
    with pytest.raises(ConfigError, match="cannot read the key file"):
        load_key(tmp_path / "missing")
    assert key_fingerprint(KEY) != key_fingerprint(bytes(32)) and len(key_fingerprint(KEY)) == 16
    with pytest.raises(ConfigError, match="session"):
        SecureTransport(InprocWorld(2).endpoints[0], key=KEY, session=b"")


async def test_a_refused_output_leaves_no_gap_in_the_sequence() -> None:
    """A stage output that cannot travel is refused at the sender without using a sequence
    number: otherwise the receiver would hold every later message (the error broadcast too)."""
    tap, sender, got, errors = _pair()
    with pytest.raises(ConfigError, match="cannot travel"):
        sender.send_nowait(1, _msg(0, torch.zeros(2, dtype=torch.uint16)))
    sender.send_nowait(1, _msg(1, torch.ones(2)))
    await asyncio.sleep(0)
    assert [m.microbatch for m in got] == [1] and not errors
