"""An ordered byte plane inside one process, over CPU tensors: NCCL's matching rule, no GPU.

`LoopbackHub(size).endpoint(rank)` gives each rank a `LoopbackPlane` (the BytePlane protocol of
transports/device_payloads.py). Per ordered pair of ranks, the k-th send matches the k-th
receive, as in NCCL; a send and a receive whose byte counts differ fail both with a
ProtocolError, where NCCL would hang or corrupt memory. Completions resolve on the loop (the
next iteration), so a test sees the same asynchrony as the CUDA events of the real plane. The
bytes are copied at send time (NCCL reads the buffer later, so the caller must keep it unchanged
until the send's future resolved either way).
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

from ..errors import ProtocolError

__all__ = ["LoopbackHub", "LoopbackPlane"]


class LoopbackHub:
    """The shared matching state of `size` endpoints."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._sends: dict[tuple[int, int], collections.deque[Any]] = collections.defaultdict(
            collections.deque)
        self._recvs: dict[tuple[int, int], collections.deque[Any]] = collections.defaultdict(
            collections.deque)
        self.num_matched = 0

    def endpoint(self, rank: int) -> "LoopbackPlane":
        return LoopbackPlane(self, rank)

    def post_send(self, src: int, dst: int, data: Any, fut: asyncio.Future[None]) -> None:
        self._sends[src, dst].append((data, fut))
        self._match(src, dst)

    def post_recv(self, src: int, dst: int, out: Any, fut: asyncio.Future[None]) -> None:
        self._recvs[src, dst].append((out, fut))
        self._match(src, dst)

    def _match(self, src: int, dst: int) -> None:
        sends, recvs = self._sends[src, dst], self._recvs[src, dst]
        while sends and recvs:
            (data, sent), (out, arrived) = sends.popleft(), recvs.popleft()
            if data.numel() != out.numel():
                exc = ProtocolError(f"transfer {src} -> {dst} matched a receive of another size",
                                    rank=dst, expected=f"{out.numel()} bytes",
                                    got=f"{data.numel()} bytes")
                _settle(sent, exc)
                _settle(arrived, exc)
                continue
            out.copy_(data)
            self.num_matched += 1
            _settle(sent, None)
            _settle(arrived, None)

    def num_pending(self) -> int:
        return sum(map(len, self._sends.values())) + sum(map(len, self._recvs.values()))


def _settle(fut: asyncio.Future[None], exc: BaseException | None) -> None:
    def settle() -> None:
        if fut.done():
            return
        if exc is None:
            fut.set_result(None)
        else:
            fut.set_exception(exc)
    fut.get_loop().call_soon(settle)


class LoopbackPlane:
    """One rank's end of a LoopbackHub: the BytePlane protocol on the CPU."""

    def __init__(self, hub: LoopbackHub, rank: int) -> None:
        import torch
        self._torch = torch
        self.hub = hub
        self.rank = rank
        self.device = torch.device("cpu")

    def send(self, dest: int, t: Any) -> asyncio.Future[None]:
        fut = asyncio.get_running_loop().create_future()
        data = t.detach().contiguous().reshape(-1).view(self._torch.uint8).clone()
        self.hub.post_send(self.rank, dest, data, fut)
        return fut

    def recv(self, src: int, nbytes: int) -> tuple[Any, asyncio.Future[None]]:
        fut = asyncio.get_running_loop().create_future()
        out = self._torch.empty(nbytes, dtype=self._torch.uint8)
        self.hub.post_recv(src, self.rank, out, fut)
        return out, fut
