"""ZeRO-1: optimizer state sharded over the data-parallel replicas (Rajbhandari et al. 2020).

After the step the replicas hold equal, averaged gradients (reducer.py). Each replica owns one
contiguous 1/DP slice of every bucket's flattened parameters: it keeps the optimizer state of that
slice only (Adam's two moments: 2/DP of the parameter memory instead of 2x), steps its slice, and
the updated slices are all-gathered back into every replica's parameters. The optimizer must be
elementwise (SGD, Adam, AdamW...: the update of one element depends on that element only), so the
sharded step equals the whole one. Our reading, and a simplification: the gradients are
all-reduced, not reduce-scattered (the reducer serves both modes); only the optimizer memory is
saved, the gradient traffic is the same as without ZeRO, plus one all-gather per bucket.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from ..errors import ConfigError
from .reducer import plan_buckets, resolve_bucket_bytes

__all__ = ["ZeroOptimizer"]


class _Shard:
    __slots__ = ("params", "numel", "size", "start", "flat")

    def __init__(self, params: list[torch.Tensor], rank: int, size: int) -> None:
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.size = -(-self.numel // size)  # ceil: every replica's slice has one length
        self.start = rank * self.size
        end = min(self.start + self.size, self.numel)
        with torch.no_grad():
            whole = torch.cat([p.detach().reshape(-1) for p in params])
        self.flat = torch.nn.Parameter(whole[self.start:max(end, self.start)].clone())


class ZeroOptimizer:
    """`optimizer_cls(shards, **kwargs)` over this replica's slices; `await step()` on all.

    Collective over the DP group: every replica calls `step()` after the same pipeline step.
    """

    def __init__(self, pipe: Any, optimizer_cls: Callable[..., Any], *,
                 bucket_bytes: int | None = None, **kwargs: Any) -> None:
        grid = pipe.grid
        if grid is None:
            raise ConfigError("ZeRO shards over data-parallel replicas",
                              expected="Pipeline(..., grid=ProcessGrid(dp_size=N))", got=None)
        if not hasattr(grid.comms.dp, "Dup"):
            raise ConfigError("ZeRO shards over an MPI data-parallel group for now",
                              expected="a grid split over MPI (mpiexec)",
                              got="torch.distributed groups (torchrun)",
                              fix="use a plain optimizer: the DP gradient mean runs under "
                              "torchrun too")
        from .requests import Requests
        self.comm = grid.comms.dp.Dup()
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        params = [p for rt in pipe.runtimes for ex in rt.executors or ()
                  for p in ex.module.parameters() if p.requires_grad]
        self.shards = [_Shard(b, self.rank, self.size)
                       for b in plan_buckets(params, resolve_bucket_bytes(bucket_bytes))]
        self.optimizer = optimizer_cls([s.flat for s in self.shards], **kwargs)
        self._requests = Requests(f"ZeRO all-gather (DP member {self.rank} of {self.size})")

    def zero_grad(self, set_to_none: bool = True) -> None:
        for shard in self.shards:
            for p in shard.params:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()

    async def step(self) -> None:
        """Step this replica's slices, then all-gather every bucket's parameters."""
        with torch.no_grad():
            for shard in self.shards:  # the slice from the parameters: they may have been loaded
                whole = torch.cat([p.detach().reshape(-1) for p in shard.params])
                shard.flat.copy_(whole[shard.start:shard.start + shard.flat.numel()])
                grads = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p))
                                   .reshape(-1) for p in shard.params])
                shard.flat.grad = grads[shard.start:shard.start + shard.flat.numel()].clone()
        self.optimizer.step()
        gathered = []
        for shard in self.shards:
            mine = np.zeros(shard.size, dtype=_np_dtype(shard.flat))
            mine[:shard.flat.numel()] = shard.flat.detach().numpy()
            whole = np.empty(shard.size * self.size, dtype=mine.dtype)
            self._requests.track(self.comm.Iallgather(mine, whole), nbytes=whole.nbytes)
            gathered.append((shard, whole, mine))
        await self._requests.wait_all()
        with torch.no_grad():
            for shard, whole, _ in gathered:
                flat = torch.from_numpy(whole[:shard.numel])
                offset = 0
                for p in shard.params:
                    p.copy_(flat[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()

    def state_numel(self) -> int:
        """Elements of optimizer state held here (for checks: about 1/DP of the unsharded)."""
        return sum(t.numel() for st in self.optimizer.state.values() for t in st.values()
                   if isinstance(t, torch.Tensor) and t.dim() > 0)

    def close(self) -> None:
        self._requests.close()
        self.comm.Free()


def _np_dtype(t: torch.Tensor) -> Any:
    return torch.empty(0, dtype=t.dtype).numpy().dtype
