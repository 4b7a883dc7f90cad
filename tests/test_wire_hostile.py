"""The wire is hostile input: every header field is bounded before anything is allocated, a
stage output that cannot travel is a clear error at the sender, and thousands of random and
mutated headers at the decoder give only ProtocolError naming the sender."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aioready.errors import ConfigError, ProtocolError
from aioready.transports.base import Message, MessageKind
from aioready.transports.header import (
    _DESC,
    _FIXED,
    HEADER_MAGIC,
    MAX_CONTROL_BYTES,
    MAX_MESSAGE_BYTES,
    MAX_TENSORS,
    decode_header,
)
from aioready.transports.wire import WireCodec

pytestmark = pytest.mark.timeout(120)


def _header(kind: int, shapes: list[tuple[int, ...]], code: int = 0) -> np.ndarray:
    out = _FIXED.pack(HEADER_MAGIC, 1, kind, 0, 1, 0, 0, len(shapes))
    for shape in shapes:
        out += _DESC.pack(code, len(shape)) + struct.pack(f"<{len(shape)}q", *shape)
    return np.frombuffer(out, np.uint8).copy()


def test_sixteen_huge_tensors_are_refused_before_any_allocation() -> None:
    eight_gib = (1 << 31,)  # float32: 8 GiB each
    buf = _header(int(MessageKind.ACTIVATION), [eight_gib] * MAX_TENSORS)
    with pytest.raises(ProtocolError, match="rank 3.*too large") as info:
        WireCodec().decode(buf, 3)
    assert "bytes" in str(info.value)


@pytest.mark.parametrize("shape", [(1 << 62, 1 << 62), (1 << 62, 0), (1 << 40, 1 << 40, 0)])
def test_overflowing_shapes_are_refused(shape: tuple[int, ...]) -> None:
    with pytest.raises(ProtocolError, match="rank 2.*too large"):
        WireCodec().decode(_header(int(MessageKind.GRADIENT), [shape]), 2)


def test_control_payload_over_4_kib_is_refused() -> None:
    ok = _header(int(MessageKind.CONTROL), [(MAX_CONTROL_BYTES,)], code=8)
    WireCodec().decode(ok, 1)
    big = _header(int(MessageKind.CONTROL), [(16 << 20,)], code=8)  # 16 MiB of "error text"
    with pytest.raises(ProtocolError, match="rank 1.*control message"):
        WireCodec().decode(big, 1)
    codec = WireCodec()  # a layout seen before in an activation does not let it through
    codec.decode(_header(int(MessageKind.ACTIVATION), [(16 << 20,)], code=8), 1)
    with pytest.raises(ProtocolError, match="control message"):
        codec.decode(big, 1)


@pytest.mark.parametrize("value, what", [
    (torch.zeros(3, dtype=torch.uint16), "dtype uint16"),
    (torch.zeros(3).to(torch.float8_e4m3fn), "dtype float8_e4m3fn"),
    (torch.zeros(3, 3).to_sparse(), "layout torch.sparse_coo"),
    (3.5, "float"),
    ("text", "str"),
])
def test_stage_output_that_cannot_travel_is_a_config_error(value: object, what: str) -> None:
    codec = WireCodec()
    codec.describe((torch.zeros(3, 3),))  # a dense layout of the same dtype and shape cached
    with pytest.raises(ConfigError, match="cannot travel between ranks") as info:
        codec.describe((value,))
    assert what in str(info.value)


# -- fuzz ------------------------------------------------------------------------------------

def _valid() -> list[bytes]:
    codec = WireCodec()
    out = []
    for tensors in [(torch.zeros(2, 3),), (torch.ones(4, dtype=torch.int64), None),
                    (), (torch.zeros(0, 5, dtype=torch.bfloat16), torch.zeros(1, 1, 1))]:
        msg = Message(7, MessageKind.ACTIVATION, 2, 1, tensors)
        descriptors, sizes, _ = codec.describe(msg.tensors)
        out.append(codec.encode_inline(msg, descriptors, sizes))
    return out


VALID = _valid()


def _check_decoder(codec: WireCodec, data: bytes) -> None:
    buf = np.frombuffer(data, np.uint8).copy()
    try:
        header, layout = codec.decode(buf, 9)
    except ProtocolError as exc:
        assert "rank 9" in str(exc)
        return
    total = sum(layout.sizes)
    assert total <= MAX_MESSAGE_BYTES
    if header[1] is MessageKind.CONTROL:
        assert total <= MAX_CONTROL_BYTES
    assert len(layout.specs) <= MAX_TENSORS
    if len(buf) == layout.inline_len:  # what the transport then views: in bounds
        codec.inline_tensors(buf, layout)


@settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.binary(max_size=400))
def test_random_bytes_give_only_protocol_errors(data: bytes) -> None:
    _check_decoder(WireCodec(), data)
    # and as the tail of a plausible fixed part (so the descriptors are reached)
    _check_decoder(WireCodec(), _FIXED.pack(HEADER_MAGIC, 1, 0, 0, 1, 0, 0, 2) + data)


@settings(max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.sampled_from(range(len(VALID))),
       st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255)), min_size=1, max_size=8),
       st.integers(0, 100), st.booleans())
def test_mutated_headers_give_only_protocol_errors(which: int, edits: list[tuple[int, int]],
                                                   cut: int, warm: bool) -> None:
    codec = WireCodec()
    good = VALID[which]
    if warm:  # the cached fast path must refuse what the slow path refuses
        codec.decode(np.frombuffer(good, np.uint8).copy(), 9)
    data = bytearray(good)
    for pos, value in edits:
        if pos < len(data):
            data[pos] = value
    _check_decoder(codec, bytes(data[:len(data) - cut] if cut < len(data) else data))


def test_decode_header_names_the_sender_for_each_bound() -> None:
    for buf in (_header(0, [(1 << 31,)] * 16),
                _header(int(MessageKind.CONTROL), [(1 << 20,)], code=8)):
        with pytest.raises(ProtocolError, match="from rank 4"):
            decode_header(memoryview(buf), source=4)
