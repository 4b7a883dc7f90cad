"""The message header every transport writes: a fixed binary layout, never a pickle.

A fixed part (magic, version, kind, step, stage, microbatch, tag, tensor count), then one
descriptor per tensor (dtype code, ndim, shape). Stage boundaries carry one tensor or a tuple of
tensors; a None slot (an output with no gradient) travels as a descriptor with dtype code NONE.
`decode_header` validates everything it reads and names the sending rank in its errors, so a
corrupt or foreign message is a ProtocolError, never a misrouted tensor.

The wire is hostile input: every field is bounded before anything is allocated. A message's
payload (the sum of its tensors' bytes, each shape's product counted with empty dimensions as 1,
so no shape can overflow) is at most MAX_MESSAGE_BYTES (AIOREADY_MAX_MESSAGE_BYTES, default
8 GiB); a CONTROL message (a heartbeat, a peer's error text) holds at most one tensor of
MAX_CONTROL_BYTES (4 KiB).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

from ..errors import ProtocolError
from .base import Message, MessageKind

__all__ = ["HEADER_MAGIC", "MAX_TENSORS", "MAX_NDIM", "TensorSpec", "encode_header",
           "decode_header", "DTYPE_CODES", "DTYPE_SIZES", "NONE_DTYPE", "encode_descriptor",
           "MAX_MESSAGE_BYTES", "MAX_CONTROL_BYTES", "check_bounds"]


# dtype codes on the wire; names are torch dtype names so this module needs no torch.
DTYPE_CODES: dict[str, int] = {
    "float32": 0, "float64": 1, "float16": 2, "bfloat16": 3, "int64": 4, "int32": 5,
    "int16": 6, "int8": 7, "uint8": 8, "bool": 9, "complex64": 10, "complex128": 11,
}
DTYPE_SIZES: dict[str, int] = {
    "float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
    "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16,
}
NONE_DTYPE = 255
MAX_MESSAGE_BYTES = int(os.environ.get("AIOREADY_MAX_MESSAGE_BYTES", 8 << 30))
MAX_CONTROL_BYTES = 4096
HEADER_MAGIC = 0xA10D
MAX_TENSORS = 16
MAX_NDIM = 8
_FIXED = struct.Struct("<HBBIHIIB")  # magic, version, kind, step, stage, microbatch, tag, n
_DESC = struct.Struct("<BB")  # dtype code, ndim
_VERSION = 1


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """dtype name (None for an empty slot) and shape of one payload tensor."""

    dtype: str | None
    shape: tuple[int, ...]


def encode_descriptor(spec: TensorSpec) -> bytes:
    """One tensor's descriptor: dtype code, ndim, then the shape as int64s."""
    if len(spec.shape) > MAX_NDIM:
        raise ProtocolError("tensor has too many dimensions", expected=f"<= {MAX_NDIM}",
                            got=len(spec.shape))
    code = NONE_DTYPE if spec.dtype is None else DTYPE_CODES.get(spec.dtype)
    if code is None:
        raise ProtocolError("dtype cannot travel", expected=sorted(DTYPE_CODES),
                            got=spec.dtype)
    return _DESC.pack(code, len(spec.shape)) + struct.pack(f"<{len(spec.shape)}q", *spec.shape)


def encode_header(msg: Message, specs: list[TensorSpec]) -> bytes:
    if len(specs) > MAX_TENSORS:
        raise ProtocolError("too many tensors in one message", expected=f"<= {MAX_TENSORS}",
                            got=len(specs))
    return b"".join([_FIXED.pack(HEADER_MAGIC, _VERSION, int(msg.kind), msg.step, msg.stage,
                                 msg.microbatch, msg.tag, len(specs))]
                    + [encode_descriptor(spec) for spec in specs])


_NAMES = {v: k for k, v in DTYPE_CODES.items()}


def decode_header(data: bytes | memoryview, *, source: int | None = None
                  ) -> tuple[Message, list[TensorSpec]]:
    """Parse a header; raise ProtocolError saying what was wrong and where it came from."""
    buf = bytes(data)
    where = f"from rank {source}" if source is not None else "received"
    if len(buf) < _FIXED.size:
        raise ProtocolError(f"header {where} is truncated",
                            expected=f">= {_FIXED.size} bytes", got=f"{len(buf)} bytes")
    magic, version, kind, step, stage, mb, tag, n = _FIXED.unpack_from(buf, 0)
    if magic != HEADER_MAGIC or version != _VERSION:
        raise ProtocolError(f"header {where} is not an aioready header",
                            expected=f"magic {HEADER_MAGIC:#x} v{_VERSION}",
                            got=f"magic {magic:#x} v{version}")
    try:
        mkind = MessageKind(kind)
    except ValueError:
        raise ProtocolError(f"header {where} has an unknown kind",
                            expected=[k.value for k in MessageKind], got=kind) from None
    if n > MAX_TENSORS:
        raise ProtocolError(f"header {where} has too many tensors", expected=f"<= {MAX_TENSORS}",
                            got=n)
    off = _FIXED.size
    specs = []
    for _ in range(n):
        if off + _DESC.size > len(buf):
            raise ProtocolError(f"header {where} is truncated", expected="tensor descriptors",
                                got=f"{len(buf)} bytes")
        code, ndim = _DESC.unpack_from(buf, off)
        off += _DESC.size
        if ndim > MAX_NDIM or off + 8 * ndim > len(buf):
            raise ProtocolError(f"header {where} has a bad shape", expected=f"ndim <= {MAX_NDIM}",
                                got=ndim)
        shape = struct.unpack_from(f"<{ndim}q", buf, off)
        off += 8 * ndim
        if code != NONE_DTYPE and code not in _NAMES:
            raise ProtocolError(f"header {where} has an unknown dtype code",
                                expected=sorted(_NAMES), got=code)
        if any(d < 0 for d in shape):
            raise ProtocolError(f"header {where} has a negative dimension", expected=">= 0",
                                got=shape)
        specs.append(TensorSpec(None if code == NONE_DTYPE else _NAMES[code], tuple(shape)))
    check_bounds(mkind, specs, where)
    return Message(step, mkind, stage, mb, (), tag), specs


def check_bounds(kind: MessageKind, specs: list[TensorSpec], where: str) -> None:
    """Refuse a payload over the bounds of the module note, before anything is allocated."""
    total = 0
    for spec in specs:
        if spec.dtype is None:
            continue
        extent = 1
        for d in spec.shape:
            extent *= max(d, 1)
            if extent > MAX_MESSAGE_BYTES:
                break
        total += extent * DTYPE_SIZES[spec.dtype]
        if total > MAX_MESSAGE_BYTES:
            raise ProtocolError(f"header {where} declares a payload too large",
                                expected=f"<= {MAX_MESSAGE_BYTES} bytes "
                                "(AIOREADY_MAX_MESSAGE_BYTES)", got=f"shape {spec.shape} "
                                f"{spec.dtype}, > {MAX_MESSAGE_BYTES} bytes in all")
    if kind is MessageKind.CONTROL and (len(specs) > 1 or total > MAX_CONTROL_BYTES):
        raise ProtocolError(f"header {where} declares a control message too large",
                            expected=f"<= 1 tensor of <= {MAX_CONTROL_BYTES} bytes",
                            got=f"{len(specs)} tensors, {total} bytes")
