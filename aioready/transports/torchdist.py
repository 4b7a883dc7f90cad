"""TorchDistTransport: message-driven point-to-point over a torch.distributed process group.

For jobs launched by torchrun (or srun + torchrun): gloo moves CPU tensors, NCCL (where the group
has a CUDA backend, e.g. `init_process_group("cpu:gloo,cuda:nccl")`) moves CUDA tensors.
NCCL has no probe and matches sends and receives per peer in posting order (gloo matches per
peer and tag, in order), so readiness needs a framing of its own (docs/torchrun.md):

- a *header slot* per message, on the header tag, through the group's CPU backend (gloo). Each
  rank keeps SLOT_DEPTH (2) slot receives of `slot_bytes` (68 KiB) posted ahead per peer, so
  whichever peer sends first is received first, and the thread that waits for a peer's slots
  never has to be woken for the next one. The slot holds the header of transports/header.py
  (as wire.py encodes it) and, when the whole message fits, the CPU payload right after it
  (copied in once): one transfer per stage boundary up to 64 KiB. Gloo lets a send be shorter than
  the receive it matches, so only the used bytes travel. (A 4 KiB slot with the 64 KiB payload as a
  second transfer measured 281 us one-way against 142 us this way, bench/transport_torch.py: every
  transfer costs a thread and a loop wake-up.)
- larger or CUDA payloads follow as one transfer per non-empty tensor, on the payload tag (gloo)
  or through the group's CUDA backend (flag in the slot). The receiver posts them, into tensors
  of the advertised dtype and shape (variable per microbatch), when their header arrived, and
  posts the next slot receive once the message was handed over: the loop handles a peer's slots
  in arrival order, so both sides post a peer's NCCL transfers in the same order, which is all
  NCCL needs to match them. The slot layout and send buffers are transports/torch_slots.py.

Completion: transports/torch_work.py (gloo Works are waited on one thread per peer and kind:
slots, payload receives, sends; NCCL Works polled by the ProgressEngine); nothing blocks the
loop thread. A send to this rank is delivered locally by reference. `close()` sends every peer
one empty slot per slot receive it posted and waits (bounded) for theirs, so no slot receive
stays posted on the group: another transport can use it later, as every rank closes its
transport at the same point of the program. One transport per group at a time. A peer whose
connection dropped (killed) fails the step with PeerLostError naming it.
"""

from __future__ import annotations

import asyncio
import logging
import os
from functools import partial
from typing import Any, Callable

import numpy as np

from ..errors import AioreadyError, ConfigError, InternalError, PeerLostError, ProtocolError
from .base import Deliver, Message, OnFailure
from .receive_pool import ReceivePool
from .tensor_bytes import from_bytes, host_bytes, torch_dtype, torch_module
from .torch_groups import cpu_backend, cpu_ops, device_backend, resolve_group
from .torch_slots import CONTENT, ON_DEVICE, PREFIX, SLOT_BYTES, SendSlots, SlotLedger
from .torch_staging import StagedSends
from .torch_work import WorkWaiter
from .wire import Header, WireCodec
from .wire_plans import ReceivePlans

__all__ = ["TorchDistTransport", "SLOT_BYTES", "HEADER_TAG", "PAYLOAD_TAG"]

log = logging.getLogger(__name__)

HEADER_TAG, PAYLOAD_TAG = 0x6A10, 0x6A11  # unlikely to meet a user's own point-to-point tags
CLOSE_TIMEOUT_S = 10.0
SEND_BATCH = 64  # sends handed to their waiter thread together (see _flush_sends)
SLOT_DEPTH = 2  # slot receives posted ahead per peer (see _post_slot)


class _Inbound:
    __slots__ = ("header", "tensors", "left")

    def __init__(self, header: Header, tensors: list[Any], left: int) -> None:
        self.header = header
        self.tensors = tensors
        self.left = left


