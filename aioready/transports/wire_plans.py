"""Precompiled plans for the MPI transport's commonest messages: one CPU tensor, inline.

A pipeline sends the same layout (one activation or gradient of a fixed dtype and shape) over
and over. For such a layout the sender keeps one `struct.Struct` that writes the fixed header,
the cached descriptor, the padding and the payload in a single `pack` (one call where
`WireCodec.encode_inline` joins five parts); the receiver keeps, by message length, a Struct that
reads the fixed header and the descriptor block in one `unpack_from`, and builds the tensors and
the `Message` without the general decoder's loops (docs/hot_path.md: 8 B one-way ~9 -> ~6 us).

The bytes are the wire format `WireCodec` writes, byte for byte. A plan is only ever a cache of
what the general path validated: a received message is taken by its plan only when its length,
magic, version, tensor count and descriptor bytes equal those of a message `WireCodec.decode`
accepted before, and its kind is a known one other than CONTROL (whose bounds are its own);
anything else goes through the general path, which raises what is wrong. Switch:
`AIOREADY_MPI_PLANS=0` (or `AIOREADY_MPI_FAST=0`) sends and receives everything the general way.
"""

from __future__ import annotations

import ctypes
import os
import struct
from typing import Any, Callable

import numpy as np

from .base import Message, MessageKind
from .header import _FIXED, _VERSION, HEADER_MAGIC
from .tensor_bytes import torch_module
from .wire import _CACHE_MAX, Layout, WireCodec, align

__all__ = ["LayoutPlans", "SendPlans", "MultiPlans", "ReceivePlans"]

_KINDS = tuple(MessageKind)
_CONTROL = int(MessageKind.CONTROL)
_string_at = ctypes.string_at


def _plain(t: Any) -> bool:
    """Whether a plan may copy `t`'s memory as its values: on the CPU, contiguous, and with no
    lazy negation (a plan's key has its dtype, shape and layout, not these)."""
    return t.is_cpu and t.is_contiguous() and not t.is_neg()


def _plain_present(tensors: tuple[Any, ...]) -> list[Any] | None:
    """The tensors of a several-tensor message without its None slots, or None if one is not
    `_plain`: what both a packed and a pointer send of its plan copy, in order."""
    present = [t for t in tensors if t is not None]
    return present if all(_plain(t) for t in present) else None


class LayoutPlans:
    """Per (dtype, shape, layout) of a lone CPU tensor, the plan `build(descriptor, payload
    bytes)` made for it (None: none); shared by the MPI transport's `SendPlans` and the gloo
    slots (torch_slots.SendSlots.one), which frame the same message in their own buffers."""

    def __init__(self, codec: WireCodec, build: Callable[[bytes, int], Any]) -> None:
        self._codec = codec
        self._build = build
        self._plans: dict[tuple[Any, Any, Any], Any] = {}

    def lookup(self, msg: Message) -> tuple[Any, Any] | None:
        """(its tensor, its plan) for `msg`, or None: not one contiguous CPU tensor of a dense
        layout and a real dtype whose memory holds its values (no lazy negation), or no plan
        for its layout: the caller takes the general path."""
        tensors = msg.tensors
        if len(tensors) != 1:  # a test, not the unpacking's ValueError: notices have none
            return None
        t = tensors[0]
        try:
            key = (t.dtype, t.shape, t.layout)
        except AttributeError:  # not a tensor: the general path's business
            return None
        plan = self._plans.get(key, False)
        if plan is False:
            plan = self._learn(t, key)
        if plan is None or not _plain(t):
            return None  # (a complex dtype, which a lazy conjugate has, has no plan)
        return t, plan

    def _learn(self, t: Any, key: tuple[Any, Any, Any]) -> Any:
        plan = None
        if key[2] == torch_module().strided and not key[0].is_complex and t.nbytes > 0:
            try:
                desc, sizes, _ = self._codec.describe((t,))
            except Exception:  # a dtype that cannot travel: the general path raises it
                return None
            plan = self._build(desc, sizes[0])
        if len(self._plans) < _CACHE_MAX:
            self._plans[key] = plan
        return plan


def _head_format(desc: bytes) -> str:
    """The Struct format of a message's fixed header, its descriptor block and the padding
    before the first payload: what every send plan packs first."""
    head = _FIXED.size + len(desc)
    return f"<{_FIXED.format[1:]}{len(desc)}s{align(head) - head}x"


def _multi_default() -> bool:
    """`AIOREADY_MPI_PLANS_MULTI=0`: plans for lone tensors only (as before: docs/hot_path.md
    "Notices ring no loop that computes")."""
    return os.environ.get("AIOREADY_MPI_PLANS_MULTI", "1") != "0"


