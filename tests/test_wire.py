"""The MPI transport's wire codec and receive pool, without MPI: bytes in, tensors out."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from aioready.errors import ProtocolError
from aioready.transports.base import Message, MessageKind
from aioready.transports.header import DTYPE_CODES, decode_header, encode_header
from aioready.transports.receive_pool import ReceivePool
from aioready.transports.tensor_bytes import spec_of
from aioready.transports.wire import WireCodec, align


def roundtrip(codec: WireCodec, msg: Message) -> Message:
    descriptors, sizes, on_cuda = codec.describe(msg.tensors)
    assert not on_cuda
    wire = np.frombuffer(codec.encode_inline(msg, descriptors, sizes), np.uint8).copy()
    header, layout = codec.decode(wire, source=3)
    assert len(wire) == layout.inline_len
    got = codec.message(header, codec.inline_tensors(wire, layout))
    assert msg.source is None and got.source == 3
    return got


def same(a: Message, b: Message) -> None:
    assert (a.step, a.kind, a.stage, a.microbatch, a.tag) == \
        (b.step, b.kind, b.stage, b.microbatch, b.tag)
    assert len(a.tensors) == len(b.tensors)
    for x, y in zip(a.tensors, b.tensors):
        if x is None:
            assert y is None
            continue
        assert y.dtype == x.dtype and y.shape == x.shape
        assert torch.equal(y, x)


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "plain"])
@pytest.mark.parametrize("dtype", sorted(DTYPE_CODES))
def test_every_dtype_roundtrips_twice_through_the_caches(dtype: str, fast: bool) -> None:
    codec = WireCodec(fast=fast)
    dt = getattr(torch, dtype)
    x = (torch.arange(24, dtype=torch.float64) * 1.5 - 7).to(dt).reshape(2, 3, 4)
    for step in range(3):  # first a cache miss, then hits
        msg = Message(step, MessageKind.GRADIENT, 2, 5 + step, (x + 0 if dt != torch.bool
                                                               else x,), tag=9)
        same(roundtrip(codec, msg), msg)


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "plain"])
def test_tuples_none_slots_scalars_empty_and_strided_tensors(fast: bool) -> None:
    codec = WireCodec(fast=fast)
    base = torch.randn(6, 5, dtype=torch.float64)
    tensors = (base.t(), None, torch.tensor(3.5), torch.empty(0, 4), base[::2],
               torch.ones(3, requires_grad=True))
    msg = Message(1, MessageKind.ACTIVATION, 1, 0, tensors)
    got = roundtrip(codec, msg)
    same(got, Message(1, MessageKind.ACTIVATION, 1, 0,
                      tuple(None if t is None else t.detach() for t in tensors)))
    assert all(t is None or not t.requires_grad for t in got.tensors)


def test_cache_tells_layouts_apart_and_matches_the_reference_encoder() -> None:
    codec = WireCodec()
    for seq in (16, 17, 16, 9, 17):  # a different sequence length per microbatch
        x = torch.randn(2, seq, 8)
        msg = Message(0, MessageKind.ACTIVATION, 1, seq, (x,))
        descriptors, sizes, _ = codec.describe(msg.tensors)
        header = codec.fixed(msg, 1) + descriptors
        assert header == encode_header(msg, [spec_of(x)])
        assert sizes == [x.nbytes]
        same(roundtrip(codec, msg), msg)


def test_header_only_message_decodes_without_payload() -> None:
    codec = WireCodec()
    msg = Message(4, MessageKind.DECISION, 0, 2, (), tag=1)
    wire = np.frombuffer(codec.encode_inline(msg, b"", []), np.uint8).copy()
    assert len(wire) == align(len(encode_header(msg, [])))
    header, layout = codec.decode(wire, source=0)
    # the sender leaves `source` unset; the receiver names the rank it came from
    assert codec.message(header, codec.inline_tensors(wire, layout)) == msg.received_from(0)
    assert decode_header(memoryview(wire[:layout.header_len]))[0] == msg


@pytest.mark.parametrize("corrupt, what", [
    (lambda b: b[:7], "truncated"),
    (lambda b: np.concatenate([np.frombuffer(b"XX", np.uint8), b[2:]]), "not an aioready"),
    (lambda b: _set(b, 3, 200), "unknown kind"),
    (lambda b: _set(b, 18, 40), "too many tensors"),
    (lambda b: _set(b, 20, 99), "bad shape"),
    (lambda b: _set(b, 19, 77), "unknown dtype"),
])
def test_bad_headers_raise_what_is_wrong_even_after_a_cache_hit(corrupt, what: str) -> None:
    codec = WireCodec()
    msg = Message(0, MessageKind.ACTIVATION, 1, 0, (torch.zeros(2, 3),))
    good = roundtrip(codec, msg)  # warms both caches
    same(good, msg)
    descriptors, sizes, _ = codec.describe(msg.tensors)
    wire = np.frombuffer(codec.encode_inline(msg, descriptors, sizes), np.uint8).copy()
    with pytest.raises(ProtocolError, match=what) as info:
        codec.decode(corrupt(wire), source=5)
    assert "rank 5" in str(info.value)


def _set(buf: np.ndarray, offset: int, value: int) -> np.ndarray:
    buf = buf.copy()
    buf[offset] = value
    return buf


def test_too_many_tensors_or_dims_refused_at_the_sender() -> None:
    codec = WireCodec()
    with pytest.raises(ProtocolError, match="too many tensors"):
        codec.describe(tuple(torch.zeros(1) for _ in range(17)))
    with pytest.raises(ProtocolError, match="too many dimensions"):
        codec.describe((torch.zeros([1] * 9),))


def test_pool_reuses_a_buffer_only_once_no_tensor_views_it() -> None:
    pool = ReceivePool(min_bytes=1024, max_bytes=1 << 20)
    a = pool.tensor((64, 4), "float32", 1024)
    a.fill_(1.0)
    view = a[3:5]
    del a
    gc.collect()
    b = pool.tensor((64, 4), "float32", 1024)  # `view` still sees the first buffer
    assert pool.num_allocated == 2 and pool.num_reused == 0
    b.fill_(2.0)
    assert torch.all(view == 1.0)
    del view, b
    c = pool.tensor((256,), "int32", 1024)
    assert pool.num_reused == 1 and c.dtype == torch.int32 and c.shape == (256,)
    d = pool.tensor((512,), "bfloat16", 1024)  # no numpy dtype: through int16
    assert d.dtype == torch.bfloat16 and d.shape == (512,)


def test_pool_holds_at_most_its_budget() -> None:
    pool = ReceivePool(min_bytes=1, max_bytes=4096)
    kept = [pool.tensor((1024,), "uint8", 1024) for _ in range(8)]
    assert pool.held_bytes == 4096 and pool.num_allocated == 8
    assert len({t.data_ptr() for t in kept}) == 8  # no buffer handed out twice while in use
    del kept
    gc.collect()
    again = [pool.tensor((1024,), "uint8", 1024) for _ in range(5)]
    # only the four newest were kept: they come back, the fifth is new
    assert pool.num_reused == 4 and pool.num_allocated == 9 and pool.held_bytes == 4096
    assert len({t.data_ptr() for t in again}) == 5
