"""The slot framing of TorchDistTransport: what one header slot holds, and its send buffers.

A slot is one transfer on the header tag into a receive of `slot_bytes` posted ahead
(docs/torchrun.md "The framing, and why"): a prefix (content length, flags), then at `CONTENT`
the header of transports/header.py, then, when the whole message fits, the CPU payloads, each
padded to 16 bytes (wire.encode_inline's layout). Gloo lets a send be shorter than the receive it
matches, so only the used bytes travel. An empty slot (length 0) says goodbye.

Send buffers are reused once their send completed (`SendSlots`): a fresh 64 KiB buffer per
message cost its page faults, about as much as the copy. Each buffer also keeps the torch views
of the lengths it was sent with, since slicing a tensor costs about a microsecond and a pipeline
sends the same few lengths over and over. For the same reason a message of one CPU tensor of a
layout sent before is framed by a plan (`SendSlots.one`): one `Struct.pack_into` writes the
prefix, the header and their padding, and one `memmove` the payload; the bytes are those of
`inline`, byte for byte (docs/torchrun.md "Profiled per message").
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import struct
from functools import partial
from typing import Any, Callable

import numpy as np

from .base import Message
from .header import _FIXED, _VERSION, HEADER_MAGIC
from .tensor_bytes import plain, torch_module
from .wire import WireCodec, align
from .wire_plans import LayoutPlans

__all__ = ["SLOT_BYTES", "CONTENT", "ON_DEVICE", "PREFIX", "SendSlots", "SlotLedger", "new_slot"]

SLOT_BYTES = int(os.environ.get("AIOREADY_TORCH_SLOT_BYTES", 68 << 10))
PREFIX = struct.Struct("<IB")  # content length (0: goodbye), flags
CONTENT = 16  # content offset: keeps inline tensors 16-byte aligned (wire.ALIGN)
ON_DEVICE = 1  # flag: the payload travels through the group's CUDA backend
FREE_SLOTS = 64  # send buffers kept for reuse
VIEWS = 8  # lengths remembered per send buffer (more: the shapes do not repeat; forget them)
_ZEROS = bytes(CONTENT + 16)  # padding: below CONTENT after the prefix, after each payload
_memmove = ctypes.memmove


def new_slot(nbytes: int) -> tuple[np.ndarray, Any]:
    """A slot buffer and the tensor over it (what gloo sends from or receives into)."""
    array = np.empty(nbytes, np.uint8)
    return array, torch_module().from_numpy(array)


class _Buffer:
    __slots__ = ("array", "whole", "views", "bytes", "address")

    def __init__(self, nbytes: int) -> None:
        self.array, self.whole = new_slot(nbytes)
        self.views: dict[int, Any] = {}
        self.bytes = memoryview(self.array)  # slice assignment: no numpy array per write
        self.address = self.array.ctypes.data

    def view(self, end: int) -> Any:
        """The tensor of the first `end` bytes (cached by length)."""
        views = self.views
        found = views.get(end)
        if found is None:
            if len(views) >= VIEWS:
                views.clear()
            found = views[end] = self.whole[:end]
        return found


# pack_into, descriptor, payload offset, payload bytes, end of the padded payload
Plan = tuple[Callable[..., None], bytes, int, int, int]


class SendSlots:
    """Slot buffers to send from: `inline` packs a whole message into a reused one, `one` a
    message of one CPU tensor by its layout's plan."""

    def __init__(self, slot_bytes: int, codec: WireCodec) -> None:
        self.slot_bytes = slot_bytes
        self.room = slot_bytes - CONTENT
        self._free: list[_Buffer] = []
        self._plans = LayoutPlans(codec, self._build)

    def one(self, msg: Message) -> tuple[Any, Callable[[], None]] | None:
        """What `inline` returns for `msg`, through its layout's plan; None when
        `wire_plans.LayoutPlans.lookup` finds none or the message does not fit the slot: the
        caller then takes the general path, which raises what is wrong."""
        found = self._plans.lookup(msg)
        if found is None:
            return None
        t, (pack_into, desc, start, n, end) = found
        free = self._free
        buf = free.pop() if free else _Buffer(self.slot_bytes)
        pack_into(buf.bytes, 0, end - CONTENT, 0, HEADER_MAGIC, _VERSION, msg.kind, msg.step,
                  msg.stage, msg.microbatch, msg.tag, 1, desc)  # pads written as zeros
        _memmove(buf.address + start, t.data_ptr(), n)
        if end > start + n:
            buf.bytes[start + n:end] = _ZEROS[:end - start - n]
        view = buf.views.get(end)  # buf.view(end), without the call in the common case
        return (buf.view(end) if view is None else view), partial(self._give_back, buf)

    def _build(self, desc: bytes, n: int) -> Plan | None:
        head = _FIXED.size + len(desc)
        if not self.fits(head, [n]):
            return None
        fmt = (f"{PREFIX.format}{CONTENT - PREFIX.size}x{_FIXED.format[1:]}"
               f"{len(desc)}s{align(head) - head}x")
        start = CONTENT + align(head)
        return struct.Struct(fmt).pack_into, desc, start, n, start + align(n)

    def fits(self, head_len: int, sizes: list[int]) -> bool:
        """Whether a header of `head_len` bytes and payloads of `sizes` fit one slot."""
        return align(head_len) + sum(align(n) for n in sizes) <= self.room

    def inline(self, head: bytes, tensors: tuple[Any, ...], sizes: list[int]
               ) -> tuple[Any, Callable[[], None]]:
        """The tensor to send (prefix, header and payloads, each payload copied once), and the
        callback that gives its buffer back once the send completed.

        Bytes go in through a memoryview and `memmove` from the tensor's own storage: numpy
        slice assignments and a numpy view per tensor cost about 2 us more per message."""
        head_end = CONTENT + len(head)
        start = CONTENT + align(len(head))
        end = start
        for n in sizes:
            end += align(n)
        buf = self._free.pop() if self._free else _Buffer(self.slot_bytes)
        out = buf.bytes
        PREFIX.pack_into(out, 0, end - CONTENT, 0)
        out[PREFIX.size:CONTENT] = _ZEROS[:CONTENT - PREFIX.size]
        out[CONTENT:head_end] = head
        out[head_end:start] = _ZEROS[:start - head_end]
        off = start
        for t, n in zip(tensors, sizes):
            if n:
                t = plain(t)  # bound: the copy must outlive the memmove from its memory
                ctypes.memmove(buf.address + off, t.data_ptr(), n)  # a CPU tensor (caller)
                pad = align(n) - n
                if pad:
                    out[off + n:off + n + pad] = _ZEROS[:pad]
                off += n + pad
        return buf.view(end), lambda: self._give_back(buf)

    def _give_back(self, buf: _Buffer) -> None:
        if len(self._free) < FREE_SLOTS:
            self._free.append(buf)

    @staticmethod
    def control(content: bytes, flags: int) -> Any:
        """A slot of `content` alone (a header whose payloads follow, or a goodbye), in a fresh
        buffer of its own length: the posted receive is larger."""
        slot, whole = new_slot(CONTENT + len(content))
        PREFIX.pack_into(slot, 0, len(content), flags)
        slot[CONTENT:CONTENT + len(content)] = np.frombuffer(content, np.uint8)
        return whole