class TorchDistTransport:
    """The Transport protocol over torch.distributed point-to-point; one per rank."""

    def __init__(self, group: Any = None, *, device: Any = None,
                 slot_bytes: int = SLOT_BYTES) -> None:
        torch = torch_module()
        self._group = resolve_group(group)
        self._rank = self._group.rank()
        self._size = self._group.size()
        self._device = None if device is None else torch.device(device)
        self._cuda_device = self._device is not None and self._device.type == "cuda"
        self.device_backend = device_backend(self._group)
        if not cpu_backend(self._group):
            raise ConfigError("TorchDistTransport needs a CPU backend for its headers",
                              expected="gloo in the group", got=str(self._group),
                              fix="init_process_group('cpu:gloo,cuda:nccl')")
        if slot_bytes < 256 or slot_bytes % 16:
            raise ConfigError("slot_bytes", expected=">= 256 and a multiple of 16",
                              got=slot_bytes)
        self.slot_bytes = slot_bytes
        self._cpu = cpu_ops(self._group)  # gloo itself: skips the dispatcher (see cpu_ops)
        self._codec = WireCodec()
        self._slots = SendSlots(slot_bytes, self._codec)
        # plans: lone CPU tensors of layouts seen before; AIOREADY_TORCH_PLANS=0: the general way
        self._send_plans = os.environ.get("AIOREADY_TORCH_PLANS", "1") != "0"
        self._plans = ReceivePlans() if self._send_plans else None  # (wire_plans)
        self._pool = ReceivePool()
        self._from_numpy = torch.from_numpy
        # WorkWaiter.channel's put per peer (slots) and per (peer, "send"); forgotten by close
        self._channels: dict[Any, Callable[[tuple[Any, Any]], None]] = {}
        self._waiter: WorkWaiter | None = None
        self._posted = False
        self._num_sending = self._num_local = 0
        self._sent_waiters: list[asyncio.Future[None]] = []
        self._unwaited: list[tuple[int, Any, Any]] = []  # sends not yet handed to a thread
        self._ledger = SlotLedger(self._peers(), SLOT_DEPTH)  # slot receives, goodbyes
        self._lost: set[int] = set()  # peers whose transfers failed (reported once)
        self._staged: StagedSends | None = None  # CUDA payloads without a CUDA backend
        self._closing = False
        self._deliver: Deliver | None = None
        self._early: list[Message] = []
        self._fail: OnFailure | None = None
        self._error: BaseException | None = None
        self.num_sent = self.num_received = 0

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._size

    # -- Transport ------------------------------------------------------------------------
    def open(self, deliver: Deliver, *, on_failure: OnFailure | None = None) -> None:
        """Post one slot receive per peer; errors while receiving go to `on_failure`."""
        self._deliver = deliver
        self._fail = on_failure
        self._start()
        early, self._early = self._early, []
        for msg in early:  # arrived after a send started the receives, before open()
            self._hand_over(msg)

    def send_nowait(self, dest: int, msg: Message) -> None:
        if self._error is not None:
            raise self._error
        if self._closing:
            raise RuntimeError(f"rank {self._rank}: send of {msg.describe()} after the "
                               "transport was closed")
        if not 0 <= dest < self._size:
            raise ProtocolError("send to a rank outside the group", rank=self._rank,
                                expected=f"0..{self._size - 1}", got=dest)
        if not self._posted:
            self._start()
        if self._waiter.ready:  # type: ignore[union-attr]  # sends that completed meanwhile
            self._waiter.drain()  # type: ignore[union-attr]
        self.num_sent += 1
        if dest == self._rank:
            self._num_local += 1
            asyncio.get_running_loop().call_soon(self._arrive_local, msg)
            return
        try:
            self._send_remote(dest, msg)
        except RuntimeError as exc:  # gloo refuses at once a send to a peer whose link closed
            self._peer_failed(dest, exc)

    def _send_remote(self, dest: int, msg: Message) -> None:
        planned = self._slots.one(msg) if self._send_plans else None
        if planned is not None:
            buf, release = planned
            self._track_send(dest, self._cpu.send([buf], dest, HEADER_TAG), buf, False,
                             release)
            return
        tensors = msg.tensors
        descriptors, sizes, on_cuda = self._codec.describe(tensors)
        head = self._codec.fixed(msg, len(sizes)) + descriptors
        if not on_cuda and self._slots.fits(len(head), sizes):  # one transfer, one copy
            buf, release = self._slots.inline(head, tensors, sizes)
            self._track_send(dest, self._cpu.send([buf], dest, HEADER_TAG), buf, False,
                             release)
            return
        on_device = on_cuda and self.device_backend  # else staged through the host
        self._send_slot(dest, head, ON_DEVICE if on_device else 0)
        for t, n in zip(tensors, sizes):
            if n:
                self._send_payload(dest, t, on_device)

    async def wait_sent(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._flush_sends()
            waiter.eager = True  # then drain: see WorkWaiter.drain
            waiter.drain()
        try:
            while self._num_sending or self._num_local:
                fut = asyncio.get_running_loop().create_future()
                self._sent_waiters.append(fut)
                await fut
        finally:
            if waiter is not None:
                waiter.eager = False
        if self._error is not None:
            raise self._error

    async def close(self) -> None:
        """Wait for sends, say goodbye to every peer and wait (bounded) for theirs."""
        try:
            await self.wait_sent()
        finally:
            self._closing = True
            self._deliver = None
            if self._waiter is not None:
                for peer in self._peers():  # one goodbye per slot receive the peer posted
                    for _ in range(SLOT_DEPTH):
                        self._send_slot(peer, b"", 0)
                self._flush_sends()
                for peer in self._peers():  # not reposted after an error: take its goodbyes
                    for _ in range(self._ledger.missing(peer)):
                        self._post_slot(peer)
                staying = await self._ledger.wait_all_gone(CLOSE_TIMEOUT_S)
                if staying:
                    log.warning("rank %d: ranks %s did not close their transports within %.0f s;"
                                " their slot receives stay posted", self._rank, staying,
                                CLOSE_TIMEOUT_S)
                self._channels.clear()  # their threads stop now: later work gets new ones
                await self._waiter.aclose(CLOSE_TIMEOUT_S)
                self._waiter = None
            if self._staged is not None:
                self._staged.close()
            # no reference to torch.distributed's objects outlives the close: a transport kept
            # alive by a reference cycle would free them during the interpreter's exit, after
            # destroy_process_group, and a rank then aborted there ("terminate called without
            # an active exception", ~1 launch in 10 on a loaded 2-core host)
            self._group = self._cpu = None

    # -- sending --------------------------------------------------------------------------
    def _peers(self) -> list[int]:
        return [p for p in range(self._size) if p != self._rank]

    def _start(self) -> None:
        if self._posted:
            return
        self._posted = True
        self._waiter = WorkWaiter(asyncio.get_running_loop())
        for peer in self._peers():
            for _ in range(SLOT_DEPTH):
                self._post_slot(peer)

    def _send_slot(self, dest: int, content: bytes, flags: int) -> None:
        buf = SendSlots.control(content, flags)
        self._track_send(dest, self._cpu.send([buf], dest, HEADER_TAG), buf, False)

    def _send_payload(self, dest: int, t: Any, on_device: bool) -> None:
        """One payload transfer: through the CUDA backend (`on_device`), else through gloo,
        CUDA tensors staged through pinned host memory (torch_staging.py)."""
        torch = torch_module()
        if on_device:
            if not t.is_cuda:  # a CPU tensor beside CUDA ones: the receiver expects the device
                raise ProtocolError("a message mixes CPU and CUDA tensors", rank=self._rank,
                                    expected="all on one kind of device", got="both")
            buf = t.detach().contiguous().reshape(-1).view(torch.uint8)
            self._track_send(dest, self._group.send([buf], dest, PAYLOAD_TAG), buf, True)
            return
        buf = t if t.is_cuda else torch.from_numpy(host_bytes(t))
        if t.is_cuda or (self._staged is not None and self._staged.busy(dest)):
            if self._staged is None:
                self._staged = StagedSends(self._send_staged, self._staging_failed)
            self._num_sending += 1  # until its gloo send is posted (then counted there)
            self._staged.push(dest, buf)
            return
        self._send_host(dest, buf, None)

    def _send_staged(self, dest: int, buf: Any, release: Callable[[], None] | None) -> None:
        self._num_sending -= 1
        try:
            self._send_host(dest, buf, release)
        except RuntimeError as exc:  # the peer's link closed
            self._peer_failed(dest, exc)

    def _send_host(self, dest: int, buf: Any, release: Callable[[], None] | None) -> None:
        self._track_send(dest, self._cpu.send([buf], dest, PAYLOAD_TAG), buf, False, release)

    def _staging_failed(self, exc: BaseException) -> None:
        self._raise(exc if isinstance(exc, AioreadyError) else InternalError(
            f"a CUDA copy to host for gloo failed: {type(exc).__name__}: {exc}",
            rank=self._rank))

    def _track_send(self, dest: int, work: Any, buf: Any, polled: bool,
                    release: Callable[[], None] | None = None) -> None:
        """Count the send until its Work completed; then `release` its buffer, if given."""
        self._num_sending += 1
        assert self._waiter is not None
        done = partial(self._sent, dest, buf, release)
        if polled:
            self._waiter.add((dest, "dev-send"), work, done, pollable=True)
            return
        self._unwaited.append((dest, work, done))  # see _flush_sends
        if len(self._unwaited) >= SEND_BATCH or self._waiter.eager or \
                buf.nbytes >= self._pool.min_bytes:  # eager: wait_sent waits; see below
            self._flush_sends()

    def _flush_sends(self) -> None:
        """Hand the sends made since the last flush to their waiter threads.

        A gloo send completes on its own (in gloo's threads); the waiter only learns it, to free
        the buffer and count it for `wait_sent`. Waking a waiter thread per send cost about as
        much as the send itself on a busy host, so sends are handed over in batches, and at
        once while `wait_sent` waits and by `close`. A send to a dead peer is thus noticed late,
        but its receives fail at once (PeerLostError). A large send is handed over at once: the
        peer's receive buffer (receive_pool.py) is reused only once no tensor holds it, and a
        buffer held until the next flush meant a fresh 64 MiB allocation, page faults and all,
        per message (64 MiB one-way 57 -> 77 ms).
        """
        batch, self._unwaited = self._unwaited, []
        assert self._waiter is not None or not batch
        puts = self._channels
        for dest, work, done in batch:
            put = puts.get((dest, "send"))
            if put is None:
                put = puts[dest, "send"] = self._waiter.channel(  # type: ignore[union-attr]
                    (dest, "send"), lazy=True)
            put((work, done))

    def _sent(self, dest: int, buf: Any, release: Callable[[], None] | None,
              exc: BaseException | None) -> None:
        self._num_sending -= 1  # `buf` was kept alive until here by this partial
        if exc is not None:
            self._peer_failed(dest, exc)
        elif release is not None:
            release()
        if not self._num_sending:
            self._maybe_idle()

    def _arrive_local(self, msg: Message) -> None:
        self._num_local -= 1
        self._hand_over(msg.received_from(self._rank))
        self._maybe_idle()

    def _maybe_idle(self) -> None:
        if not (self._num_sending or self._num_local):
            waiters, self._sent_waiters = self._sent_waiters, []
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)

    # -- receiving ------------------------------------------------------------------------
    def _post_slot(self, peer: int, counted: bool = False) -> None:
        """Post one slot receive from `peer`, on its own channel (thread); `counted`: it was
        counted in the ledger when it was scheduled (see `_on_slot`).

        SLOT_DEPTH of them stay posted per peer (gloo matches a peer's receives of one tag in
        posting order): while the loop handles one slot the thread already waits on the next,
        so reposting only queues a Work and wakes no thread. With one slot, each message woke
        the thread again, and it then fought the loop thread for the GIL while the loop ran
        the message's task. Payload receives have a channel of their own: a payload must not
        wait behind a slot that the peer has no message for yet.
        """
        if not counted:
            self._ledger.posted[peer] += 1
        if self._waiter is None:  # closed before a deferred repost ran
            return
        slot = np.empty(self.slot_bytes, np.uint8)  # fresh: inline tensors keep viewing it
        try:
            work = self._cpu.recv([self._from_numpy(slot)], peer, HEADER_TAG)
        except RuntimeError as exc:  # gloo refuses at once a receive from a closed link
            self._ledger.posted[peer] -= 1
            self._peer_failed(peer, exc)
            return
        put = self._channels.get(peer)
        if put is None:
            put = self._channels[peer] = self._waiter.channel((peer, "slot"))
        put((work, partial(self._on_slot, peer, slot)))

    def _on_slot(self, peer: int, slot: np.ndarray, exc: BaseException | None) -> None:
        """A slot from `peer` arrived: deliver its message (or post its payload receives).

        Its replacement is posted after the message was handed over, from a callback the loop
        runs after the ones already scheduled: the task that the delivery woke runs first, and
        the other slot receive posted ahead is there meanwhile. Posting it here, before, put
        the receive's ~10-20 us (gloo tells the sender the receive is ready) between every
        arrival and its task (bench/transport_torch.py). Slots of one peer are handled in
        arrival order, so both sides post that peer's NCCL payloads in the same order.
        """
        if exc is not None:
            self._ledger.posted[peer] -= 1
            self._peer_failed(peer, exc)
            return
        n, flags = PREFIX.unpack_from(slot, 0)
        if n == 0:
            self._ledger.posted[peer] -= 1
            self._ledger.goodbye(peer)  # before our close: fine if we expect nothing more
            return
        try:
            if n > self.slot_bytes - CONTENT:
                raise ProtocolError(f"header slot from rank {peer} is malformed",
                                    rank=self._rank, expected=f"<= {self.slot_bytes - CONTENT}"
                                    " bytes of content", got=n)
            content = slot[CONTENT:CONTENT + n]
            msg = None if flags or self._device is not None or self._plans is None else \
                self._plans.message(content, peer)
            if msg is None:
                self._route(peer, content, flags)
            else:  # an inline message of a layout `_route` decoded before (wire_plans.py)
                self._hand_over(msg)
        except AioreadyError as exc:
            self._ledger.posted[peer] -= 1
            self._raise(exc)
            return
        self._waiter.loop.call_soon(self._post_slot, peer, True)  # type: ignore[union-attr]

    def _route(self, peer: int, buf: np.ndarray, flags: int) -> None:
        try:
            header, layout = self._codec.decode(buf, peer)
        except ProtocolError as exc:
            raise ProtocolError(exc.what, rank=self._rank, expected=exc.expected,
                                got=exc.got) from None
        if len(buf) == layout.inline_len and not flags & ON_DEVICE:
            tensors = self._codec.inline_tensors(buf, layout)
            if self._device is not None:
                tensors = tuple(self._to_device(t) for t in tensors)
            elif self._plans is not None:
                self._plans.learn(buf, layout)
            self._hand_over(self._codec.message(header, tensors))
            return
        if len(buf) != layout.header_len:
            raise ProtocolError(f"header slot from rank {peer} does not match its header",
                                rank=self._rank, expected=f"{layout.header_len} or "
                                f"{layout.inline_len} bytes", got=f"{len(buf)} bytes")
        on_device = bool(flags & ON_DEVICE)
        tensors: list[Any] = []
        inbound = _Inbound(header, tensors, sum(1 for n in layout.sizes if n))
        for spec, dtype, n in zip(layout.specs, layout.dtypes, layout.sizes):
            if dtype is None:
                tensors.append(None)
            elif not n:
                tensors.append(torch_module().empty(spec.shape, dtype=dtype,
                                                    device=self._landing(on_device)))
            else:
                tensors.append(self._receive(peer, inbound, len(tensors), spec, n, on_device))
        if not inbound.left:
            self._payload_done(inbound, None)

    def _landing(self, on_device: bool) -> Any:
        if not on_device:
            return "cpu"
        if self._cuda_device:
            return self._device
        return torch_module().device("cuda", torch_module().cuda.current_device())

    def _receive(self, peer: int, inbound: _Inbound, slot: int, spec: Any, n: int,
                 on_device: bool) -> Any:
        """Post one payload receive; return the tensor it lands in (dtype and shape)."""
        torch = torch_module()
        assert self._waiter is not None
        if on_device:
            raw = torch.empty(n, dtype=torch.uint8, device=self._landing(True))
            work = self._group.recv([raw], peer, PAYLOAD_TAG)
            self._waiter.add((peer, "dev-recv"), work, partial(self._payload_done, inbound),
                             pollable=True)
            return raw.view(torch_dtype(spec.dtype)).reshape(spec.shape)
        host = self._pool.take(n) if n >= self._pool.min_bytes else np.empty(n, np.uint8)
        work = self._cpu.recv([torch.from_numpy(host)], peer, PAYLOAD_TAG)
        self._waiter.add((peer, "recv"), work, partial(self._payload_done, inbound))
        return from_bytes(host, spec.dtype, spec.shape)

    def _payload_done(self, inbound: _Inbound, exc: BaseException | None) -> None:
        if exc is not None:
            self._peer_failed(inbound.header[5], exc)
            return
        inbound.left -= 1
        if inbound.left > 0:
            return
        tensors = inbound.tensors
        if self._device is not None:
            tensors = [self._to_device(t) for t in tensors]
        self._hand_over(self._codec.message(inbound.header, tuple(tensors)))

    def _to_device(self, t: Any) -> Any:
        if t is None or t.device == self._device:
            return t
        return t.to(self._device, non_blocking=True)

    def _hand_over(self, msg: Message) -> None:
        deliver = self._deliver
        if deliver is None:
            if not self._closing:
                self._early.append(msg)
            return
        self.num_received += 1
        try:
            deliver(msg)
        except AioreadyError as exc:
            self._raise(exc)
        except Exception as exc:
            self._raise(InternalError(f"deliver raised {type(exc).__name__}: {exc}",
                                      rank=self._rank))

    # -- closing and failures ---------------------------------------------------------------
    def _peer_failed(self, peer: int, exc: BaseException) -> None:
        if self._closing:  # a peer that died after we said goodbye: nothing is lost
            self._ledger.goodbye(peer, all_of_them=True)
            return
        if peer in self._lost:  # its other transfers fail too: one error per peer
            return
        self._lost.add(peer)
        self._raise(PeerLostError(f"transfer with rank {peer} failed: {exc}", lost_rank=peer,
                                  rank=self._rank))

    def _raise(self, exc: BaseException) -> None:
        """An error found on the loop while receiving: fail the step, keep it for later calls."""
        log.error("rank %d: %s", self._rank, exc)
        if self._error is None:
            self._error = exc
        if self._fail is not None:
            self._fail(exc)
        waiters, self._sent_waiters = self._sent_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_exception(self._error)

    def __repr__(self) -> str:
        return (f"<TorchDistTransport rank={self._rank}/{self._size} sending="
                f"{self._num_sending} device_backend={self.device_backend}>")
