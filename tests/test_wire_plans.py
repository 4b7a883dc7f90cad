"""The MPI transport's precompiled plans (wire_plans.py): the same bytes as the general encoder,
the same messages as the general decoder, and anything a plan was not made for left to the
general path (which raises what is wrong)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from aioready.transports.base import Message, MessageKind
from aioready.transports.header import DTYPE_CODES
from aioready.transports.tensor_bytes import host_bytes
from aioready.transports.wire import WireCodec
from aioready.transports.wire_plans import ReceivePlans, SendPlans


def general(codec: WireCodec, msg: Message) -> np.ndarray:
    descriptors, sizes, _ = codec.describe(msg.tensors)
    return np.frombuffer(codec.encode_inline(msg, descriptors, sizes), np.uint8).copy()


def same_as_general(codec: WireCodec, msg: Message, wire: bytes | None) -> np.ndarray:
    """`wire`, a send plan's bytes for `msg`, checked to be the general encoder's, as a fresh
    buffer for a receive plan to read."""
    assert wire is not None and wire == general(codec, msg).tobytes()
    return np.frombuffer(wire, np.uint8).copy()


def learned(codec: WireCodec, plans: ReceivePlans, wire: np.ndarray) -> None:
    _, layout = codec.decode(wire, source=1)
    plans.learn(wire, layout)


@pytest.mark.parametrize("dtype", sorted(DTYPE_CODES))
def test_plans_write_and_read_what_the_general_path_does(dtype: str) -> None:
    codec = WireCodec()
    send, receive = SendPlans(codec, 1 << 16), ReceivePlans()
    dt = getattr(torch, dtype)
    base = (torch.arange(24, dtype=torch.float64) * 1.5 - 7).to(dt).reshape(2, 3, 4)
    for step in range(3):  # the first message teaches the receiver, the next ones use its plan
        x = base if dt == torch.bool else base + step
        msg = Message(step, MessageKind.GRADIENT, 2, 5 + step, (x,), tag=9)
        wire = send.encode(msg)
        if dt.is_complex:  # no plan: a lazy conjugate of the same key needs resolving
            assert wire is None
            continue
        buf = same_as_general(codec, msg, wire)
        got = receive.message(buf, 4)
        if step == 0:
            assert got is None  # nothing learned yet
            learned(codec, receive, buf)
            continue
        if dt == torch.bfloat16:  # no numpy dtype: the general path's int16 view
            assert got is None
            continue
        assert got == Message(step, MessageKind.GRADIENT, 2, 5 + step, got.tensors, 9, 4)
        assert len(got.tensors) == 1 and got.tensors[0].dtype == dt
        assert torch.equal(got.tensors[0], x)


def test_the_send_plan_declines_what_it_was_not_made_for() -> None:
    send = SendPlans(WireCodec(), 1 << 10, multi=False)  # several tensors: test_multi_plans
    m = lambda *ts: Message(0, MessageKind.ACTIVATION, 1, 0, ts)  # noqa: E731
    base = torch.randn(6, 5)
    assert send.encode(m(base)) is not None
    for msg in (m(), m(None), m(base, base), m(base.t()), m(torch.zeros(0)),
                m(torch.zeros(1 << 9)), m(base.to_sparse()), m("text")):
        assert send.encode(msg) is None, msg.tensors
    assert send.encode(m(base.t().contiguous())) is not None


def test_a_received_message_unlike_its_plan_goes_the_general_way() -> None:
    codec = WireCodec()
    send, receive = SendPlans(codec, 1 << 16), ReceivePlans()
    msg = Message(0, MessageKind.ACTIVATION, 1, 0, (torch.zeros(2, 3),))
    buf = np.frombuffer(send.encode(msg), np.uint8).copy()  # type: ignore[arg-type]
    learned(codec, receive, buf)
    assert receive.message(buf, 0) is not None
    # the same length, another shape (3, 2): a different descriptor
    other = general(codec, Message(0, MessageKind.ACTIVATION, 1, 0, (torch.zeros(3, 2),)))
    assert len(other) == len(buf) and receive.message(other, 0) is None
    for offset, value in ((0, 0x58), (2, 7), (3, 200), (3, int(MessageKind.CONTROL)), (18, 2)):
        bad = buf.copy()
        bad[offset] = value  # magic, version, unknown kind, control, tensor count
        assert receive.message(bad, 0) is None, offset
    assert receive.message(buf[:-16], 0) is None  # another length: no plan


def test_header_only_messages_are_read_by_a_plan_as_the_general_path_reads_them() -> None:
    """A message without tensors (a notice, a stage that passes nothing) is learned too: the
    next ones of its length are the general decoder's `Message`, with their own fields; a
    control message, or one with a tensor, is not taken."""
    codec = WireCodec()
    receive = ReceivePlans()
    first = general(codec, Message(0, MessageKind.NOTICE, 1, 0, (), tag=5))
    assert receive.message(first, 2) is None
    learned(codec, receive, first)
    for msg in (Message(3, MessageKind.NOTICE, 4, 7, (), tag=(1 << 31) | 12),
                Message(1, MessageKind.ACTIVATION, 2, 9), Message(2, MessageKind.GRADIENT, 0, 3)):
        wire = general(codec, msg)
        header, layout = codec.decode(wire, source=6)
        expected = codec.message(header, codec.inline_tensors(wire, layout))
        got = receive.message(wire, 6)
        assert got == expected == dataclasses.replace(msg, source=6) and got.tensors == ()
    control = general(codec, Message(0, MessageKind.CONTROL, 0, 0, ()))
    assert len(control) == len(first) and receive.message(control, 0) is None
    counted = first.copy()
    counted[18] = 1  # claims a tensor: not the plan's layout
    assert receive.message(counted, 0) is None


def test_message_built_through_its_slots_is_the_dataclass_it_was() -> None:
    """base.py's faster `Message.__init__`: same fields and defaults, equality, hash, repr,
    still frozen, `dataclasses.replace` still works."""
    t = (torch.ones(2),)
    a = Message(3, MessageKind.NOTICE, 1, 2, t, 7, 5)
    assert (a.step, a.kind, a.stage, a.microbatch, a.tensors, a.tag, a.source) == \
        (3, MessageKind.NOTICE, 1, 2, t, 7, 5)
    assert a == Message(3, MessageKind.NOTICE, 1, 2, tensors=t, tag=7, source=5)
    assert hash(a) == hash(Message(3, MessageKind.NOTICE, 1, 2, t, 7, 5))
    assert Message(1, MessageKind.ACTIVATION, 0, 0) == Message(1, MessageKind.ACTIVATION, 0, 0,
                                                               (), 0, None)
    assert repr(a).startswith("Message(step=3, kind=<MessageKind.NOTICE: 4>, stage=1")
    assert dataclasses.replace(a, step=4).step == 4 and a.received_from(9).source == 9
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.step = 4  # type: ignore[misc]
    with pytest.raises(TypeError):
        Message(1, MessageKind.ACTIVATION, 0)  # type: ignore[call-arg]


def test_lazy_conjugates_and_negations_travel_with_their_values() -> None:
    """A lazy view's memory holds the other sign: the general path resolves it (it used to send
    the memory as it is), and no plan takes it."""
    codec = WireCodec()
    send = SendPlans(codec, 1 << 16)
    lazy = [torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64).conj(),
            torch._neg_view(torch.tensor([1.0, -2.0])),  # what .conj().imag and friends make
            torch.tensor([1 + 2j, 3 - 1j]).conj().imag]
    for x in lazy:
        msg = Message(0, MessageKind.ACTIVATION, 1, 0, (x,))
        assert send.encode(msg) is None
        got = general(codec, msg)
        header, layout = codec.decode(got, source=0)
        assert torch.equal(codec.inline_tensors(got, layout)[0], x)
        raw = torch.from_numpy(host_bytes(x).copy())  # the payload channel's bytes
        assert torch.equal(raw.view(x.dtype).reshape(x.shape), x)


@pytest.mark.parametrize("nbytes", [16387, 1 << 16])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.bfloat16])
def test_a_large_payload_travels_as_the_general_path_writes_it(nbytes: int,
                                                               dtype: torch.dtype) -> None:
    """Up to the inline limit, padding included, and read back from a numpy buffer and from
    the bytearray the MPI transport receives small headers into."""
    codec = WireCodec()
    send, receive = SendPlans(codec, 1 << 16), ReceivePlans()
    x = torch.randn(nbytes // dtype.itemsize, requires_grad=True).to(dtype)
    msg = Message(4, MessageKind.ACTIVATION, 1, 2, (x,), tag=3)
    wire = send.encode(msg)
    buf = same_as_general(codec, msg, wire)
    learned(codec, receive, buf)
    if dtype != torch.bfloat16:  # (no numpy dtype: the general path's)
        for into in (buf, bytearray(wire)):
            got = receive.message(into, 0)
            assert got is not None and torch.equal(got.tensors[0], x.detach())


@pytest.mark.parametrize("nbytes", [15, 16, 60, 16387])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.bfloat16])
def test_zero_copy_parts_are_the_bytes_of_the_general_path(nbytes: int,
                                                           dtype: torch.dtype) -> None:
    """From `zero_copy` payload bytes a plan gives the parts of the message (header with its
    padding, the tensor, its size, the zero bytes after it) that the MPI transport sends as one
    message from where they are: together, the general encoder's bytes."""
    codec = WireCodec()
    send = SendPlans(codec, 1 << 16, zero_copy=16)
    x = torch.randn(max(nbytes // dtype.itemsize, 1), requires_grad=True).to(dtype)
    msg = Message(4, MessageKind.ACTIVATION, 1, 2, (x,), tag=3)
    parts = send.encode(msg)
    assert isinstance(parts, tuple) == (x.nbytes >= 16)
    if isinstance(parts, tuple):
        head, t, n, tail = parts
        assert t is x and n == x.nbytes
        wire = head + host_bytes(x.detach()).tobytes() + bytes(tail)
    else:
        wire = parts
    assert wire == general(codec, msg).tobytes()
