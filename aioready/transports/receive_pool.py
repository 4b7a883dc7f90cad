"""Reusable host buffers for large received payloads.

A fresh 64 MiB tensor per message costs more than its transfer: torch's CPU allocator maps new
pages for every large allocation and the copy then faults each of them in (bench/transport.py
measured 55 ms per 64 MiB message into fresh torch memory against 10 ms into a reused buffer).
A pipeline receives the same few shapes every microbatch, so the transport keeps the buffers it
handed out and reuses one once nothing refers to it any more.

"Nothing refers to it" is exact, not a guess: the received tensor is made with
`torch.from_numpy` over a numpy array the pool owns, and torch keeps a reference to that array
for as long as any tensor or view uses the storage. When the pool's own reference is the only
one left (`sys.getrefcount`), no tensor can see the bytes and MPI may write into them again.
Buffers are numpy allocations, which also ask the kernel for huge pages on large sizes.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from .tensor_bytes import from_bytes

__all__ = ["ReceivePool"]

_FREE_REFS = 3  # the pool's list slot, the loop variable, getrefcount's argument


class ReceivePool:
    """Buffers of at least `min_bytes`, at most `max_bytes` kept in all (oldest dropped first)."""

    def __init__(self, min_bytes: int = 1 << 20, max_bytes: int = 512 << 20) -> None:
        self.min_bytes = min_bytes
        self.max_bytes = max_bytes
        self._buffers: list[np.ndarray] = []
        self._held = 0
        self.num_reused = self.num_allocated = 0

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 buffer of exactly `nbytes` that no live tensor views."""
        buffers = self._buffers
        for i in range(len(buffers) - 1, -1, -1):  # newest first: its bytes may still be in cache
            buf = buffers[i]  # (by index: enumerate's cached tuple would hold a reference)
            if buf.nbytes == nbytes and sys.getrefcount(buf) <= _FREE_REFS:
                del buffers[i]  # by position: == on arrays compares elements
                buffers.append(buf)  # most recently used last
                self.num_reused += 1
                return buf
        buf = np.empty(nbytes, np.uint8)
        self.num_allocated += 1
        if nbytes <= self.max_bytes:
            self._buffers.append(buf)
            self._held += nbytes
            while self._held > self.max_bytes:
                self._held -= self._buffers.pop(0).nbytes  # in use elsewhere: only forgotten
        return buf

    def tensor(self, shape: tuple[int, ...], dtype: str, nbytes: int) -> Any:
        """A CPU tensor of `shape` and `dtype` (a wire dtype name) over a pooled buffer
        (`nbytes` = its size)."""
        return from_bytes(self.take(nbytes), dtype, shape)

    @property
    def held_bytes(self) -> int:
        return self._held