class SendPlans:
    """The Struct that writes the whole inline message of a lone CPU tensor, per layout; and
    with `multi`, of several CPU tensors and None slots (`MultiPlans`)."""

    def __init__(self, codec: WireCodec, inline_bytes: int, zero_copy: int = 0,
                 multi: bool | None = None) -> None:
        self._inline_bytes = inline_bytes
        self._zero_copy = zero_copy  # payload bytes from which `encode` gives parts (0: never)
        self._plans = LayoutPlans(codec, self._build)
        self._multi = MultiPlans(codec, inline_bytes) if (
            _multi_default() if multi is None else multi) else None

    def encode(self, msg: Message) -> bytes | tuple[bytes, Any, int, int] | None:
        """The header and inline payload of `msg`, or None (LayoutPlans.lookup, or too large to
        travel inline): the caller takes the general path. From `ZERO_COPY` payload bytes, the
        parts instead: (header with its padding, the tensor, its bytes, zero bytes after it),
        for a send straight from the tensor's memory (the MPI transport's vectored send)."""
        found = self._plans.lookup(msg)
        if found is None:
            multi = self._multi
            return None if multi is None or len(msg.tensors) == 1 else multi.encode(msg)
        t, (pack, desc, n, tail, _, _) = found
        if tail is None:
            return pack(HEADER_MAGIC, _VERSION, msg.kind, msg.step, msg.stage, msg.microbatch,
                        msg.tag, 1, desc, _string_at(t.data_ptr(), n))
        return pack(HEADER_MAGIC, _VERSION, msg.kind, msg.step, msg.stage, msg.microbatch,
                    msg.tag, 1, desc), t, n, tail

    def parts(self, msg: Message) -> tuple[bytes, tuple[tuple[int, int, int], ...], int] | None:
        """`MultiPlans.parts` of a message of several tensors (or None slots), else None."""
        multi = self._multi
        return None if multi is None or len(msg.tensors) < 2 else multi.parts(msg)

    def lookup(self, msg: Message) -> tuple[Any, tuple[Any, bytes, int, Any, int, int]] | None:
        """(its tensor, its plan) for `msg` or None, as `encode` finds them; a plan is (pack,
        descriptor block, payload bytes, None or the zero bytes after a zero-copy payload,
        payload offset, message bytes): what a sender that writes the message itself needs
        (the compiled helper, transports/native)."""
        return self._plans.lookup(msg)

    def _build(self, desc: bytes, n: int) -> tuple[Any, bytes, int, Any, int, int] | None:
        if n > self._inline_bytes:
            return None
        head = _FIXED.size + len(desc)
        fixed = _head_format(desc)
        where = align(head), align(head) + align(n)  # the payload's offset, the message's size
        if self._zero_copy and n >= self._zero_copy:  # the header alone, with its padding
            return struct.Struct(fixed).pack, desc, n, align(n) - n, *where
        return struct.Struct(f"{fixed}{n}s{align(n) - n}x").pack, desc, n, None, *where


class MultiPlans:
    """Per layout of several CPU tensors, None slots among them (an activation with its integer
    tags, a gradient with None for them), or none (a notice), the Struct that writes the whole
    inline message: the
    bytes of `WireCodec.encode_inline`, one `pack` instead of its loop and join. Only layouts
    whose tensors are all strided, of a real dtype and non-empty, and whose payloads travel
    inline; the tensors of each message must be CPU, contiguous and not lazily negated, or the
    general path takes it."""

    def __init__(self, codec: WireCodec, inline_bytes: int) -> None:
        self._codec = codec
        self._inline_bytes = inline_bytes
        self._plans: dict[tuple[Any, ...], Any] = {}

    def _plan(self, tensors: tuple[Any, ...]) -> Any:
        """The plan of `tensors`' layout (pack, descriptor block, payload offsets, message
        bytes), or None: the general path."""
        try:
            key = tuple([None if t is None else (t.dtype, t.shape, t.layout) for t in tensors])
        except AttributeError:  # not a tensor: the general path's business
            return None
        plan = self._plans.get(key, False)
        if plan is False:
            plan = self._learn(tensors, key)
        return plan

    def _covered(self, tensors: tuple[Any, ...]) -> tuple[Any, list[Any]] | None:
        """The plan of `tensors` and those of them to copy; None where the general path
        encodes (no plan, or a tensor whose memory may not be copied): what `encode` and
        `parts` both check first."""
        plan = self._plan(tensors)
        if plan is None:
            return None
        present = _plain_present(tensors)
        return None if present is None else (plan, present)

    def encode(self, msg: Message) -> bytes | None:
        covered = self._covered(msg.tensors)
        if covered is None:
            return None
        (pack, desc, _, _), present = covered
        return pack(HEADER_MAGIC, _VERSION, msg.kind, msg.step, msg.stage, msg.microbatch,
                    msg.tag, len(msg.tensors), desc,
                    *(_string_at(t.data_ptr(), t.nbytes) for t in present))

    def parts(self, msg: Message) -> tuple[bytes, tuple[tuple[int, int, int], ...], int] | None:
        """What `encode` writes, as (descriptor block, (pointer, bytes, offset) of each tensor,
        message bytes) for a sender that copies the tensors itself (the compiled helper's
        `send_multi`); None where `encode` gives None."""
        covered = self._covered(msg.tensors)
        if covered is None:
            return None
        (_, desc, offsets, total), present = covered
        parts = tuple((t.data_ptr(), t.nbytes, off) for t, off in zip(present, offsets))
        return desc, parts, total

    def _learn(self, tensors: tuple[Any, ...], key: tuple[Any, ...]) -> Any:
        strided = torch_module().strided
        for k, t in zip(key, tensors):
            if k is not None and (k[2] != strided or k[0].is_complex or not t.nbytes):
                return self._keep(key, None)
        if key and all(k is None for k in key):
            return self._keep(key, None)
        try:
            desc, sizes, _ = self._codec.describe(tensors)
        except Exception:  # a dtype that cannot travel: the general path raises it
            return None
        if sum(sizes) > self._inline_bytes:
            return self._keep(key, None)
        fmt = _head_format(desc) + "".join(
            f"{n}s{align(n) - n}x" for k, n in zip(key, sizes) if k is not None)
        offsets, at = [], align(_FIXED.size + len(desc))  # where the pack puts each payload
        for k, n in zip(key, sizes):
            if k is not None:
                offsets.append(at)
                at += align(n)
        return self._keep(key, (struct.Struct(fmt).pack, desc, tuple(offsets), at))

    def _keep(self, key: tuple[Any, ...], plan: Any) -> Any:
        if len(self._plans) < _CACHE_MAX:
            self._plans[key] = plan
        return plan


