"""The key side of SecureTransport: the key file, its fingerprint, the per-run session and the
AEAD object derived from both (transports/secure.py seals with it)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import stat
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError

__all__ = ["load_key", "key_fingerprint", "secure_session", "make_aead", "CIPHERS", "KEY_BYTES"]

KEY_BYTES = 32
CIPHERS = ("aes-256-gcm", "chacha20-poly1305")
_INFO = b"aioready SecureTransport v2"  # v2: segmented messages


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


def make_aead(key: bytes, session: bytes, cipher: str) -> Any:
    """The cipher object for `key` under `session` (HKDF-SHA256: a fresh key per run)."""
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
