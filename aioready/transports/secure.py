"""SecureTransport: authenticated encryption of every message, around any Transport.

`SecureTransport(inner, key=..., session=...)` seals each message before `inner` sends it and
opens it before the runtime sees it, so activations and gradients crossing a network can be
neither read nor altered by someone on it. The sealed message keeps the original step, kind,
stage, microbatch and tag (the inner transport routes on them) and carries one uint8 tensor:

    seq (8 bytes) | descriptor length (4) | descriptors (dtype, shape; header.py) | pad to 16
    | ciphertext of the tensors' bytes (each at a 16-byte aligned offset) | tag (16)

- AEAD: AES-256-GCM (default) or ChaCha20-Poly1305, from the `cryptography` package. The
  associated data is the header: those fields, the sender, the receiver, seq and the
  descriptors, so changing any of them fails the tag; the payload is encrypted.
- Nonce: (sender, receiver, seq), 2 + 2 + 8 bytes, seq counting the messages of that ordered
  pair from 0. It never repeats under one key: the key used is derived (HKDF-SHA256) from the
  key file's key and a `session` value that is fresh for every run (`secure_session(comm)`:
  every rank contributes 16 random bytes, so no rank reuses a nonce even if others' parts were
  tampered with; a mismatch only makes messages fail, it cannot make old ones pass).
- Order: the receiver expects seq 0, 1, 2, ... from each sender. A message that fails its tag
  (altered, truncated, another key or session), one whose seq was already delivered (a
  replay), one not sealed at all, or one too far ahead is a ProtocolError naming the sender.
  Messages that the inner transport legitimately delivers out of order (a small one overtaking
  a large one) are held and delivered in the order they were sealed, so a reordering on the
  network changes nothing the runtime sees.
- The key comes from a file readable only by its owner (`load_key` checks the mode bits and
  the owner), never from the network; `AIOREADY_KEY_FILE` names it for `aioready train`.
  `key_fingerprint` identifies a key in run records without revealing it.

Received tensors are CPU tensors viewing the decrypted buffer. Cost: one AEAD pass over the
payload on each side, done on the loop thread (bench/secure.py measures it against plain).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import stat
import struct
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError, ProtocolError
from .base import Deliver, Message, OnFailure, Transport
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
from .tensor_bytes import from_bytes, host_bytes, spec_of, torch_module

__all__ = ["SecureTransport", "load_key", "key_fingerprint", "secure_session", "CIPHERS",
           "KEY_BYTES", "MAX_AHEAD"]

KEY_BYTES = 32
TAG_BYTES = 16
CIPHERS = ("aes-256-gcm", "chacha20-poly1305")
MAX_AHEAD = 4096  # messages of one sender held while an earlier one is still on its way
_PREFIX = struct.Struct("<QI")  # seq, descriptor length
_NONCE = struct.Struct("<HHQ")  # sender, receiver, seq
_MAX_DESC = MAX_TENSORS * (2 + 8 * MAX_NDIM)
_INFO = b"aioready SecureTransport v1"


def _align(n: int) -> int:
    return (n + 15) // 16 * 16


def load_key(path: str | os.PathLike[str]) -> bytes:
    """The 32-byte key in `path` (raw, or 64 hex digits); refused unless only its owner (this
    user) can read it, so a key readable by others is never used."""
    p = Path(path)
    try:
        st = p.stat()
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read the key file {p}", expected="a readable file",
                          got=f"{type(exc).__name__}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"key file {p} is not a regular file", expected="a file",
                          got=stat.filemode(st.st_mode))
    if st.st_mode & 0o077 or (hasattr(os, "getuid") and st.st_uid != os.getuid()):
        raise ConfigError(f"key file {p} is readable by others", expected="mode 600 (or 400), "
                          "owned by this user", got=f"{stat.filemode(st.st_mode)} uid {st.st_uid}",
                          fix=f"chmod 600 {p}")
    text = raw.strip()
    if len(text) == 2 * KEY_BYTES:
        try:
            return bytes.fromhex(text.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            pass
    if len(raw) == KEY_BYTES:
        return raw
    raise ConfigError(f"key file {p} does not hold a key", expected=f"{KEY_BYTES} raw bytes or "
                      f"{2 * KEY_BYTES} hex digits", got=f"{len(raw)} bytes",
                      fix=f"python -c \"import os; print(os.urandom({KEY_BYTES}).hex())\" > {p}")


def key_fingerprint(key: bytes) -> str:
    """16 hex digits that name a key in logs and run records without revealing it."""
    return hashlib.sha256(b"aioready key fingerprint\0" + key).hexdigest()[:16]


async def secure_session(comm: Any) -> bytes:
    """A fresh session value all ranks of `comm` agree on: each contributes 16 random bytes
    (a nonblocking allgather, polled so the loop keeps running), all are hashed."""
    mine = np.frombuffer(os.urandom(16), np.uint8).copy()
    every = np.zeros(16 * comm.Get_size(), np.uint8)
    request = comm.Iallgather(mine, every)
    delay = 0.0
    while not request.Test():
        await asyncio.sleep(delay)
        delay = min(2 * delay + 1e-5, 2e-3)
    return hashlib.sha256(every.tobytes()).digest()


def _aead(key: bytes, session: bytes, cipher: str) -> Any:
    try:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    except ImportError:
        raise ConfigError("SecureTransport needs the cryptography package", expected="it "
                          "installed", got="not importable",
                          fix="pip install 'aioready[secure]'") from None
    if cipher not in CIPHERS:
        raise ConfigError("unknown cipher", expected=" | ".join(CIPHERS), got=repr(cipher))
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ConfigError("the key must be 32 bytes", expected=f"{KEY_BYTES} bytes (load_key)",
                          got=f"{len(key)} bytes" if isinstance(key, bytes) else type(key))
    if not isinstance(session, bytes) or not session:
        raise ConfigError("session must be fresh bytes shared by the ranks of this run",
                          expected="secure_session(comm), or os.urandom(16) in one process",
                          got=repr(session)[:40])
    derived = HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=session,
                   info=_INFO).derive(key)
    return (AESGCM if cipher == "aes-256-gcm" else ChaCha20Poly1305)(derived)


class SecureTransport:
    """Any Transport, with every message sealed by an AEAD cipher (see the module note)."""

    def __init__(self, inner: Transport, *, key: bytes, session: bytes,
                 cipher: str = "aes-256-gcm") -> None:
        self._aead = _aead(key, session, cipher)
        from cryptography.exceptions import InvalidTag
        self._invalid = InvalidTag
        if inner.world_size > 1 << 16:
            raise ConfigError("too many ranks to seal", expected="<= 65536",
                              got=inner.world_size)
        self.inner = inner
        self.cipher = cipher
        self.fingerprint = key_fingerprint(key)
        self._send_seq = [0] * inner.world_size
        self._next = [0] * inner.world_size
        self._held: list[dict[int, Message]] = [{} for _ in range(inner.world_size)]
        self._deliver: Deliver | None = None
        self._pool = ReceivePool()

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def world_size(self) -> int:
        return self.inner.world_size

    def open(self, deliver: Deliver, *, on_failure: OnFailure | None = None) -> None:
        self._deliver = deliver
        self.inner.open(self._arrive, on_failure=on_failure)

    def send_nowait(self, dest: int, msg: Message) -> None:
        if not 0 <= dest < self.world_size:
            raise ProtocolError("send to a rank outside the world", rank=self.rank,
                                expected=f"0..{self.world_size - 1}", got=dest)
        seq = self._send_seq[dest]
        self.inner.send_nowait(dest, self._seal(dest, seq, msg))
        self._send_seq[dest] = seq + 1  # only once sent: a gap would hold every later message

    async def wait_sent(self) -> None:
        await self.inner.wait_sent()

    async def close(self) -> None:
        await self.inner.close()

    def _buffer(self, nbytes: int) -> np.ndarray:
        """Large buffers are reused once nothing refers to them (fresh pages cost more than
        the cipher; receive_pool.py)."""
        return self._pool.take(nbytes) if nbytes >= self._pool.min_bytes else \
            np.empty(nbytes, np.uint8)

    # -- sealing ---------------------------------------------------------------------------
    def _ad(self, msg: Message, src: int, dest: int, prefix: bytes) -> bytes:
        fixed = _FIXED.pack(HEADER_MAGIC, 1, int(msg.kind), msg.step, msg.stage,
                            msg.microbatch, msg.tag, 0)
        return fixed + _NONCE.pack(src, dest, 0) + prefix

    def _seal(self, dest: int, seq: int, msg: Message) -> Message:
        torch = torch_module()
        tensors = [None if t is None else t.detach().cpu() for t in msg.tensors]
        desc = b"".join(encode_descriptor(spec_of(t)) for t in tensors)
        if len(tensors) > MAX_TENSORS:
            raise ProtocolError("too many tensors in one message", expected=f"<= {MAX_TENSORS}",
                                got=len(tensors))
        prefix = _PREFIX.pack(seq, len(desc)) + desc
        plain = _plaintext(tensors)
        head = _align(len(prefix))
        out = self._buffer(head + len(plain) + TAG_BYTES)
        blob = torch.from_numpy(out)
        out[:len(prefix)] = np.frombuffer(prefix, np.uint8)
        out[len(prefix):head] = 0
        self._aead.encrypt_into(_NONCE.pack(self.rank, dest, seq), plain,
                                self._ad(msg, self.rank, dest, prefix), out[head:])
        return Message(msg.step, msg.kind, msg.stage, msg.microbatch, (blob,), msg.tag)

    # -- opening ---------------------------------------------------------------------------
    def _arrive(self, msg: Message) -> None:
        src = msg.source
        if src is None or not 0 <= src < self.world_size:
            raise ProtocolError("sealed message without a valid sender", rank=self.rank,
                                expected=f"a source in 0..{self.world_size - 1}", got=src)
        seq, opened = self._open(src, msg)
        expected = self._next[src]
        held = self._held[src]
        if seq < expected or seq in held:
            raise ProtocolError(f"message from rank {src} was replayed", rank=self.rank,
                                expected=f"sequence {expected} or later, once each",
                                got=f"sequence {seq} again ({msg.describe()})")
        if seq - expected > MAX_AHEAD:
            raise ProtocolError(f"message from rank {src} is too far ahead", rank=self.rank,
                                expected=f"sequence < {expected + MAX_AHEAD}", got=seq)
        held[seq] = opened
        while self._next[src] in held:  # in the order they were sealed (see the module note)
            ready = held.pop(self._next[src])
            self._next[src] += 1
            assert self._deliver is not None
            self._deliver(ready)

    def _open(self, src: int, msg: Message) -> tuple[int, Message]:
        where = f"message from rank {src}"
        blob = msg.tensors[0] if len(msg.tensors) == 1 else None
        if blob is None or str(getattr(blob, "dtype", "")) != "torch.uint8" or blob.dim() != 1 \
                or blob.numel() < _PREFIX.size + TAG_BYTES:
            raise ProtocolError(f"{where} is not sealed", rank=self.rank, expected="one "
                                "sealed uint8 payload (both ends need the same key)",
                                got=msg.describe())
        buf = (blob.cpu() if blob.is_cuda else blob).numpy()
        seq, dlen = _PREFIX.unpack_from(buf, 0)
        head = _align(_PREFIX.size + dlen)
        if dlen > _MAX_DESC or head + TAG_BYTES > len(buf):
            raise ProtocolError(f"{where} has a bad sealed prefix", rank=self.rank,
                                expected=f"descriptors of <= {_MAX_DESC} bytes", got=dlen)
        prefix = bytes(buf[:_PREFIX.size + dlen])
        desc = prefix[_PREFIX.size:]
        specs = _specs(desc, src, msg)
        sizes = [0 if s.dtype is None else _nbytes(s) for s in specs]
        total = _layout_len(sizes)
        if head + total + TAG_BYTES != len(buf):
            raise ProtocolError(f"{where} was truncated or padded", rank=self.rank,
                                expected=f"{head + total + TAG_BYTES} bytes", got=len(buf))
        plain = self._buffer(total)
        try:
            self._aead.decrypt_into(_NONCE.pack(src, self.rank, seq), buf[head:],
                                    self._ad(msg, src, self.rank, prefix), plain)
        except self._invalid:
            raise ProtocolError(f"{where} failed authentication: altered, truncated, or sealed "
                                "with another key or session", rank=self.rank,
                                expected=f"a valid tag (key {self.fingerprint})",
                                got=msg.describe()) from None
        tensors, off = [], 0
        for spec, n in zip(specs, sizes):
            if spec.dtype is None:
                tensors.append(None)
                continue
            tensors.append(from_bytes(plain[off:off + n], spec.dtype, spec.shape) if n else
                           torch_module().empty(spec.shape, dtype=_dtype(spec.dtype)))
            off += _align(n)
        return seq, Message(msg.step, msg.kind, msg.stage, msg.microbatch, tuple(tensors),
                            msg.tag, src)

    def __repr__(self) -> str:
        return f"<SecureTransport {self.cipher} key {self.fingerprint} over {self.inner!r}>"


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
