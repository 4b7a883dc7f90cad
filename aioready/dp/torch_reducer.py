"""Gradient reduction over a torch.distributed data-parallel group (torchrun jobs).

The same contract as MPIGradReducer (reducer.py): each stage's gradients are averaged over the
replicas as soon as they are final, in buckets, overlapping the rest of the step. What differs:

- One process group per chunk (plus one for the loss) instead of one duplicated communicator:
  collectives on a group match in issue order, and in ready mode replicas finish their chunks
  in different orders. The groups are made with `use_local_synchronization`, so only the DP
  group's members take part in making them (as with `MPI_Comm_dup`), not the whole world.
- The data stays where it lives when the group can move it there: CUDA gradients are packed and
  summed on the device through the group's CUDA backend (NCCL); without one (gloo alone) they
  are staged through host memory, as over MPI.
- Completion comes through torch_requests.py (a waiter thread per group for gloo, the progress
  engine for NCCL), never a blocking `wait()` on the loop thread.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Sequence

from ..transports.torch_groups import device_backend
from .reducer import BucketedReducer, flat_grads
from .torch_requests import TorchRequests

__all__ = ["TorchGradReducer"]


class TorchGradReducer(BucketedReducer):
    """Mean of each chunk's gradients over a torch.distributed group (the DP group).

    Constructing it makes one group per chunk plus one for the loss over the members of
    `group`: every member must construct it at the same point of the program.
    """

    def __init__(self, group: Any, params: Sequence[Sequence[Any]], *,
                 bucket_bytes: int | None = None) -> None:
        import torch.distributed as dist
        self._dist = dist
        super().__init__(dist.get_world_size(group), dist.get_rank(group), params, bucket_bytes)
        ranks = dist.get_process_group_ranks(group) if group is not None else \
            list(range(dist.get_world_size()))
        self._groups = [self._new_group(ranks) for _ in range(len(params) + 1)]
        self._on_device = device_backend(self._groups[0])
        self._requests = TorchRequests(f"data-parallel all-reduce (DP member {self.rank} of "
                                       f"{self._size})")

    def _new_group(self, ranks: list[int]) -> Any:
        if len(ranks) == 1:
            return None
        return self._dist.new_group(ranks, use_local_synchronization=True)

    # -- GradReducer ----------------------------------------------------------------------
    def reduce_nowait(self, chunk: int) -> None:
        group = self._groups[chunk]
        for bucket in self._begin(chunk):
            cuda = self._on_device and bucket[0].is_cuda
            flat = flat_grads(bucket, bucket[0].device if cuda else "cpu")
            work = self._dist.all_reduce(flat, group=group, async_op=True)
            self.num_buckets += 1
            self.num_bytes += flat.numel() * flat.element_size()
            self._requests.track(work, partial(self._unpack, chunk, bucket, flat),
                                 channel=chunk, device=cuda)

    async def wait_reduced(self) -> None:
        await self._requests.wait_all()

    async def mean(self, value: Any) -> Any:
        import torch
        if self._size == 1:
            return value
        t = torch.tensor([float(value)], dtype=torch.float64)
        self._requests.track(self._dist.all_reduce(t, group=self._groups[-1], async_op=True),
                             channel="loss")
        await self._requests.wait_all()
        return torch.tensor(float(t[0]) / self._size,
                            dtype=getattr(value, "dtype", torch.float64))

    def close(self) -> None:
        """Stop the waiter threads (the groups stay: torch frees them with the world)."""
        self._requests.close()

    def __repr__(self) -> str:
        return (f"<TorchGradReducer member {self.rank}/{self._size} "
                f"chunks={len(self._groups) - 1} pending={self._requests.num_pending()}>")
