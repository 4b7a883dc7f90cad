"""Transports: how messages move between ranks. `inproc` always; `mpi` needs the mpi extra;
`torchdist` (torch.distributed: gloo, NCCL; jobs launched by torchrun) needs only torch.
`native` is the MPI transport's optional compiled helper (its build and loader), `mpi_native`
the transport's hooks into it."""

from __future__ import annotations

from typing import Any

from .base import Message, MessageKind, Transport
from .inproc import InprocTransport, InprocWorld

__all__ = ["Transport", "Message", "MessageKind", "InprocWorld", "InprocTransport",
           "MPITransport", "TorchDistTransport"]


def __getattr__(name: str) -> Any:
    if name == "MPITransport":
        try:
            from .mpi import MPITransport
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise ImportError(
                f"MPITransport needs mpi4py: pip install 'aioready[mpi]' ({exc})") from exc
        return MPITransport
    if name == "TorchDistTransport":
        from .torchdist import TorchDistTransport
        return TorchDistTransport
    raise AttributeError(name)
