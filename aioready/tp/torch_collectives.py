"""Tagged TP collectives over a torch.distributed group: gloo for CPU tensors, NCCL for CUDA.

The same contract as tp/collectives.py (Note [tagged collectives]): each all-reduce carries the
task that issues it, checked by `verify` ("exchange": an all-gather of the tags first; "inline":
the key k and k*k summed in front of the buffer; "off"), and a wait has a deadline, so a mismatch
is a CoordinationError naming the tasks, never a hang or a silent sum of two microbatches.

The difference is the data: `allreduce_tensor_(t)` sums a torch tensor in place where it lives,
so tensor parallelism runs on GPUs (NCCL all-reduce of CUDA tensors, no trip through numpy);
`allreduce_` keeps the numpy surface of `TPComm` for CPU callers. As in the MPI version the call
runs in the compute thread, and "blocking" is an async collective polled with `is_completed()`
(which, unlike gloo's point-to-point Works, collectives answer) under a backoff. For CUDA
tensors NCCL enqueues the sum on its own stream ordered after the current one, and the wait
only returns once it completed, so the caller may read the result at once. The tag exchange
travels as a CPU int64 tensor (gloo) where the group has a CPU backend, else on the device.

This is also the interface the data-parallel gradient reduction can use under torchrun: one
`TorchTPComm` over the DP group, `allreduce_tensor_` per bucket, tagged with the step.
"""

from __future__ import annotations

import time
import zlib
from typing import Any

import numpy as np

from ..errors import ConfigError, CoordinationError
from ..transports.torch_groups import cpu_backend
from .collectives import DEFAULT_TIMEOUT, _tag_text, _Tagged

__all__ = ["TorchTPComm"]


class TorchTPComm(_Tagged):
    """A TP group over a torch.distributed process group (its ranks are the TP ranks)."""

    def __init__(self, group: Any = None, *, verify: str = "exchange",
                 timeout: float = DEFAULT_TIMEOUT) -> None:
        import torch
        import torch.distributed as dist
        self._torch = torch
        self._dist = dist
        self.group = group
        super().__init__(dist.get_rank(group), dist.get_world_size(group), verify=verify,
                         timeout=timeout)

    def allreduce_(self, array: np.ndarray) -> None:
        """Sum a C-contiguous numpy array over the group, in place (the TPComm surface)."""
        if not array.flags.c_contiguous:
            raise ValueError("allreduce_ needs a C-contiguous array")
        self.allreduce_tensor_(self._torch.from_numpy(array))

    def allreduce_tensor_(self, t: Any) -> None:
        """Sum a contiguous tensor over the group in place, on its own device."""
        if self._size == 1:
            return
        self.num_collectives += 1
        if self.verify == "inline":
            key = float((zlib.crc32(self._tag().tobytes()) & 0xFFFFFF) + 1)
            if t.dtype != self._torch.float64:  # k*k must be exact: 48 bits
                raise ConfigError("verify='inline' needs float64 tensors", expected="float64",
                                  got=str(t.dtype), fix="use verify='exchange'")
            buf = self._torch.cat([t.new_tensor([key, key * key]), t.reshape(-1)])
            self._wait(self._dist.all_reduce(buf, group=self.group, async_op=True),
                       "all-reduce")
            sum_k, sum_kk = buf[:2].tolist()
            self._check_inline(sum_k, sum_kk, key)
            t.view(-1).copy_(buf[2:])
            return
        if self.verify == "exchange":
            self._check(self._exchange(self._tag(), t.device))
        self._wait(self._dist.all_reduce(t, group=self.group, async_op=True), "all-reduce")

    def _exchange(self, tag: np.ndarray, device: Any) -> np.ndarray:
        torch = self._torch
        group = self.group or self._dist.distributed_c10d._get_default_group()
        where = device if device.type != "cpu" and not cpu_backend(group) else "cpu"
        mine = torch.from_numpy(tag).to(where)
        parts = [torch.empty_like(mine) for _ in range(self._size)]
        self._wait(self._dist.all_gather(parts, mine, group=self.group, async_op=True),
                   "tag exchange")
        return torch.stack(parts).cpu().numpy()

    def _wait(self, work: Any, what: str) -> None:
        """Poll with a backoff (spin briefly, then sleep up to 200 us) until the deadline."""
        deadline = time.monotonic() + self.timeout
        spins = 0
        try:
            while not work.is_completed():
                spins += 1
                if spins < 64:
                    time.sleep(0)
                    continue
                time.sleep(min(2e-4, 1e-6 * spins))
                if time.monotonic() > deadline:
                    raise self._timeout(what)
            work.wait()  # raises what the backend raised; for CUDA orders the current stream
        except CoordinationError:
            raise
        except RuntimeError as exc:
            raise CoordinationError(
                f"{what} failed in torch.distributed (TP member {self._rank} of {self._size}): "
                f"{exc}", task=_tag_text(self._tag_now()), expected="matching collectives on "
                "every member", got="a backend error",
                fix="run TP groups with a Coordinator, or use verify='exchange'") from None
