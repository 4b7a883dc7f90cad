"""CUDA payloads through a torch.distributed group that has no CUDA backend (gloo alone).

Two ranks that share one GPU cannot use NCCL (it refuses duplicate GPUs), and a job may init
gloo only; their CUDA tensors then cross the host. Each CUDA payload is copied into a pooled
pinned buffer on a copy stream of its own, after an event recorded on the producer's (current)
stream, and handed to gloo only once that copy's event completed (awaited through the completion
engine: cuda/mpi.py's HostStager, the same staging as the MPI transport without CUDA-aware
MPI). The loop thread never waits for the GPU.

Order matters: gloo matches a peer's payload transfers of one tag in posting order, and the
receiver posts them in header order. So a peer with staged payloads in flight has a FIFO: every
later payload to it (staged or not) queues behind them and goes out in order as the copies
complete. The receiver gets host tensors (the header does not carry the device flag); a
transport made with `device="cuda"` moves them to the device.
"""

from __future__ import annotations

import collections
from functools import partial
from typing import Any, Callable

from ..cuda.mpi import HostStager
from .tensor_bytes import torch_module

__all__ = ["StagedSends"]

Send = Callable[[int, Any, "Callable[[], None] | None"], None]


class StagedSends:
    """Per-peer FIFOs of payloads that wait for a CUDA copy to host; see the module docstring.

    `send(dest, buf, release)` posts a host buffer to gloo (and calls `release` once gloo is
    done with it); `fail(exc)` reports a CUDA fault.
    """

    def __init__(self, send: Send, fail: Callable[[BaseException], None]) -> None:
        self._send = send
        self._fail = fail
        self._stagers: dict[Any, HostStager] = {}
        self._fifos: dict[int, collections.deque[list[Any]]] = {}

    def busy(self, dest: int) -> bool:
        """Whether payloads to `dest` must queue behind staged ones."""
        return bool(self._fifos.get(dest))

    def push(self, dest: int, t: Any) -> None:
        """Send the payload `t` (CUDA: staged; host: a uint8 tensor) after the queued ones."""
        fifo = self._fifos.setdefault(dest, collections.deque())
        if not t.is_cuda:
            fifo.append([t, None, True])
            return
        t = t.detach().contiguous()
        stager = self._stager(t.device)
        host, done = stager.to_host(t, self._ready(t))
        entry = [host.reshape(-1).view(torch_module().uint8), partial(stager.release, host),
                 False]
        fifo.append(entry)
        stager.completion(done).add_done_callback(partial(self._copied, dest, entry))

    @staticmethod
    def _ready(t: Any) -> Any:
        """An event after whatever the loop thread enqueued on `t`'s stream: its producer."""
        cuda = torch_module().cuda
        ready = cuda.Event()
        ready.record(cuda.current_stream(t.device))
        return ready

    def _copied(self, dest: int, entry: list[Any], fut: Any) -> None:
        try:
            fut.result()
        except BaseException as exc:  # a CUDA fault: fail the step, as a transfer error would
            self._fifos.pop(dest, None)
            self._fail(exc)
            return
        entry[2] = True
        fifo = self._fifos.get(dest)
        while fifo and fifo[0][2]:
            buf, release, _ = fifo.popleft()
            self._send(dest, buf, release)

    def _stager(self, device: Any) -> HostStager:
        stager = self._stagers.get(device)
        if stager is None:
            stager = self._stagers[device] = HostStager(device)
        return stager

    def close(self) -> None:
        for stager in self._stagers.values():
            stager.close()
        self._stagers.clear()
