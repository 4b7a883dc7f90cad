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
- Overlap: a message of several segments is sealed segment by segment in a worker thread
  (the cipher releases the GIL), each segment handed to `inner` as soon as it is sealed, and
  opened segment by segment in another worker as they arrive, so the cipher runs while the
  rest of the message is on the wire and the loop stays free to drive the transfer. A
  one-segment message is sealed and opened on the loop thread (a thread hop costs more).
  Ciphertext and plaintext go straight into reused buffers (receive_pool.py): no extra copy
  of a contiguous tensor. bench/secure.py measures the cost against plain.

Received tensors are CPU tensors viewing the decrypted buffer. The tensors given to
`send_nowait` must not change until `wait_sent` returns (as for every transport).
"""

from __future__ import annotations

import asyncio
import struct
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ..errors import AioreadyError, ConfigError, InternalError, ProtocolError
from .base import Deliver, Message, MessageKind, OnFailure, Transport
from .header import (
    _FIXED,
    DTYPE_SIZES,
    HEADER_MAGIC,
    MAX_NDIM,
    MAX_TENSORS,
    decode_header,
    encode_descriptor,
)
from .receive_pool import ReceivePool
from .secure_key import CIPHERS, KEY_BYTES, key_fingerprint, load_key, make_aead, secure_session
from .tensor_bytes import from_bytes, host_bytes, spec_of, torch_module

__all__ = ["SecureTransport", "load_key", "key_fingerprint", "secure_session", "CIPHERS",
           "KEY_BYTES", "MAX_AHEAD", "SEGMENT_BYTES"]

TAG_BYTES = 16
MAX_AHEAD = 4096  # messages of one sender held while an earlier one is still on its way
SEGMENT_BYTES = 1 << 20  # bench/secure.py: small enough to overlap, large enough to amortize
_COMMON = struct.Struct("<QIII")  # seq, descriptor length, segment bytes, count
_INDEX = struct.Struct("<I")
_PREFIX_BYTES = _COMMON.size + _INDEX.size
_PAIR = struct.Struct("<HH")  # sender, receiver
_NONCE = struct.Struct("<HHQ")  # sender, receiver, seq << _INDEX_BITS | index
_INDEX_BITS = 24
_MAX_SEQ = 1 << (64 - _INDEX_BITS)
_MAX_DESC = MAX_TENSORS * (2 + 8 * MAX_NDIM)


def _align(n: int) -> int:
    return (n + 15) // 16 * 16


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


class SecureTransport:
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
        self.inner = inner
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

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def world_size(self) -> int:
        return self.inner.world_size

    def open(self, deliver: Deliver, *, on_failure: OnFailure | None = None) -> None:
        self._deliver = deliver
        self._on_failure = on_failure
        self.inner.open(self._arrive, on_failure=on_failure)

    def send_nowait(self, dest: int, msg: Message) -> None:
        if self._error is not None and msg.kind is not MessageKind.CONTROL:
            raise self._error  # control still goes out: a failed rank's error broadcast
        if not 0 <= dest < self.world_size:
            raise ProtocolError("send to a rank outside the world", rank=self.rank,
                                expected=f"0..{self.world_size - 1}", got=dest)
        seq = self._send_seq[dest]
        if seq >= _MAX_SEQ:
            raise ProtocolError("too many messages to one rank in one session", rank=self.rank,
                                expected=f"< {_MAX_SEQ}", got=seq, fix="start a new session")
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
        s.plain = _plaintext(tensors)
        s.total, s.seg = len(s.plain), self.segment_bytes
        s.count = max(1, -(-s.total // s.seg))
        common = _COMMON.pack(seq, len(desc), s.seg, s.count)
        s.ad = self._ad(msg, self.rank, dest, common + desc)
        s.prefix = (common, desc)
        s.head = _align(_PREFIX_BYTES + len(desc))
        s.stride = _align(s.head + min(s.seg, s.total) + TAG_BYTES)
        s.out = self._buffer(s.stride * (s.count - 1) + s.head + s.seg_len(s.count - 1)
                             + TAG_BYTES)
        return s

    def _seal(self, s: _Sealing, index: int) -> None:
        """Seal segment `index` into its place in `s.out` (any thread)."""
        common, desc = s.prefix
        start = index * s.stride
        prefix = common + _INDEX.pack(index) + desc
        out = s.out
        out[start:start + len(prefix)] = np.frombuffer(prefix, np.uint8)
        out[start + len(prefix):start + s.head] = 0
        lo = index * s.seg
        n = s.seg_len(index)
        self._aead.encrypt_into(_NONCE.pack(self.rank, s.dest, s.seq << _INDEX_BITS | index),
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
        seg = _parse(self.rank, src, msg)
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
            self._hold(src, seq, _opened(msg, src, seg.specs, seg.sizes, plain))
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

    def _decrypt(self, src: int, msg: Message, seg: "_Segment", plain: np.ndarray) -> bool:
        """Open one segment into `plain` (any thread); False if it fails its tag."""
        try:
            self._aead.decrypt_into(
                _NONCE.pack(src, self.rank, seg.seq << _INDEX_BITS | seg.index), seg.body,
                self._ad(msg, src, self.rank, seg.common), plain)
        except self._invalid:
            return False
        return True

    def _unauthentic(self, src: int, msg: Message, seg: "_Segment") -> ProtocolError:
        where = f"segment {seg.index} of {seg.count} of " if seg.count > 1 else ""
        return ProtocolError(f"{where}message from rank {src} failed authentication: altered, "
                             "truncated, reordered, or sealed with another key or session",
                             rank=self.rank, expected=f"a valid tag (key {self.fingerprint})",
                             got=msg.describe())

    def _opened_in_worker(self, done: asyncio.Future[bool], src: int, msg: Message,
                          seg: "_Segment", opening: _Opening) -> None:
        if self._error is not None or done.cancelled():
            return
        try:
            if not done.result():
                raise self._unauthentic(src, msg, seg)
            self._segment_opened(src, seg, opening)
        except Exception as exc:  # noqa: BLE001 - the step fails with it
            self._fail(exc)

    def _segment_opened(self, src: int, seg: "_Segment", opening: _Opening) -> None:
        opening.left -= 1
        if opening.left == 0:
            del self._opening[src][seg.seq]
            self._hold(src, seg.seq, _opened(opening.msg, src, opening.specs, opening.sizes,
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


class _Segment:
    """One received segment's prefix, checked against its own length (not yet authentic)."""

    __slots__ = ("seq", "seg", "count", "index", "common", "specs", "sizes", "total",
                 "seg_len", "body")