class _ReceivePlan:
    __slots__ = ("unpack_from", "desc", "n", "views", "one", "from_numpy")

    def __init__(self, desc: bytes, layout: Layout, none_slots: bool = False) -> None:
        self.from_numpy = torch_module().from_numpy  # (a call less per message)
        self.unpack_from = struct.Struct(f"<{_FIXED.format[1:]}{len(desc)}s").unpack_from
        self.desc = desc
        self.n = len(layout.specs)
        # (shape, numpy dtype, offset) of each tensor viewing the buffer, None for a None slot
        # (with `none_slots`); None: the general way
        views: list[tuple[tuple[int, ...], Any, int] | None] | None = []
        for view in layout.views:
            if view is None and none_slots:
                views.append(None)  # type: ignore[union-attr]
                continue
            if view is None or not view[1] or view[5] is None:
                views = None
                break
            off, _, _, _, shape, npdt = view
            views.append((shape, npdt, off))  # type: ignore[union-attr]
        self.views = views
        self.one = views[0] if views and len(views) == 1 else None  # the commonest case


class ReceivePlans:
    """By message length: the layout of an inline message of CPU tensors seen before."""

    def __init__(self, none_slots: bool | None = None) -> None:
        self._by_len: dict[int, _ReceivePlan] = {}
        # layouts with None slots too (a gradient with None for integer tags)
        self._none_slots = _multi_default() if none_slots is None else none_slots

    def learn(self, buf: np.ndarray, layout: Layout) -> None:
        """`buf` was decoded by the general path (and found valid) as an inline message of
        `layout`: take the next ones of its length and descriptors without the loops. Layouts
        whose tensors are all non-empty with a numpy dtype only (bfloat16 and empty tensors
        keep the general path; None slots too unless `none_slots`), and header-only messages
        (no tensors: the reserving policy's notices, stages that pass nothing); the first
        layout seen at a length keeps it."""
        size = len(buf)
        if size in self._by_len or len(self._by_len) >= _CACHE_MAX:
            return
        plan = _ReceivePlan(bytes(buf[_FIXED.size:layout.header_len]), layout,
                            self._none_slots)
        if plan.views is not None:
            self._by_len[size] = plan

    def message(self, buf: np.ndarray | bytearray, source: int) -> Message | None:
        """The message in `buf` if a plan takes it (see the module note), else None; its
        tensors view `buf` (a numpy array or a bytearray, both writable)."""
        plan = self._by_len.get(len(buf))
        if plan is None:
            return None
        magic, version, kind, step, stage, mb, tag, n, desc = plan.unpack_from(buf, 0)
        if desc != plan.desc or magic != HEADER_MAGIC or version != _VERSION or \
                n != plan.n or kind >= len(_KINDS) or kind == _CONTROL:
            return None
        one = plan.one
        if one is not None:
            tensors: tuple[Any, ...] = (plan.from_numpy(np.ndarray(one[0], one[1], buf, one[2])),)
        elif plan.views:
            from_numpy = plan.from_numpy
            tensors = tuple([None if v is None else
                             from_numpy(np.ndarray(v[0], v[1], buf, v[2])) for v in plan.views])
        else:  # header only
            tensors = ()
        return Message(step, _KINDS[kind], stage, mb, tensors, tag, source)
