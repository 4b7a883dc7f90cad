"""MPITransport: message-driven, nonblocking point-to-point over mpi4py.

Wire format (docs/architecture.md "Messages"). Two duplicates of the communicator keep the two
kinds of traffic apart, so a header can never match a payload receive or the reverse:

- *header channel*: one message per `Message`, tag = a per-destination sequence number. It holds
  the fixed binary header of transports/base.py, and, when the payload is small
  (<= `inline_bytes`, 64 KiB), the payload itself right after it (16-byte aligned): one MPI
  message per stage boundary. Headers are encoded and decoded by wire.py, which caches the work
  per tensor layout (a few us per message instead of ~20).
- *payload channel*: for larger payloads, one message per non-empty tensor, tag =
  seq * MAX_TENSORS + slot, sent straight from the tensor's storage.

The receiver never posts a receive for a message it does not know: it matches headers with
`Improbe` (any source, any order) and receives them with `Imrecv`, then posts the payload
receives into tensors of the advertised dtype and shape (which may differ per microbatch): large
CPU ones over buffers reused once no tensor refers to them (receive_pool.py: a fresh 64 MiB
tensor cost 5x its transfer in page faults). No call blocks, so no rank can block another.
Completion of every request is polled by the loop's ProgressEngine (progress.py), of which this
transport is a CompletionSource.

Large CPU tensors travel without copies through numpy views of their storage (0.2 us against
7 us for DLPack, docs/async.md "Tensors through mpi4py"); inline payloads are copied once into the
header message; non-contiguous tensors are made contiguous and grad-requiring ones detached.
CUDA tensors go through CUDA-aware MPI when the library says it is, else through pooled pinned
host buffers copied on a stream of their own (cuda/mpi.py); which path is logged at start. Either
way a CUDA payload is handed to MPI only once an event after its producer completed, and a staged
receive is handed over once its copy to the device completed: both events are awaited through the
completion engine, and a pinned buffer goes back to the pool when MPI and the copy are done.
A send to this rank itself (V placements) is delivered locally on the loop, by reference.

A header that does not parse, or sizes that do not match it, raise ProtocolError on the receiving
rank: the runtime's step fails with it (see `open`), and `python -m aioready` or
`aioready.launch.abort_on_error` turn it into MPI_Abort so the whole job stops.

`MPITransport(comm)` duplicates `comm`, a collective call: every rank constructs its transport at
the same point of the program.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from functools import partial
from typing import Any, Callable

import numpy as np

from ..cuda.mpi import HostStager, cuda_mpi_support, mpi_device_buffer
from ..cuda.nccl import open_gpu_plane
from ..cuda.plane import forced_gpu_plane
from ..errors import AioreadyError, ConfigError, InternalError, ProtocolError
from ..progress import ProgressConfig, ProgressEngine
from .base import Deliver, Message, MessageKind, OnFailure, outside_world
from .device_payloads import receive_payloads, send_payloads
from .doorbell import Doorbell
from .header import MAX_TENSORS, TensorSpec
from .mpi_native import NativePath, header_too_large
from .mpi_requests import PendingRequests
from .native import load as load_native
from .notice_board import board_switch, notice_board
from .ordered import OrderedArrivals, device_tag, split_tag
from .receive_pool import ReceivePool
from .tensor_bytes import host_bytes, torch_module
from .wire import Header, WireCodec
from .wire_plans import ReceivePlans, SendPlans

__all__ = ["MPITransport", "INLINE_BYTES", "HOT_BYTES", "BIG_BURST"]

log = logging.getLogger(__name__)

INLINE_BYTES = int(os.environ.get("AIOREADY_MPI_INLINE_BYTES", 65536))
HOT_BYTES = int(os.environ.get("AIOREADY_MPI_HOT_BYTES", 65536))
BIG_BURST = int(os.environ.get("AIOREADY_MPI_BIG_BURST", 32))
# inline payloads from this size are sent from the tensor's memory (`_isend_parts`; 0: never)
ZERO_COPY = int(os.environ.get("AIOREADY_MPI_ZERO_COPY", 32768))
_ZEROS = bytes(16)  # the padding after a payload sent from its tensor
_SEQ_MOD = 32768 // MAX_TENSORS  # payload tags stay under the guaranteed MPI tag bound (32767)
_PROBES_PER_POLL = 64
_RUNG_PROBES = 16  # empty Improbes more after a ring, which says a header is there (_probe)
_MAX_HEADER = 4096  # > the fixed part and MAX_TENSORS descriptors of MAX_NDIM dimensions
_SMALL_HEADER = 4096  # header messages up to this are received into a bytearray (_probe)


class _Inbound:
    """A message whose header arrived and whose payload receives are outstanding."""

    __slots__ = ("header", "tensors", "left")

    def __init__(self, header: Header, tensors: list[Any], left: int) -> None:
        self.header = header
        self.tensors = tensors
        self.left = left


class MPITransport:
    """The Transport protocol over MPI point-to-point; one per rank, on that rank's loop."""

    def __init__(self, comm: Any = None, *, device: Any = None,
                 inline_bytes: int = INLINE_BYTES, hot_bytes: int = HOT_BYTES,
                 fast: bool | None = None, gpu_plane: Any = None) -> None:
        from mpi4py import MPI
        self._MPI = MPI
        comm = MPI.COMM_WORLD if comm is None else comm
        self._rank = comm.Get_rank()
        self._size = comm.Get_size()
        support = cuda_mpi_support(comm)  # before Dup: a bad override fails before collectives
        forced_gpu_plane()  # likewise for AIOREADY_GPU_PLANE
        self._hdr = comm.Dup()
        self._data = comm.Dup()
        # collective: the ranks agree on how CUDA payloads travel (cuda/plane.py)
        choice, self._plane = open_gpu_plane(self._hdr, cuda_aware=support.aware,
                                             device=device, explicit=gpu_plane)
        self.gpu_plane = choice.plane
        self.cuda_aware = choice.plane == "mpi"
        self._order: OrderedArrivals[tuple[int, np.ndarray]] | None = (
            OrderedArrivals() if self._plane is not None else None)
        self.oversubscribed = _oversubscribed(MPI, self._hdr)  # collective, like Dup
        self._device = device
        self.inline_bytes = inline_bytes
        # a header and an inline payload; a sender configured for larger inline payloads
        # (AIOREADY_MPI_INLINE_BYTES) is still served up to 16 MiB
        self._max_header_message = _MAX_HEADER + max(inline_bytes, 1 << 24)
        self.hot_bytes = hot_bytes
        # fast paths (docs/hot_path.md), each with the plain path it replaces kept behind it
        self.fast = os.environ.get("AIOREADY_MPI_FAST", "1") != "0" if fast is None else fast
        _same_on_every_rank(MPI, self._hdr, {"AIOREADY_MPI_FAST (or fast=)": self.fast,
                                             "AIOREADY_NOTICE_BOARD": board_switch()})
        self._bell = _doorbell(MPI, self._hdr) if self.fast else None  # collective
        # a ring names this transport, so a waiting engine polls it in the reader callback
        self._ring_source = self if os.environ.get("AIOREADY_RING_POLL", "1") != "0" else None
        path, how = _PATHS[choice.plane]
        log.info("rank %d/%d: CUDA tensors take the %s path, %s (%s: %s)", self._rank,
                 self._size, path, how, support.method, support.detail)
        self._seq = [0] * self._size
        self._codec = WireCodec(fast=self.fast)
        torch_module()  # its dtype tables now: on the first message received they cost ~0.7 ms
        # precompiled plans for lone CPU tensors sent inline (wire_plans.py)
        plans = self.fast and os.environ.get("AIOREADY_MPI_PLANS", "1") != "0"
        self._send_plans = SendPlans(self._codec, inline_bytes, ZERO_COPY) if plans else None
        # received ones only where nothing follows the decode: CPU delivery, no ordered plane
        self._recv_plans = ReceivePlans() if plans and self._order is None and (
            device is None or str(device) == "cpu") else None
        # the compiled helper (native/) where both plans are: a planned send, every probe
        module = load_native() if None not in (self._recv_plans, self._send_plans) else None
        self._native = None if module is None else NativePath(
            self, module, seq_mod=_SEQ_MOD, probes=_PROBES_PER_POLL, rung_probes=_RUNG_PROBES)
        if self._native is not None:
            self._probe = self._native.probe  # type: ignore[method-assign]
        # notices in shared memory where every rank is on this host (notice_board.py); collective
        self.notice_board = notice_board(MPI, self._hdr, module) if self.fast else None
        self._pool = ReceivePool()
        self._host_device = device is None or str(device) == "cpu"
        self._cuda_device = not self._host_device and torch_module().device(device).type == "cuda"
        self._stagers: dict[Any, HostStager] = {}
        self._status = MPI.Status()
        self._pending = PendingRequests(MPI.Request.Testsome)
        self._num_sending = 0
        self._num_local = 0
        self._sent_waiters: list[asyncio.Future[None]] = []
        self._deliver: Deliver | None = None
        self._fail: OnFailure | None = None
        self._engine: ProgressEngine | None = None
        self._error: BaseException | None = None
        self._rung = False  # the doorbell rang since the last probe
        # an empty probe after a match is repeated too (_probe); AIOREADY_PROBE_AGAIN=0: not
        self._probe_again = os.environ.get("AIOREADY_PROBE_AGAIN", "1") != "0"
        # a notice rings no peer whose loop computes a task (hush_doorbell; only while probing
        # again, so that the task's-end poll reads it); =0: it rings
        self._hush = os.environ.get("AIOREADY_HUSH_NOTICES", "1") != "0"
        self.num_sent = self.num_received = 0

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._size

    # -- Transport ------------------------------------------------------------------------
    def open(self, deliver: Deliver, *, on_failure: OnFailure | None = None) -> None:
        """Start matching headers on the running loop.

        Errors found while receiving go to `on_failure` (the runtime's: it stops the step), and
        are raised again by `send_nowait`/`wait_sent`.
        """
        self._deliver = deliver
        self._fail = on_failure
        self._engine = ProgressEngine.for_loop()
        if self.oversubscribed:
            self._engine.reconfigure(ProgressConfig.from_env(oversubscribed=True))
        self._engine.add_source(self)
        if self._bell is not None:
            self._engine.loop.add_reader(self._bell.fileno(), self._on_ring)

    def send_nowait(self, dest: int, msg: Message) -> None:
        if self._error is not None and msg.kind is not MessageKind.CONTROL:
            raise self._error  # control still goes out: a failed rank's error broadcast
        if not 0 <= dest < self._size:
            raise outside_world(self._rank, self._size, dest)
        self.num_sent += 1
        if dest == self._rank:
            self._num_local += 1
            asyncio.get_running_loop().call_soon(self._arrive_local, msg)
            return
        if self._native is not None and self._native.send(dest, msg):
            return
        tensors = msg.tensors
        plans = self._send_plans
        buf = None if plans is None else plans.encode(msg)
        if buf is None:
            descriptors, sizes, on_cuda = self._codec.describe(tensors)
        seq = self._seq[dest]
        self._seq[dest] = (seq + 1) % _SEQ_MOD
        if buf is not None or not on_cuda and sum(sizes) <= self.inline_bytes:
            if buf is None:
                buf = self._codec.encode_inline(msg, descriptors, sizes)
            if type(buf) is tuple:  # a large payload's plan: header and tensor as they are
                self._isend_parts(dest, seq, buf)
            else:
                self._isend(self._hdr, buf, dest, seq, len(buf) >= self.hot_bytes)
            if self._bell is not None:
                self._bell.ring(dest, msg.kind is MessageKind.NOTICE)
        else:
            on_plane = self._plane is not None and (on_cuda or self.gpu_plane == "custom")
            if on_plane:  # first: a message the plane refuses sends no header either
                self._send_on_plane(dest, tensors, sizes)
            header = self._codec.fixed(msg, len(sizes)) + descriptors
            self._isend(self._hdr, header, dest, device_tag(seq, on_plane), False)
            if self._bell is not None:
                self._bell.ring(dest)
            for i, (t, n) in enumerate(zip(tensors, sizes)):
                if n and not on_plane:
                    self._send_payload(dest, seq * MAX_TENSORS + i, t, n)
        self._kick_after_send()

    def _kick_after_send(self) -> None:
        engine = self._engine
        # poll soon and spin for the reply; with a doorbell and no spin window (an
        # oversubscribed host) a send that left at once needs neither: the reply rings
        if self._bell is None or self._pending or engine.config.spin_s:  # type: ignore
            engine.kick()  # type: ignore[union-attr]  # open() set it

    async def wait_sent(self) -> None:
        while self._num_sending or self._num_local:
            fut = asyncio.get_running_loop().create_future()
            self._sent_waiters.append(fut)
            await fut
        if self._error is not None:
            raise self._error

    async def close(self) -> None:
        try:
            await self.wait_sent()
        finally:
            if self._engine is not None:
                self._engine.remove_source(self)
            if self._bell is not None:
                if self._engine is not None and not self._engine.loop.is_closed():
                    self._engine.loop.remove_reader(self._bell.fileno())
                self._bell.close()
                self._bell = None  # an engine that armed it may still disarm it
            if self.notice_board is not None:
                self.notice_board.close()  # later posts answer False, reads find nothing
            for stager in set(self._stagers.values()):
                stager.close()
            if self._plane is not None:
                self._plane.close()
            self._deliver = None
            self.route_notices(None)
            for comm in (self._hdr, self._data):
                if comm != self._MPI.COMM_NULL:
                    comm.Free()

    # -- sending --------------------------------------------------------------------------
    def _send_payload(self, dest: int, tag: int, t: Any, n: int) -> None:
        big = n >= self.hot_bytes
        if not t.is_cuda:
            self._isend(self._data, host_bytes(t), dest, tag, big)
            return
        cuda = torch_module().cuda
        t = t.detach().contiguous()
        stager = self._stager(t.device)
        ready = cuda.Event()  # after whatever the loop thread enqueued: the producer, contiguous()
        ready.record(cuda.current_stream(t.device))
        if self.cuda_aware:
            buf, done, host = mpi_device_buffer(t), stager.fence(ready), None
        else:
            host, done = stager.to_host(t, ready)
            buf = host_bytes(host)
        self._num_sending += 1  # counted from here until its Isend completes
        start = partial(self._start_send, buf, dest, tag, big, stager, host)
        stager.completion(done).add_done_callback(partial(self._on_copied, start, True))

    def _send_on_plane(self, dest: int, tensors: tuple[Any, ...], sizes: list[int]) -> None:
        """CUDA payloads over the NCCL plane, in slot order (transports/device_payloads.py);
        each is counted until the plane is done with its buffer."""
        for fut in send_payloads(self._plane, dest, tensors, sizes, rank=self._rank):
            self._num_sending += 1
            fut.add_done_callback(partial(self._on_plane, self._plane_sent))

    def _plane_sent(self) -> None:
        self._num_sending -= 1
        self._maybe_idle()

    def _on_plane(self, then: Callable[[], None], fut: asyncio.Future[None]) -> None:
        """A transfer of the NCCL plane completed (its CUDA event); a fault fails the step."""
        self._on_copied(then, False, fut)

    def _start_send(self, buf: Any, dest: int, tag: int, big: bool, stager: HostStager,
                    host: Any) -> None:
        release = None if host is None else partial(stager.release, host)
        self._isend(self._data, buf, dest, tag, big, release)
        self._engine.kick()  # type: ignore[union-attr]  # open() set it

    def _isend(self, comm: Any, buf: Any, dest: int, tag: int, big: bool,
               release: Callable[[], None] | None = None) -> None:
        req = comm.Isend(buf, dest, tag)
        if self.fast and not big and req.Test():  # eager: done at once, nothing to track
            if release is not None:
                release()
            if self._sent_waiters:  # a staged CUDA send was counted until here
                self._maybe_idle()
            return
        self._track_send(req, buf, release, dest if comm is self._hdr else None, big)

    def _track_send(self, req: Any, keep: Any, release: Callable[[], None] | None,
                    header_dest: int | None, big: bool) -> None:
        """A send that did not complete at once (here or in the compiled helper): tracked,
        `keep` alive until it completes. `header_dest`: the receiver of a header, which rang
        too early and is rung again once it is sent."""
        self._num_sending += 1
        ring = header_dest if self._bell is not None else None
        self._track(req, partial(self._sent, keep, release, ring), big)

    def _isend_parts(self, dest: int, tag: int, parts: tuple[bytes, Any, int, int]) -> None:
        """One header message written from its parts (`SendPlans.encode`): the header, the
        tensor's own memory and the zero padding after it, through an MPI datatype of their
        addresses, where packing them into one bytes object copied the payload twice. The same
        bytes on the wire; the tensor stays untouched until the send completes (the Transport
        contract), and is kept alive until then."""
        head, t, n, tail = parts
        MPI = self._MPI
        lengths, where = [len(head), n], [MPI.Get_address(head), t.data_ptr()]
        if tail:
            lengths.append(tail)
            where.append(MPI.Get_address(_ZEROS))
        dtype = MPI.BYTE.Create_hindexed(lengths, where).Commit()
        try:  # (freeing a datatype leaves a send that uses it to complete)
            self._isend(self._hdr, [MPI.BOTTOM, 1, dtype], dest, tag,
                        len(head) + n + tail >= self.hot_bytes, partial(_keep, head, t))
        finally:
            dtype.Free()

    def _sent(self, buf: Any, release: Callable[[], None] | None,
              ring: int | None = None) -> None:
        self._num_sending -= 1  # `buf` was kept alive until here by this partial
        if release is not None:  # MPI is done with the pinned buffer: back to the pool
            release()
        if ring is not None:
            self._bell.ring(ring)  # type: ignore[union-attr]
        self._maybe_idle()

    def _on_copied(self, then: Callable[[], None], sending: bool,
                   copied: asyncio.Future[None]) -> None:
        """Go on once a CUDA event completed; a CUDA fault fails the step like an MPI error."""
        if sending:
            self._num_sending -= 1  # `then` counts it again, until its Isend completes
        try:
            copied.result()
            then()
        except AioreadyError as exc:
            self._raise(exc)
        except Exception as exc:  # as in poll(): a bug must fail the step, not stop a send
            self._raise(InternalError(f"{type(exc).__name__} after a CUDA copy: {exc}; please "
                                      "file a bug", rank=self._rank))

    def _stager(self, device: Any) -> HostStager:
        """The copy stream and pinned pool of `device` (one each, made on first use)."""
        stager = self._stagers.get(device)
        if stager is None:
            stager = HostStager(device)
            stager = self._stagers.setdefault(stager.device, stager)
            self._stagers[device] = stager
        return stager

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

    # -- CompletionSource -----------------------------------------------------------------
    def _track(self, req: Any, done: Callable[[], None], big: bool) -> None:
        self._pending.add(req, done, big)

    def poll(self) -> int:
        try:  # one function, not two: this runs every hot pass (docs/hot_path_measurements.md)
            n = self._probe() if self._deliver is not None else 0
            if not self._pending.reqs:
                return n
            # a large transfer moves one pipeline chunk per MPI call: BIG_BURST calls per loop
            # pass while one is pending (bench: 64 MiB)
            done = self._pending.completed(BIG_BURST)
            for fn in done:
                fn()
            return n + len(done)
        except AioreadyError as exc:
            self._raise(exc)
        except Exception as exc:  # a bug here must fail the step, not silently stop polling
            self._raise(InternalError(f"{type(exc).__name__} while polling MPI: {exc}; please "
                                      "file a bug", rank=self._rank))
        return 1

    def num_pending(self) -> int:  # CUDA copies are pending in their stager's event source
        return len(self._pending.reqs) + (self._deliver is not None)

    def wants_hot(self) -> bool:
        return self._pending.num_big > 0

    def arm_doorbell(self) -> bool:
        """The engine is about to park: may a peer's message wake it (doorbell.py)? Only while
        nothing but the next header is awaited (a tracked request needs polling)."""
        if self._bell is None or self._pending:
            return False
        self._bell.set_parked(True)
        return True

    def disarm_doorbell(self) -> None:
        if self._bell is not None:
            self._bell.set_parked(False)

    def hush_doorbell(self, hushed: bool = True) -> bool:
        """The engine's doorbell park goes on through a task on the loop thread, whose end polls
        (`ProgressEngine.inline_task_begins`): peers' notices ring no more until
        `hush_doorbell(False)` (parked as before), their data messages still do. A notice read
        at the task's end is read when its ring would have been answered, after the task, so
        no decision changes; the sender saves its datagram, this rank the wake-up
        (docs/hot_path_measurements.md "Notices ring no loop that computes")."""
        if self._bell is None or not self._hush or not self._probe_again:
            return False  # (the end's one poll must find every notice: `_probe`'s docstring)
        self._bell.set_computing(hushed)
        return True

    def _on_ring(self) -> None:
        self._bell.drain()  # type: ignore[union-attr]  # registered only with a doorbell
        self._rung = True
        self._engine.ring(self._ring_source)  # type: ignore[union-attr]

    # -- receiving ------------------------------------------------------------------------
    def _probe(self) -> int:
        """Match and receive every header that has arrived.

        A message that reached this rank since the last MPI call is often not matched by the
        first `Improbe` (that call's progress moves it into MPICH's queue after the match was
        tried), only by the next one: traced on a parked receiver, a message sent just after
        one wake-up was missed by the next wake-up 8 ms later and found by the one after. So an
        empty first probe is repeated once (+0.5 us a pass): parked ranks see a message one
        park earlier (idle wake delay 10-20 ms -> 1-9 ms with 8 ms parks).

        After a doorbell rang, a header is there, and with 16 ranks MPICH took 2-5 calls to
        match it (measured: the sender's datagram read, then Improbe until it matches): up to
        `_RUNG_PROBES` more, where the engine would park 250 us between two polls and wake
        again (an idle rank's ring-to-delivery 0.5-2 ms -> docs/hot_path_measurements.md "What
        wakes a rank").

        An empty probe after a match is repeated once as well: a poll that matched an older
        message (a peer's notice) left the newer one, which rang, to the next ring or the 50 ms
        backstop (`AIOREADY_PROBE_AGAIN=0` turns this off).
        """
        n = 0
        status = self._status
        improbe = self._hdr.Improbe
        MPI = self._MPI
        plans = self._recv_plans
        for i in range(_PROBES_PER_POLL):
            m = improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)
            if m is None and i == 0:  # see _probe's docstring
                m = improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)
                if m is None and self._rung:
                    for _ in range(_RUNG_PROBES):
                        m = improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)
                        if m is not None:
                            break
            elif m is None and self._probe_again:  # after a match, likewise (docstring)
                m = improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)
            if m is None:
                break
            src, seq = status.Get_source(), status.Get_tag()
            count = status.Get_count(MPI.BYTE)
            if count > self._max_header_message:  # hostile input: bounded before allocation
                raise header_too_large(self._rank, src, count, self._max_header_message)
            n += 1
            # up to _SMALL_HEADER where plans read it, a bytearray: half np.empty's cost, and
            # the plan's views of it are cheaper (the general path reads a numpy view of it)
            raw = bytearray(count) if plans is not None and count <= _SMALL_HEADER else \
                np.empty(count, np.uint8)
            req = m.Irecv(raw)
            # matched in the peer's send order: the NCCL plane needs its headers in that order
            ticket = None if self._order is None else self._order.ticket(src)
            if req.Test():
                msg = None if plans is None else plans.message(raw, src)
                if msg is not None:  # a layout seen before (wire_plans.py)
                    self._hand_over(msg)
                    continue
                self._on_header(src, seq, _as_numpy(raw), ticket, planned=True)
            else:  # a large inline message may need a rendezvous: poll it hot
                self._track(req, partial(self._on_header, src, seq, _as_numpy(raw), ticket),
                            count >= self.hot_bytes)
        self._rung = False
        return n

    def _on_header(self, src: int, seq: int, buf: np.ndarray, ticket: int | None = None, *,
                   planned: bool = False) -> None:
        """A header message received (`planned`: the receive plans already declined it)."""
        try:
            if ticket is None:
                msg = None if self._recv_plans is None or planned else \
                    self._recv_plans.message(buf, src)
                if msg is None:
                    self._route_header(src, seq, buf)
                else:  # a layout seen before (wire_plans.py), received after a wait
                    self._hand_over(msg)
                return
            for seq, buf in self._order.complete(src, ticket, (seq, buf)):  # type: ignore
                self._route_header(src, seq, buf)
        except AioreadyError as exc:
            self._raise(exc)

    def _route_header(self, src: int, tag: int, buf: np.ndarray) -> None:
        seq, on_plane = split_tag(tag)
        try:
            header, layout = self._codec.decode(buf, src)
        except ProtocolError as exc:
            raise ProtocolError(exc.what, rank=self._rank, expected=exc.expected,
                                got=exc.got) from None
        if len(buf) == layout.inline_len:  # header and payload in one message
            if self._recv_plans is not None and header[1] is not MessageKind.CONTROL:
                self._recv_plans.learn(buf, layout)
            tensors = self._codec.inline_tensors(buf, layout)
            if self._device is not None:
                tensors = tuple(self._to_device(t) for t in tensors)
            self._hand_over(self._codec.message(header, tensors))
            return
        hlen = layout.header_len
        if len(buf) != hlen:
            raise ProtocolError(f"message from rank {src} does not match its header",
                                rank=self._rank, expected=f"{hlen} bytes (header) or "
                                f"{layout.inline_len} (header and payload)",
                                got=f"{len(buf)} bytes")
        sizes = layout.sizes
        if on_plane:
            self._receive_on_plane(src, header, layout)
            return
        tensors = [None if d is None else self._receive_buffer(s, d, n)
                   for s, d, n in zip(layout.specs, layout.dtypes, sizes)]
        inbound = _Inbound(header, tensors, sum(1 for n in sizes if n))
        for i, (t, n) in enumerate(zip(tensors, sizes)):
            if n:
                dst = t if t.is_cuda else host_bytes(t)
                req = self._data.Irecv(dst, src, seq * MAX_TENSORS + i)
                self._track(req, partial(self._payload_done, inbound), n >= self.hot_bytes)
        if not inbound.left:  # only empty tensors: nothing more will arrive
            self._payload_done(inbound, count=False)

    def _receive_on_plane(self, src: int, header: Header, layout: Any) -> None:
        """Post the message's NCCL receives (in the peer's order: see _on_header); hand it
        over once the last one's CUDA event completed."""
        if self._plane is None:
            raise ProtocolError(f"rank {src} sent payloads over a GPU data plane this rank has "
                                "not made", rank=self._rank, expected="the same GPU plane on "
                                "every rank", got=f"plane {self.gpu_plane}")
        tensors, futures = receive_payloads(self._plane, src, layout.specs, layout.dtypes,
                                            layout.sizes)
        inbound = _Inbound(header, tensors, len(futures))
        for fut in futures:
            fut.add_done_callback(partial(self._on_plane, partial(self._payload_done, inbound)))
        if not futures:
            self._payload_done(inbound, count=False)

    def _receive_buffer(self, spec: TensorSpec, dtype: Any, nbytes: int) -> Any:
        """Where a payload lands: for the CPU a reused host buffer when large; for a CUDA device
        the device itself when MPI is CUDA-aware (and for empty tensors, which MPI never
        writes), else a pooled pinned buffer; for other devices a host tensor, copied over."""
        torch = torch_module()
        if self._host_device and nbytes >= self._pool.min_bytes:
            return self._pool.tensor(spec.shape, spec.dtype, nbytes)  # type: ignore[arg-type]
        if self._cuda_device:
            if self.cuda_aware or not nbytes:
                return torch.empty(spec.shape, dtype=dtype, device=self._device)
            return self._stager(self._device).host_buffer(spec.shape, dtype)
        return torch.empty(spec.shape, dtype=dtype)

    def _payload_done(self, inbound: _Inbound, count: bool = True) -> None:
        inbound.left -= count
        if inbound.left:
            return
        tensors = inbound.tensors
        if self._cuda_device and not self.cuda_aware:
            self._copy_to_device(inbound.header, tensors)
            return
        if not self._host_device:
            tensors = [self._to_device(t) for t in tensors]
        self._hand_over(self._codec.message(inbound.header, tuple(tensors)))

    def _copy_to_device(self, header: Header, tensors: list[Any]) -> None:
        """Staged receive: pinned buffers to the device on the copy stream; the message is
        handed over, and the buffers go back to the pool, once the last copy completed."""
        stager = self._stager(self._device)
        hosts = [t for t in tensors if t is not None and not t.is_cuda]
        if not hosts:  # only None and empty slots: nothing was staged
            self._hand_over(self._codec.message(header, tuple(tensors)))
            return
        outs, done = [], None
        for t in tensors:
            if t is not None and not t.is_cuda:
                t, done = stager.to_device(t)
            outs.append(t)
        arrived = partial(self._copied_in, header, tuple(outs), stager, hosts)
        stager.completion(done).add_done_callback(partial(self._on_copied, arrived, False))

    def _copied_in(self, header: Header, tensors: tuple[Any, ...], stager: HostStager,
                   hosts: list[Any]) -> None:
        for host in hosts:
            stager.release(host)
        self._hand_over(self._codec.message(header, tensors))

    def _to_device(self, t: Any) -> Any:
        if t is None or self._device is None or t.device == torch_module().device(self._device):
            return t
        return t.to(self._device, non_blocking=True)

    def _hand_over(self, msg: Message) -> None:
        self.num_received += 1
        deliver = self._deliver
        if deliver is None:
            self._raise(ProtocolError("message after the transport was closed", rank=self._rank,
                                      expected="no message", got=msg.describe()))
            return
        try:
            deliver(msg)
        except Exception as exc:
            self._deliver_failed(exc)

    def _deliver_failed(self, exc: Exception) -> None:
        """What `deliver` (or the notice handler) raised: the step fails with it."""
        self._raise(exc if isinstance(exc, AioreadyError) else InternalError(
            f"deliver raised {type(exc).__name__}: {exc}", rank=self._rank))

    def route_notices(self, handler: Callable[[int, int, int, int], None] | None) -> bool:
        """Have the compiled helper hand each received notice's (step, stage, microbatch, tag)
        to `handler` instead of a Message to `deliver` (docs/hot_path_measurements.md "The
        notice's read in one C call"); False, and Messages as before, where it does not
        (helper off, AIOREADY_NATIVE_RECV_HEADS=0). None: Messages again."""
        return self._native is not None and self._native.route_notices(handler)

    def _raise(self, exc: BaseException) -> None:
        """An error found on the loop while receiving: fail the step, keep it for later calls."""
        log.error("rank %d: %s", self._rank, exc)
        if self._error is None:
            self._error = exc
        if self._fail is not None:
            self._fail(exc)
        self._maybe_idle_with_error()

    def _maybe_idle_with_error(self) -> None:
        waiters, self._sent_waiters = self._sent_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_exception(self._error)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return (f"<MPITransport rank={self._rank}/{self._size} sending={self._num_sending} "
                f"requests={len(self._pending)} cuda_aware={self.cuda_aware}>")


