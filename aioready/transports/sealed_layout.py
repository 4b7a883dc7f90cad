"""The byte layout of one sealed segment (transports/secure.py): the plaintext of a message's
tensors, and a received segment's prefix parsed and checked against its own length before
anything is decrypted. Nothing here is authentic until the segment's tag verifies."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from ..errors import ProtocolError
from .base import Message
from .header import _FIXED, DTYPE_SIZES, HEADER_MAGIC, MAX_NDIM, MAX_TENSORS, decode_header
from .tensor_bytes import from_bytes, host_bytes, torch_module

TAG_BYTES = 16
COMMON = struct.Struct("<QIII")  # seq, descriptor length, segment bytes, count
INDEX = struct.Struct("<I")
PREFIX_BYTES = COMMON.size + INDEX.size
MAX_DESC = MAX_TENSORS * (2 + 8 * MAX_NDIM)
INDEX_BITS = 24  # the nonce's last 8 bytes are seq << INDEX_BITS | segment index
MAX_SEQ = 1 << (64 - INDEX_BITS)


def align(n: int) -> int:
    return (n + 15) // 16 * 16


class Segment:
    """One received segment's prefix, checked against its own length (not yet authentic)."""

    __slots__ = ("seq", "seg", "count", "index", "common", "specs", "sizes", "total",
                 "seg_len", "body")


def parse(rank: int, src: int, msg: Message) -> Segment:
    where = f"message from rank {src}"
    blob = msg.tensors[0] if len(msg.tensors) == 1 else None
    if blob is None or str(getattr(blob, "dtype", "")) != "torch.uint8" or blob.dim() != 1 \
            or blob.numel() < PREFIX_BYTES + TAG_BYTES:
        raise ProtocolError(f"{where} is not sealed", rank=rank, expected="one sealed uint8 "
                            "payload (both ends need the same key)", got=msg.describe())
    buf = (blob.cpu() if blob.is_cuda else blob).numpy()
    seq, dlen, seg_bytes, count = COMMON.unpack_from(buf, 0)
    (index,) = INDEX.unpack_from(buf, COMMON.size)
    head = align(PREFIX_BYTES + dlen)
    if dlen > MAX_DESC or head + TAG_BYTES > len(buf) or seq >= MAX_SEQ or \
            count > 1 << INDEX_BITS:
        raise ProtocolError(f"{where} has a bad sealed prefix", rank=rank,
                            expected=f"descriptors of <= {MAX_DESC} bytes, sequence < {MAX_SEQ}"
                            f", <= {1 << INDEX_BITS} segments",
                            got=f"{dlen} bytes, sequence {seq}, {count} segments")
    s = Segment()
    desc = bytes(buf[PREFIX_BYTES:PREFIX_BYTES + dlen])
    s.seq, s.seg, s.count, s.index = seq, seg_bytes, count, index
    s.common = bytes(buf[:COMMON.size]) + desc
    s.specs = _specs(desc, src, msg)
    s.sizes = [0 if sp.dtype is None else _nbytes(sp) for sp in s.specs]
    s.total = layout_len(s.sizes)
    if not seg_bytes or count != max(1, -(-s.total // seg_bytes)) or index >= count:
        raise ProtocolError(f"{where} has a bad segment count", rank=rank,
                            expected=f"{max(1, -(-s.total // max(seg_bytes, 1)))} segments of "
                            f"{seg_bytes} bytes for {s.total} bytes",
                            got=f"segment {index} of {count}")
    s.seg_len = min(seg_bytes, s.total - index * seg_bytes) if s.total else 0
    if head + s.seg_len + TAG_BYTES != len(buf):
        raise ProtocolError(f"{where} was truncated or padded", rank=rank,
                            expected=f"{head + s.seg_len + TAG_BYTES} bytes", got=len(buf))
    s.body = buf[head:]
    return s


def opened(msg: Message, src: int, specs: list[Any], sizes: list[int],
            plain: np.ndarray) -> Message:
    tensors, off = [], 0
    for spec, n in zip(specs, sizes):
        if spec.dtype is None:
            tensors.append(None)
            continue
        tensors.append(from_bytes(plain[off:off + n], spec.dtype, spec.shape) if n else
                       torch_module().empty(spec.shape, dtype=_dtype(spec.dtype)))
        off += align(n)
    return Message(msg.step, msg.kind, msg.stage, msg.microbatch, tuple(tensors), msg.tag, src)


def plaintext(tensors: list[Any]) -> Any:
    """The tensors' bytes, each at a 16-byte aligned offset; one contiguous tensor: no copy."""
    present = [t for t in tensors if t is not None and t.numel()]
    if len(present) == 1 and len(tensors) == 1:
        return host_bytes(present[0])
    sizes = [0 if t is None else t.nbytes for t in tensors]
    out = np.zeros(layout_len(sizes), np.uint8)
    off = 0
    for t, n in zip(tensors, sizes):
        if n:
            out[off:off + n] = host_bytes(t)
            off += align(n)
    return out


def layout_len(sizes: list[int]) -> int:
    nonzero = [n for n in sizes if n]
    if len(nonzero) == 1 and len(sizes) == 1:
        return nonzero[0]
    return sum(align(n) for n in nonzero)


def _specs(desc: bytes, src: int, msg: Message) -> list[Any]:
    """Parse (and bound) the descriptors with the header decoder itself."""
    n = _count(desc)
    fixed = _FIXED.pack(HEADER_MAGIC, 1, int(msg.kind), msg.step, msg.stage, msg.microbatch,
                        msg.tag, n)
    return decode_header(fixed + desc, source=src)[1]


def _count(desc: bytes) -> int:
    n, off = 0, 0
    while off + 2 <= len(desc) and n <= MAX_TENSORS:
        off += 2 + 8 * desc[off + 1]
        n += 1
    return n


def _nbytes(spec: Any) -> int:
    n = DTYPE_SIZES[spec.dtype]
    for d in spec.shape:
        n *= d
    return n


def _dtype(name: str) -> Any:
    return getattr(torch_module(), name)

