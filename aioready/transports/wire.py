"""The MPI transport's wire codec: the header of transports/base.py, with per-layout caches.

A pipeline sends the same few tensor layouts (dtype and shape) over and over, so the work of
describing them is done once per layout, not once per message: the sender caches each tensor's
descriptor bytes by (dtype, shape); the receiver caches a parsed `Layout` by the descriptor bytes
it received (a cache miss goes through `decode_header`, which validates everything; a hit is
byte-identical to a message that was validated before). On this machine that took a small
message from ~20 us to a few us on each side (bench/transport.py).

Small payloads travel *inline*: the header, padded to 16 bytes, then each tensor's bytes, each
padded to 16 bytes, in one MPI message. Larger ones travel as one message per tensor
(transports/mpi.py). Either way the wire format is the one `encode_header` writes.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from ..errors import ProtocolError
from .base import Message, MessageKind
from .header import (
    _DESC,
    _FIXED,
    _VERSION,
    HEADER_MAGIC,
    MAX_TENSORS,
    TensorSpec,
    decode_header,
    encode_descriptor,
)
from .tensor_bytes import (
    cannot_travel,
    from_bytes,
    numel,
    numpy_dtype,
    plain,
    torch_dtype,
    torch_module,
)

__all__ = ["ALIGN", "align", "Header", "Layout", "WireCodec"]

ALIGN = 16
_PAD = bytes(ALIGN)
_KINDS = tuple(MessageKind)
_CACHE_MAX = 4096  # layouts per cache: beyond this (shapes that never repeat) stop caching


Header = tuple[int, MessageKind, int, int, int, int]  # step, kind, stage, microbatch, tag, source


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Layout:
    """What one descriptor block means: specs, dtypes, payload sizes and offsets."""

    __slots__ = ("specs", "dtypes", "sizes", "header_len", "inline_len", "views")

    def __init__(self, specs: list[TensorSpec]) -> None:
        self.specs = specs
        self.dtypes = [None if s.dtype is None else torch_dtype(s.dtype) for s in specs]
        self.sizes = [0 if d is None else numel(s.shape) * d.itemsize
                      for s, d in zip(specs, self.dtypes)]
        self.header_len = _FIXED.size + sum(_DESC.size + 8 * len(s.shape) for s in specs)
        self.inline_len = align(self.header_len) + sum(align(n) for n in self.sizes)
        views: list[tuple[int, int, str, Any, tuple[int, ...], Any] | None] = []
        off = align(self.header_len)
        for s, d, n in zip(specs, self.dtypes, self.sizes):
            if d is None:
                views.append(None)
                continue
            views.append((off, n, s.dtype, d, tuple(s.shape),  # type: ignore[arg-type]
                          numpy_dtype(s.dtype)))  # type: ignore[arg-type]
            off += align(n)
        self.views = views


class WireCodec:
    """Encodes and decodes messages of one transport; caches are per instance (not shared)."""

    def __init__(self, *, fast: bool = True) -> None:
        self.fast = fast  # inline tensors through a direct numpy constructor (1.8 -> 1.3 us)
        self._descriptors: dict[tuple[Any, Any], tuple[bytes, int]] = {}
        self._layouts: dict[bytes, Layout] = {}

    # -- sending ---------------------------------------------------------------------------
    def describe(self, tensors: tuple[Any, ...]) -> tuple[bytes, list[int], bool]:
        """The descriptor block, payload sizes in bytes, and whether any tensor is on a GPU."""
        if len(tensors) > MAX_TENSORS:
            raise ProtocolError("too many tensors in one message",
                                expected=f"<= {MAX_TENSORS}", got=len(tensors))
        cache = self._descriptors
        descs = []
        sizes = []
        on_cuda = False
        for t in tensors:
            if t is None:
                descs.append(_NONE_DESCRIPTOR)
                sizes.append(0)
                continue
            try:
                key = (t.dtype, t.shape, t.layout)
            except AttributeError:
                raise cannot_travel(f"a {type(t).__name__}") from None
            hit = cache.get(key)
            if hit is None:
                hit = self._describe_new(t, key)
            descs.append(hit[0])
            sizes.append(hit[1])
            on_cuda = on_cuda or t.is_cuda
        return b"".join(descs), sizes, on_cuda

    def _describe_new(self, t: Any, key: tuple[Any, Any]) -> tuple[bytes, int]:
        from .tensor_bytes import spec_of
        if key[2] != torch_module().strided:
            raise cannot_travel(f"a tensor of layout {key[2]}")
        entry = (encode_descriptor(spec_of(t)), t.nbytes)
        if len(self._descriptors) < _CACHE_MAX:
            self._descriptors[key] = entry
        return entry

    @staticmethod
    def fixed(msg: Message, num_tensors: int) -> bytes:
        return _FIXED.pack(HEADER_MAGIC, _VERSION, msg.kind, msg.step, msg.stage,
                           msg.microbatch, msg.tag, num_tensors)

    def encode_inline(self, msg: Message, descriptors: bytes, sizes: list[int]) -> bytes:
        """Header and CPU payloads in one buffer (the caller checked the sizes are small)."""
        head = self.fixed(msg, len(sizes)) + descriptors
        parts = [head, _PAD[:align(len(head)) - len(head)]]
        for t, n in zip(msg.tensors, sizes):
            if n:
                t = plain(t)  # bound: the copy must outlive the read of its memory
                parts.append(ctypes.string_at(t.data_ptr(), n))
                parts.append(_PAD[:align(n) - n])
        return b"".join(parts)

    # -- receiving -------------------------------------------------------------------------
    def decode(self, buf: np.ndarray, source: int) -> tuple[Header, Layout]:
        """The header fields, with the sending rank, and layout of a received header buffer."""
        if len(buf) < _FIXED.size:
            return self._decode_new(buf, source, None)
        view = memoryview(buf)  # ints and slices of a memoryview, not numpy scalars: 3 -> 1 us
        magic, version, kind, step, stage, mb, tag, n = _FIXED.unpack_from(view, 0)
        if magic != HEADER_MAGIC or version != _VERSION or kind >= len(_KINDS) or \
                n > MAX_TENSORS or _KINDS[kind] is MessageKind.CONTROL:
            return self._decode_new(buf, source, None)  # control: bounds of its own, rare
        end = _FIXED.size
        size = len(buf)
        for _ in range(n):
            if end + _DESC.size > size:
                return self._decode_new(buf, source, None)
            end += _DESC.size + 8 * view[end + 1]
        if end > size:
            return self._decode_new(buf, source, None)
        key = bytes(view[_FIXED.size:end])
        layout = self._layouts.get(key)
        if layout is None:
            return self._decode_new(buf, source, key)
        return (step, _KINDS[kind], stage, mb, tag, source), layout

    def _decode_new(self, buf: np.ndarray, source: int, key: bytes | None
                    ) -> tuple[Header, Layout]:
        msg, specs = decode_header(memoryview(buf), source=source)  # raises what is wrong
        layout = Layout(specs)
        if key is not None and len(self._layouts) < _CACHE_MAX:
            self._layouts[key] = layout
        return (msg.step, msg.kind, msg.stage, msg.microbatch, msg.tag, source), layout

    @staticmethod
    def message(header: Header, tensors: tuple[Any, ...]) -> Message:
        step, kind, stage, mb, tag, source = header
        return Message(step, kind, stage, mb, tensors, tag, source)

    def inline_tensors(self, buf: np.ndarray, layout: Layout) -> tuple[Any, ...]:
        """Tensors viewing an inline message's payload bytes (no copy)."""
        if not any(layout.views):  # no payload: no torch needed (simulated stages)
            return tuple(None for _ in layout.views)
        torch = torch_module()
        fast = self.fast
        out = []
        for view in layout.views:
            if view is None:
                out.append(None)
                continue
            off, n, name, dtype, shape, npdt = view
            if not n:
                out.append(torch.empty(shape, dtype=dtype))
            elif fast and npdt is not None:  # the same view as from_bytes, built in one call
                out.append(torch.from_numpy(np.ndarray(shape, npdt, buf, off)))
            else:
                out.append(from_bytes(buf[off:off + n], name, shape))
        return tuple(out)


_NONE_DESCRIPTOR = encode_descriptor(TensorSpec(None, ()))