class SlotLedger:
    """Per peer: slot receives outstanding and goodbyes received, for the closing handshake.

    Each rank keeps `depth` slot receives posted per peer, and a closing rank sends each peer
    `depth` empty slots, one per receive that peer posted; so a peer is gone once `depth`
    goodbyes came from it, and a closing rank that stopped reposting (after an error) first
    posts the receives its peers' goodbyes still need (`missing`). No slot receive then stays
    posted on the group, and another transport can use it later.
    """

    def __init__(self, peers: list[int], depth: int) -> None:
        self.peers = peers
        self.depth = depth
        self.posted: dict[int, int] = dict.fromkeys(peers, 0)
        self._goodbyes: dict[int, int] = dict.fromkeys(peers, 0)
        self._all_gone: asyncio.Future[None] | None = None

    def missing(self, peer: int) -> int:
        """Slot receives to post so that every goodbye `peer` still sends has one."""
        return max(0, self.depth - self._goodbyes[peer] - self.posted[peer])

    def goodbye(self, peer: int, *, all_of_them: bool = False) -> None:
        """An empty slot came from `peer` (`all_of_them`: it died after we said goodbye)."""
        self._goodbyes[peer] = self.depth if all_of_them else self._goodbyes[peer] + 1
        waiter = self._all_gone
        if waiter is not None and not waiter.done() and not self.staying():
            waiter.set_result(None)

    def staying(self) -> list[int]:
        """Peers whose goodbyes did not all arrive."""
        return [p for p in self.peers if self._goodbyes[p] < self.depth]

    async def wait_all_gone(self, timeout: float) -> list[int]:
        """Wait (at most `timeout`) for every peer's goodbyes; return the peers still staying."""
        if self.staying():
            self._all_gone = asyncio.get_running_loop().create_future()
            try:
                await asyncio.wait_for(self._all_gone, timeout)
            except asyncio.TimeoutError:
                pass
        return self.staying()
