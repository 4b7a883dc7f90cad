"""Payloads of CUDA tensors over an ordered byte plane (NCCL), headers over MPI.

The framing of docs/async.md "The GPU data plane": a message's header (dtype and shape of every
tensor) travels over MPI exactly as before, its tag flagged (transports/ordered.py); then each
non-empty tensor is one transfer of its bytes on the plane, in slot order. The receiver posts
those transfers when the header is released in the peer's send order, into tensors of the
advertised dtype and shape (which may differ per microbatch). Nothing is tagged on the plane,
nothing is probed: matching is by order alone, which is all NCCL offers.

A `BytePlane` is the whole surface the framing needs. cuda/nccl.py's NcclPlane implements it
with one-way NCCL communicators; aioready.testing.loopback's LoopbackPlane implements it in one
process over CPU tensors with NCCL's matching rule (order, and counts that must agree), so the
framing is tested without a GPU and without pretending to be NCCL.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from ..errors import ProtocolError
from .tensor_bytes import torch_module

__all__ = ["BytePlane", "send_payloads", "receive_payloads"]


class BytePlane(Protocol):
    """Ordered point-to-point bytes: per peer, the k-th send matches the k-th receive."""

    device: Any

    def send(self, dest: int, t: Any) -> asyncio.Future[None]:
        """Send the bytes of `t`; resolves once the buffer may be reused."""

    def recv(self, src: int, nbytes: int) -> tuple[Any, asyncio.Future[None]]:
        """A uint8 tensor of `nbytes` on `device`, and the future of its arrival."""


def send_payloads(plane: BytePlane, dest: int, tensors: tuple[Any, ...], sizes: list[int], *,
                  rank: int | None = None) -> list[asyncio.Future[None]]:
    """One transfer per non-empty tensor, in slot order; their completions. Every tensor is
    checked before the first transfer is posted: a half-sent message would leave the peer's
    receives unmatched."""
    device_type = getattr(plane.device, "type", "cpu")
    payloads = [t for t, n in zip(tensors, sizes) if n]
    for t in payloads:
        if t.device.type != device_type:
            raise ProtocolError("a message mixes tensors of the data plane's device and others",
                                rank=rank, expected=f"every tensor on {device_type}",
                                got=str(t.device), fix="move the stage's outputs to one device")
    return [plane.send(dest, t) for t in payloads]


def receive_payloads(plane: BytePlane, src: int, specs: list[Any], dtypes: list[Any],
                     sizes: list[int]) -> tuple[list[Any], list[asyncio.Future[None]]]:
    """Post one receive per non-empty tensor of a header's layout, in slot order.

    Returns the tensors (None slots stay None; empty ones are made at once) and the futures of
    the posted receives; the tensors hold their values once every future resolved.
    """
    torch = torch_module()
    tensors: list[Any] = []
    futures = []
    for spec, dtype, n in zip(specs, dtypes, sizes):
        if dtype is None:
            tensors.append(None)
        elif not n:
            tensors.append(torch.empty(spec.shape, dtype=dtype, device=plane.device))
        else:
            raw, fut = plane.recv(src, n)
            tensors.append(raw.view(dtype).reshape(spec.shape))
            futures.append(fut)
    return tensors, futures