def _parse(rank: int, src: int, msg: Message) -> _Segment:
    where = f"message from rank {src}"
    blob = msg.tensors[0] if len(msg.tensors) == 1 else None
    if blob is None or str(getattr(blob, "dtype", "")) != "torch.uint8" or blob.dim() != 1 \
            or blob.numel() < _PREFIX_BYTES + TAG_BYTES:
        raise ProtocolError(f"{where} is not sealed", rank=rank, expected="one sealed uint8 "
                            "payload (both ends need the same key)", got=msg.describe())
    buf = (blob.cpu() if blob.is_cuda else blob).numpy()
    seq, dlen, seg_bytes, count = _COMMON.unpack_from(buf, 0)
    (index,) = _INDEX.unpack_from(buf, _COMMON.size)
    head = _align(_PREFIX_BYTES + dlen)
    if dlen > _MAX_DESC or head + TAG_BYTES > len(buf):
        raise ProtocolError(f"{where} has a bad sealed prefix", rank=rank,
                            expected=f"descriptors of <= {_MAX_DESC} bytes", got=dlen)
    s = _Segment()
    desc = bytes(buf[_PREFIX_BYTES:_PREFIX_BYTES + dlen])
    s.seq, s.seg, s.count, s.index = seq, seg_bytes, count, index
    s.common = bytes(buf[:_COMMON.size]) + desc
    s.specs = _specs(desc, src, msg)
    s.sizes = [0 if sp.dtype is None else _nbytes(sp) for sp in s.specs]
    s.total = _layout_len(s.sizes)
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


def _opened(msg: Message, src: int, specs: list[Any], sizes: list[int],
            plain: np.ndarray) -> Message:
    tensors, off = [], 0
    for spec, n in zip(specs, sizes):
        if spec.dtype is None:
            tensors.append(None)
            continue
        tensors.append(from_bytes(plain[off:off + n], spec.dtype, spec.shape) if n else
                       torch_module().empty(spec.shape, dtype=_dtype(spec.dtype)))
        off += _align(n)
    return Message(msg.step, msg.kind, msg.stage, msg.microbatch, tuple(tensors), msg.tag, src)


def _plaintext(tensors: list[Any]) -> Any:
    """The tensors' bytes, each at a 16-byte aligned offset; one contiguous tensor: no copy."""
    present = [t for t in tensors if t is not None and t.numel()]
    if len(present) == 1 and len(tensors) == 1:
        return host_bytes(present[0])
    sizes = [0 if t is None else t.nbytes for t in tensors]
    out = np.zeros(_layout_len(sizes), np.uint8)
    off = 0
    for t, n in zip(tensors, sizes):
        if n:
            out[off:off + n] = host_bytes(t)
            off += _align(n)
    return out


def _layout_len(sizes: list[int]) -> int:
    nonzero = [n for n in sizes if n]
    if len(nonzero) == 1 and len(sizes) == 1:
        return nonzero[0]
    return sum(_align(n) for n in nonzero)


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

