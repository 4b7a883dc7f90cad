"""The MPI transport's send and receive of a planned message through the compiled helper.

`MPITransport` keeps its Python paths; where `transports.native.load()` gives the compiled
module (and receive and send plans are on), it sends a planned message with `send` and polls
its header channel with `probe` below instead of `_probe`. Each does in one C call what the
Python path does in ten (docs/hot_path.md, "The compiled helper"); what the C call does not
take (a plan it does not know, a message no plan takes, several tensors, a receive that did not
complete at once, a message too large) goes back to the very Python code that handled it before,
so the errors and the bytes are the same. Switch: `AIOREADY_MPI_NATIVE=0`.

A header-only message (the reserving policy's notice, one a task that feeds a peer) is sent by
`send_head`, where the Python path took a failed plan lookup, the several-tensor plan's `pack`
and mpi4py's `Isend` and `Test` (docs/hot_path_measurements.md "Ready against strict").
Switch: `AIOREADY_NATIVE_HEADERS=0` (those go the Python way again). Likewise a message of
several tensors that a several-tensor plan covers (bench.e2e's activations with their tags,
gradients with a None slot): `send_multi` copies each tensor to its offset;
`AIOREADY_NATIVE_MULTI=0`.

A header-only notice received is handed by the C probe, after the receive plan's checks, straight
to the receiver's notice handler (`route_notices`) as four integers: no Message, no routing by
kind (docs/hot_path_measurements.md "The notice's read in one C call"). Switch:
`AIOREADY_NATIVE_RECV_HEADS=0` (a notice is a Message delivered as before). Likewise a received
message of several tensors that a receive plan takes is viewed in C from the plan's views (the
Python plan's work, ~50 us cold a message); `AIOREADY_NATIVE_RECV_MULTI=0`: the Python plan
again.
"""

from __future__ import annotations

import os
from functools import partial
from types import ModuleType
from typing import Any, Callable

import numpy as np

from ..errors import ProtocolError
from .base import Message, MessageKind
from .header import _FIXED
from .wire import align

__all__ = ["NativePath", "header_too_large"]


def header_too_large(rank: int, src: int, count: int, limit: int) -> ProtocolError:
    """The error for a header-channel message over `limit` bytes (hostile input: bounded
    before anything is allocated)."""
    return ProtocolError(f"message from rank {src} on the header channel is too large",
                         rank=rank, expected=f"<= {limit} bytes", got=f"{count} bytes")


