"""SecureTransport: authenticated encryption of every message, around any Transport.

`SecureTransport(inner, key=..., session=...)` seals each message before `inner` sends it and
opens it before the runtime sees it, so activations and gradients crossing a network can be
neither read nor altered by someone on it. A sealed message keeps the original step, kind,
stage, microbatch and tag (the inner transport routes on them) and travels as `count` inner
messages, its segments, each one uint8 tensor:

    seq (8) | descriptor length (4) | segment bytes (4) | count (4) | index (4) | descriptors
    (dtype, shape; header.py) | pad to 16 | ciphertext of segment `index` | tag (16)

The plaintext (the tensors' bytes, each at a 16-byte aligned offset) is cut into segments of
`segment bytes`, the last one shorter; a message of at most one segment is one inner message.

- AEAD: AES-256-GCM (default) or ChaCha20-Poly1305, from the `cryptography` package. The
  associated data of every segment is the header: those fields, the sender, the receiver and
  the prefix without the index (so the segment count and size are authenticated too); changing
  any of them fails the tag. The payload is encrypted.
- Nonce: (sender, receiver, seq << 24 | index), 2 + 2 + 8 bytes, seq counting the messages of
  that ordered pair from 0. It never repeats under one key: the key used is derived from the
  key file's key and a `session` fresh for every run (secure_key.py). A segment moved to
  another index, or another message's segment, fails its tag; segments that arrive out of
  order are each decrypted into their place; a segment cut short, a count or size that does
  not describe the payload, a segment seen twice, all are a ProtocolError naming the sender.
- Order: the receiver expects seq 0, 1, 2, ... from each sender. A message that fails its tag
  (altered, truncated, another key or session), one whose seq was already delivered (a
  replay), one not sealed at all, or one too far ahead is a ProtocolError naming the sender.
  Messages that the inner transport legitimately delivers out of order (a small one overtaking
  a large one) are held and delivered in the order they were sealed.
- Overlap: a message of several segments is sealed one segment per loop pass, each handed to
  `inner` as soon as it is sealed, so the transfer of the first segments (the progress engine
  polls between passes) overlaps the sealing of the next ones; the receiver opens each segment
  as it arrives, while the later ones travel. The loop is never blocked for more than one
  segment's cipher pass (~0.2 ms per 4 MiB here), whatever the message size, so heartbeats
  and watchdogs keep their timers. `threads=True` seals and opens in one worker thread per
  direction instead (the cipher releases the GIL): a gain only where cores are idle; on this
  2-core machine it measured slower (bench/results/secure.md): a worker that needs the GIL
  while the loop thread polls waits up to Python's switch interval (5 ms).
  Ciphertext and plaintext go straight into reused buffers (receive_pool.py): no extra copy
  of a contiguous tensor.

Received tensors are CPU tensors viewing the decrypted buffer. The tensors given to
`send_nowait` must not change until `wait_sent` returns (as for every transport).
"""

from __future__ import annotations

import asyncio
import struct
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..errors import AioreadyError, ConfigError, InternalError, ProtocolError
from .base import (
    Deliver,
    Message,
    MessageKind,
    OnFailure,
    Transport,
    WrappedTransport,
    outside_world,
)
from .header import _FIXED, HEADER_MAGIC, MAX_TENSORS, encode_descriptor
from .receive_pool import ReceivePool
from .sealed_layout import (
    COMMON,
    INDEX,
    INDEX_BITS,
    MAX_SEQ,
    PREFIX_BYTES,
    TAG_BYTES,
    Segment,
    align,
    opened,
    parse,
    plaintext,
)
from .secure_key import CIPHERS, KEY_BYTES, key_fingerprint, load_key, make_aead, secure_session
from .tensor_bytes import spec_of, torch_module

__all__ = ["SecureTransport", "load_key", "key_fingerprint", "secure_session", "CIPHERS",
           "KEY_BYTES", "MAX_AHEAD", "SEGMENT_BYTES"]

MAX_AHEAD = 4096  # messages of one sender held while an earlier one is still on its way
SEGMENT_BYTES = 4 << 20  # bench/results/secure.md: 1 MiB segments cost more CPU than they hide
_PAIR = struct.Struct("<HH")  # sender, receiver
_NONCE = struct.Struct("<HHQ")  # sender, receiver, seq << INDEX_BITS | index