_PATHS = {"mpi": ("device", "device buffers straight to MPI"),
          "staged": ("staged", "through pooled pinned host buffers"),
          "nccl": ("nccl", "payloads over NCCL communicators made with CuPy, headers over MPI"),
          "custom": ("custom", "payloads over the byte plane given, headers over MPI")}


def _as_numpy(buf: np.ndarray | bytearray) -> np.ndarray:
    """The general receive path's view of a header message: it reads numpy."""
    return buf if type(buf) is np.ndarray else np.frombuffer(buf, np.uint8)


def _keep(*_: Any) -> None:
    """A send's `release` that only holds its arguments (memory MPI reads) until it is sent."""


def _same_on_every_rank(MPI: Any, comm: Any, switches: dict[str, bool]) -> None:
    """Switches that decide a collective set-up (the doorbell, the notice board) must agree:
    a rank whose value differs would skip a collective the others wait in, a hang. Checked
    with one collective first; a ConfigError on every rank names what differs."""
    mine = np.array([int(on) for on in switches.values()], np.int32)
    least = np.empty(2 * len(mine), np.int32)  # min of each value, and of 1 - each: its max
    comm.Allreduce(np.concatenate([mine, 1 - mine]), least, op=MPI.MIN)
    low, high = least[:len(mine)], 1 - least[len(mine):]
    differ = [name for name, lo, hi in zip(switches, low, high) if lo != hi]
    if differ:
        raise ConfigError("a switch of the MPI transport differs between ranks",
                          rank=comm.Get_rank(), expected="the same value on every rank",
                          got="on this rank " + ", ".join(
                              f"{n}={'on' if switches[n] else 'off'}" for n in differ),
                          fix="set it alike in every rank's environment")


def _doorbell(MPI: Any, comm: Any) -> Doorbell | None:
    """A doorbell when every rank is on this host (Linux), else None (timer parks only)."""
    if not sys.platform.startswith("linux"):
        return None
    bell = Doorbell(MPI, comm)
    if bell.usable:
        return bell
    bell.close()
    return None


def _oversubscribed(MPI: Any, comm: Any) -> bool:
    """More ranks on this host than the cores they may run on together (a spinning poller would
    only take time from the other ranks). The cores are the union of the local ranks' affinity
    masks: ranks bound one per core (`mpiexec -bind-to core`) are not oversubscribed, although
    each of them sees a single core."""
    try:
        local = comm.Split_type(MPI.COMM_TYPE_SHARED)
        try:
            ranks = local.Get_size()
            ncpu = os.cpu_count() or 1
            mine = np.zeros(ncpu, np.uint8)
            allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(ncpu)
            mine[[c for c in allowed if c < ncpu]] = 1
            union = np.zeros_like(mine)
            local.Allreduce(mine, union, op=MPI.MAX)
        finally:
            local.Free()
    except Exception:  # an MPI without shared-memory split: assume a core per rank
        return False
    return ranks > int(union.sum())