class NativePath:
    """The compiled send and probe bound to one transport (`tr`: an MPITransport)."""

    def __init__(self, tr: Any, module: ModuleType, *, seq_mod: int, probes: int,
                 rung_probes: int) -> None:
        self._tr = tr
        self._send = module.send
        self._send_parts = module.send_parts
        self._probe = module.probe
        self._comm = tr._hdr.handle
        self._seq_mod = seq_mod
        self._probes = probes
        self._rung_probes = rung_probes
        self._by_len = tr._recv_plans._by_len  # length -> receive plan (wire_plans.py)
        self._request = tr._MPI.Request.fromhandle
        self.num_sent = self.num_received = 0  # by the C calls (tests prove they are used)
        # header-only messages through `send_head` (a module built before it has none)
        self._send_head = getattr(module, "send_head", None) if os.environ.get(
            "AIOREADY_NATIVE_HEADERS", "1") != "0" else None
        self._head_bytes = align(_FIXED.size)  # what the plans write for one: header, padding
        self.num_heads = 0  # header-only messages sent by `send_head`
        # several tensors (None slots among them) through `send_multi`
        self._send_multi = getattr(module, "send_multi", None) if os.environ.get(
            "AIOREADY_NATIVE_MULTI", "1") != "0" else None
        self.num_multi = 0
        # received notices straight to the runtime's handler (route_notices): no Message
        self._recv_heads = os.environ.get("AIOREADY_NATIVE_RECV_HEADS", "1") != "0"
        self._on_notice: Callable[[int, int, int, int], None] | None = None
        self.num_notices = 0  # notices handed to it by the C probe
        # a received message of several tensors viewed in C from its plan (else the Python plan)
        self._recv_multi = os.environ.get("AIOREADY_NATIVE_RECV_MULTI", "1") != "0"

    def route_notices(self, handler: Callable[[int, int, int, int], None] | None) -> bool:
        """Hand each received notice's (step, stage, microbatch, tag) to `handler` in place of
        a Message to `deliver` (None: Messages again). False where the switch is off."""
        self._on_notice = handler if self._recv_heads else None
        return handler is not None and self._recv_heads

    def send(self, dest: int, msg: Message) -> bool:
        """Send `msg` to `dest` if a send plan covers it (else False: the Python path)."""
        n = len(msg.tensors)
        if n != 1:
            if n == 0:
                return self._send_head is not None and self._head(dest, msg)
            return self._send_multi is not None and self._several(dest, msg)
        tr = self._tr
        found = tr._send_plans.lookup(msg)
        if found is None:
            return False
        t, (_, desc, n, tail, off, total) = found
        seq = tr._seq[dest]
        big = False
        if tail is None:
            left = self._send(self._comm, dest, seq, msg.kind, msg.step, msg.stage,
                              msg.microbatch, msg.tag, desc, t.data_ptr(), n, off, total)
        else:  # from the tensor's own memory, as MPITransport._isend_parts sends it
            big = total >= tr.hot_bytes
            left = self._send_parts(self._comm, dest, seq, msg.kind, msg.step, msg.stage,
                                    msg.microbatch, msg.tag, desc, t.data_ptr(), n, off, tail,
                                    not big)
        if left is NotImplemented:  # a field the header cannot hold: the plan raises it
            return False
        self.num_sent += 1
        self._went(dest, seq, left, None if tail is None else t, big, False)
        return True

    def _went(self, dest: int, seq: int, left: Any, tensor: Any, big: bool,
              notice: bool) -> None:
        """After a C send to `dest`: the next sequence number; a send not completed at once
        tracked, its bytes (and `tensor`, sent from its own memory) kept until it completes;
        the doorbell (a `notice` rings no peer whose loop computes) and the engine's kick."""
        tr = self._tr
        tr._seq[dest] = (seq + 1) % self._seq_mod
        if left is not None:
            tr._track_send(self._request(left[1]), left[0] if tensor is None else
                           (left[0], tensor), None, dest, big)
        elif tr._sent_waiters:
            tr._maybe_idle()
        if tr._bell is not None:
            tr._bell.ring(dest, notice)
        tr._kick_after_send()

    def _head(self, dest: int, msg: Message) -> bool:
        """A header-only message (a notice), written and sent in C; `send`'s bookkeeping."""
        tr = self._tr
        seq = tr._seq[dest]
        left = self._send_head(self._comm, dest, seq, msg.kind, msg.step, msg.stage,
                               msg.microbatch, msg.tag, self._head_bytes)
        if left is NotImplemented:  # a field the header cannot hold: the Python path raises
            return False
        self.num_heads += 1
        self._went(dest, seq, left, None, False, msg.kind is MessageKind.NOTICE)
        return True

    def _several(self, dest: int, msg: Message) -> bool:
        """A message of several tensors that a several-tensor plan covers (`SendPlans.parts`),
        written and sent in C; a large one (tracked hot) or none planned: the Python path."""
        tr = self._tr
        found = tr._send_plans.parts(msg)
        if found is None or found[2] >= tr.hot_bytes:
            return False
        desc, parts, total = found
        seq = tr._seq[dest]
        left = self._send_multi(self._comm, dest, seq, msg.kind, msg.step, msg.stage,
                                msg.microbatch, msg.tag, desc, len(msg.tensors), parts, total)
        if left is NotImplemented:  # a field the header cannot hold: the Python path raises
            return False
        self.num_multi += 1
        self._went(dest, seq, left, None, False, msg.kind is MessageKind.NOTICE)
        return True

    def probe(self) -> int:
        """`MPITransport._probe` through the helper: the same tries (two, and `rung_probes`
        more after a ring; two after a match unless AIOREADY_PROBE_AGAIN=0), the same bound,
        the same hand-over."""
        tr = self._tr
        probe, by_len, comm, on_notice = self._probe, self._by_len, self._comm, self._on_notice
        multi = self._recv_multi
        limit = tr._max_header_message
        tries = 2 + self._rung_probes if tr._rung else 2
        after_match = 2 if tr._probe_again else 1  # as _probe: an empty probe is repeated
        n = 0
        while n < self._probes:
            got = probe(comm, tries, limit, by_len, on_notice, multi)
            if got is None:
                break
            n += 1
            tries = after_match
            if got is True:  # a notice, handed to on_notice
                self.num_notices += 1
                tr.num_received += 1
                continue
            if type(got) is not tuple:  # taken by a receive plan
                self.num_received += 1
                tr._hand_over(got)
                continue
            if len(got) == 1:  # what on_notice raised: as deliver's error
                tr.num_received += 1
                tr._deliver_failed(got[0])
                continue
            src, seq, count, raw, handle = got
            if raw is None:
                raise header_too_large(tr._rank, src, count, limit)
            if handle:  # a large inline message may need a rendezvous: poll it hot
                tr._track(self._request(handle),
                          partial(tr._on_header, src, seq, np.frombuffer(raw, np.uint8)),
                          count >= tr.hot_bytes)
                continue
            msg = tr._recv_plans.message(raw, src)  # several tensors: the Python plan's
            if msg is not None:
                tr._hand_over(msg)
            else:
                tr._on_header(src, seq, np.frombuffer(raw, np.uint8), planned=True)
        tr._rung = False
        return n