class _Sealing:
    """One outgoing message: its header, plaintext and the buffer its segments are sealed into."""

    __slots__ = ("dest", "msg", "seq", "plain", "total", "seg", "count", "ad", "head",
                 "prefix", "stride", "out")

    def message(self, index: int) -> Message:
        """Segment `index`, sealed, as the inner transport's message."""
        start = index * self.stride
        blob = self.out[start:start + self.head + self.seg_len(index) + TAG_BYTES]
        msg = self.msg
        return Message(msg.step, msg.kind, msg.stage, msg.microbatch,
                       (torch_module().from_numpy(blob),), msg.tag)

    def seg_len(self, index: int) -> int:
        return min(self.seg, self.total - index * self.seg) if self.total else 0


class _Opening:
    """One incoming message of several segments, while they arrive."""

    __slots__ = ("common", "specs", "sizes", "plain", "seen", "left", "msg")


class SecureTransport(WrappedTransport):
    """Any Transport, with every message sealed by an AEAD cipher (see the module note)."""

    def __init__(self, inner: Transport, *, key: bytes, session: bytes,
                 cipher: str = "aes-256-gcm", segment_bytes: int = SEGMENT_BYTES,
                 threads: bool = False) -> None:
        self._aead = make_aead(key, session, cipher)
        from cryptography.exceptions import InvalidTag
        self._invalid = InvalidTag
        if inner.world_size > 1 << 16:
            raise ConfigError("too many ranks to seal", expected="<= 65536",
                              got=inner.world_size)
        if isinstance(segment_bytes, bool) or not isinstance(segment_bytes, int) or \
                not 1 << 16 <= segment_bytes < 1 << 32:
            raise ConfigError("segment_bytes", expected="an int in 64 KiB .. 4 GiB",
                              got=repr(segment_bytes))
        super().__init__(inner)
        self.cipher = cipher
        self.segment_bytes = segment_bytes
        self.threads = threads
        self.fingerprint = key_fingerprint(key)
        self._send_seq = [0] * inner.world_size
        self._next = [0] * inner.world_size
        self._held: list[dict[int, Message]] = [{} for _ in range(inner.world_size)]
        self._opening: list[dict[int, _Opening]] = [{} for _ in range(inner.world_size)]
        self._deliver: Deliver | None = None
        self._on_failure: OnFailure | None = None
        self._error: BaseException | None = None
        self._unsent = 0  # segments sealed in the worker, not yet handed to inner
        self._sent_waiters: list[asyncio.Future[None]] = []
        self._workers: dict[str, ThreadPoolExecutor] = {}
        self._pool = ReceivePool()

    def open(self, deliver: Deliver, *, on_failure: OnFailure | None = None) -> None:
        self._deliver = deliver
        self._on_failure = on_failure
        self.inner.open(self._arrive, on_failure=on_failure)

    def send_nowait(self, dest: int, msg: Message) -> None:
        if self._error is not None and msg.kind is not MessageKind.CONTROL:
            raise self._error  # control still goes out: a failed rank's error broadcast
        if not 0 <= dest < self.world_size:
            raise outside_world(self.rank, self.world_size, dest)
        seq = self._send_seq[dest]
        if seq >= MAX_SEQ:
            raise ProtocolError("too many messages to one rank in one session", rank=self.rank,
                                expected=f"< {MAX_SEQ}", got=seq, fix="start a new session")
        s = self._prepare(dest, seq, msg)
        if s.count == 1:
            self._seal(s, 0)
            self.inner.send_nowait(dest, s.message(0))
        else:
            self._unsent += s.count
            loop = asyncio.get_running_loop()
            if self.threads:
                self._worker("seal").submit(self._seal_all, loop, s)
            else:
                self._seal_next(loop, s, 0)
        self._send_seq[dest] = seq + 1  # only once sent: a gap would hold every later message

    async def wait_sent(self) -> None:
        while self._unsent and self._error is None:
            fut = asyncio.get_running_loop().create_future()
            self._sent_waiters.append(fut)
            await fut
        if self._error is not None:
            raise self._error
        await self.inner.wait_sent()

    async def close(self) -> None:
        try:
            await self.wait_sent()
        finally:
            for worker in self._workers.values():
                worker.shutdown(wait=False, cancel_futures=True)
            await self.inner.close()

    def _worker(self, name: str) -> ThreadPoolExecutor:
        """One thread per direction: segments of a message are sealed (opened) in order."""
        worker = self._workers.get(name)
        if worker is None:
            worker = self._workers[name] = ThreadPoolExecutor(
                1, thread_name_prefix=f"aioready-{name}-r{self.rank}")
        return worker

    def _buffer(self, nbytes: int) -> np.ndarray:
        """Large buffers are reused once nothing refers to them (fresh pages cost more than
        the cipher; receive_pool.py)."""
        return self._pool.take(nbytes) if nbytes >= self._pool.min_bytes else \
            np.empty(nbytes, np.uint8)

    def _fail(self, exc: BaseException) -> None:
        """An error found off the inner transport's path: fail the step, keep it for later
        calls (as the inner transports do)."""
        if not isinstance(exc, AioreadyError):
            exc = InternalError(f"sealing raised {type(exc).__name__}: {exc}", rank=self.rank)
        if self._error is None:
            self._error = exc
        waiters, self._sent_waiters = self._sent_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)
        if self._on_failure is not None:
            self._on_failure(exc)

    # -- sealing ---------------------------------------------------------------------------
    def _ad(self, msg: Message, src: int, dest: int, common: bytes) -> bytes:
        fixed = _FIXED.pack(HEADER_MAGIC, 1, int(msg.kind), msg.step, msg.stage,
                            msg.microbatch, msg.tag, 0)
        return fixed + _PAIR.pack(src, dest) + common

    def _prepare(self, dest: int, seq: int, msg: Message) -> _Sealing:
        tensors = [None if t is None else t.detach().cpu() for t in msg.tensors]
        desc = b"".join(encode_descriptor(spec_of(t)) for t in tensors)
        if len(tensors) > MAX_TENSORS:
            raise ProtocolError("too many tensors in one message", expected=f"<= {MAX_TENSORS}",
                                got=len(tensors))
        s = _Sealing()
        s.dest, s.msg, s.seq = dest, msg, seq
        s.plain = plaintext(tensors)
        s.total, s.seg = len(s.plain), self.segment_bytes
        s.count = max(1, -(-s.total // s.seg))
        if s.count > 1 << INDEX_BITS:
            raise ProtocolError("message too large to seal", rank=self.rank, expected=f"<= "
                                f"{1 << INDEX_BITS} segments of {s.seg} bytes", got=s.total)
        common = COMMON.pack(seq, len(desc), s.seg, s.count)
        s.ad = self._ad(msg, self.rank, dest, common + desc)
        s.prefix = (common, desc)
        s.head = align(PREFIX_BYTES + len(desc))
        s.stride = align(s.head + min(s.seg, s.total) + TAG_BYTES)
        s.out = self._buffer(s.stride * (s.count - 1) + s.head + s.seg_len(s.count - 1)
                             + TAG_BYTES)
        return s

    def _seal(self, s: _Sealing, index: int) -> None:
        """Seal segment `index` into its place in `s.out` (any thread)."""
        common, desc = s.prefix
        start = index * s.stride
        prefix = common + INDEX.pack(index) + desc
        out = s.out
        out[start:start + len(prefix)] = np.frombuffer(prefix, np.uint8)
        out[start + len(prefix):start + s.head] = 0
        lo = index * s.seg
        n = s.seg_len(index)
        self._aead.encrypt_into(_NONCE.pack(self.rank, s.dest, s.seq << INDEX_BITS | index),
                                s.plain[lo:lo + n], s.ad,
                                out[start + s.head:start + s.head + n + TAG_BYTES])

    def _seal_all(self, loop: asyncio.AbstractEventLoop, s: _Sealing) -> None:
        """In the seal worker: each segment, then its send on the loop."""
        try:
            for index in range(s.count):
                self._seal(s, index)
                loop.call_soon_threadsafe(self._send_segment, s, index)
        except BaseException as exc:  # noqa: BLE001 - reported on the loop, not lost here
            loop.call_soon_threadsafe(self._fail, exc)

    def _seal_next(self, loop: asyncio.AbstractEventLoop, s: _Sealing, index: int) -> None:
        """On the loop: one segment now, the next one on the loop's next pass, so the inner
        transport's progress runs between them (the transfer overlaps the sealing)."""
        if self._error is None:
            try:
                self._seal(s, index)
            except Exception as exc:  # noqa: BLE001 - the step fails with it
                self._fail(exc)
        self._send_segment(s, index)  # counted even after an error: wait_sent must end
        if index + 1 < s.count:
            loop.call_soon(self._seal_next, loop, s, index + 1)

    def _send_segment(self, s: _Sealing, index: int) -> None:
        self._unsent -= 1
        if self._error is None:
            try:
                self.inner.send_nowait(s.dest, s.message(index))
            except Exception as exc:  # noqa: BLE001 - the step fails with it
                self._fail(exc)
        if not self._unsent:
            waiters, self._sent_waiters = self._sent_waiters, []
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)

    # -- opening ---------------------------------------------------------------------------
    def _arrive(self, msg: Message) -> None:
        src = msg.source
        if src is None or not 0 <= src < self.world_size:
            raise ProtocolError("sealed message without a valid sender", rank=self.rank,
                                expected=f"a source in 0..{self.world_size - 1}", got=src)
        seg = parse(self.rank, src, msg)
        seq = seg.seq
        expected = self._next[src]
        if seq < expected or seq in self._held[src]:
            raise ProtocolError(f"message from rank {src} was replayed", rank=self.rank,
                                expected=f"sequence {expected} or later, once each",
                                got=f"sequence {seq} again ({msg.describe()})")
        if seq - expected > MAX_AHEAD:
            raise ProtocolError(f"message from rank {src} is too far ahead", rank=self.rank,
                                expected=f"sequence < {expected + MAX_AHEAD}", got=seq)
        if seg.count == 1:
            plain = self._buffer(seg.total)
            if not self._decrypt(src, msg, seg, plain):
                raise self._unauthentic(src, msg, seg)
            self._hold(src, seq, opened(msg, src, seg.specs, seg.sizes, plain))
            return
        opening = self._opening[src].get(seq)
        if opening is None:
            opening = self._opening[src][seq] = _Opening()
            opening.common, opening.specs, opening.sizes = seg.common, seg.specs, seg.sizes
            opening.plain, opening.seen, opening.left = self._buffer(seg.total), set(), seg.count
            opening.msg = msg
        elif opening.common != seg.common:
            raise ProtocolError(f"segments of one message from rank {src} disagree",
                                rank=self.rank, expected="one header for every segment",
                                got=f"another one at segment {seg.index} ({msg.describe()})")
        if seg.index in opening.seen:
            raise ProtocolError(f"message from rank {src} was replayed", rank=self.rank,
                                expected=f"segment {seg.index} of sequence {seq} once",
                                got="it again")
        opening.seen.add(seg.index)
        lo = seg.index * seg.seg
        part = opening.plain[lo:lo + seg.seg_len]
        if not self.threads:
            if not self._decrypt(src, msg, seg, part):
                raise self._unauthentic(src, msg, seg)
            self._segment_opened(src, seg, opening)
            return
        loop = asyncio.get_running_loop()
        done = loop.run_in_executor(self._worker("open"), self._decrypt, src, msg, seg, part)
        done.add_done_callback(lambda f: self._opened_in_worker(f, src, msg, seg, opening))

    def _decrypt(self, src: int, msg: Message, seg: Segment, plain: np.ndarray) -> bool:
        """Open one segment into `plain` (any thread); False if it fails its tag."""
        try:
            self._aead.decrypt_into(
                _NONCE.pack(src, self.rank, seg.seq << INDEX_BITS | seg.index), seg.body,
                self._ad(msg, src, self.rank, seg.common), plain)
        except self._invalid:
            return False
        return True

    def _unauthentic(self, src: int, msg: Message, seg: Segment) -> ProtocolError:
        where = f"segment {seg.index} of {seg.count} of " if seg.count > 1 else ""
        return ProtocolError(f"{where}message from rank {src} failed authentication: altered, "
                             "truncated, reordered, or sealed with another key or session",
                             rank=self.rank, expected=f"a valid tag (key {self.fingerprint})",
                             got=msg.describe())

    def _opened_in_worker(self, done: asyncio.Future[bool], src: int, msg: Message,
                          seg: Segment, opening: _Opening) -> None:
        if self._error is not None or done.cancelled():
            return
        try:
            if not done.result():
                raise self._unauthentic(src, msg, seg)
            self._segment_opened(src, seg, opening)
        except Exception as exc:  # noqa: BLE001 - the step fails with it
            self._fail(exc)

    def _segment_opened(self, src: int, seg: Segment, opening: _Opening) -> None:
        opening.left -= 1
        if opening.left == 0:
            del self._opening[src][seg.seq]
            self._hold(src, seg.seq, opened(opening.msg, src, opening.specs, opening.sizes,
                                             opening.plain))

    def _hold(self, src: int, seq: int, opened: Message) -> None:
        held = self._held[src]
        held[seq] = opened
        while self._next[src] in held:  # in the order they were sealed (see the module note)
            ready = held.pop(self._next[src])
            self._next[src] += 1
            assert self._deliver is not None
            self._deliver(ready)

    def __repr__(self) -> str:
        return f"<SecureTransport {self.cipher} key {self.fingerprint} over {self.inner!r}>"
