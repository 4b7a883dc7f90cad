"""The reductions a training step needs across stages, TP shards and DP replicas.

Single-process training gets these for free; a pipeline splits the model, so each is a known
source of silent divergence when done per rank:

- the end of a step (`after_step`): wait for the data-parallel gradient means; sum the gradients
  of weights tied across stages (an embedding on the first stage and the LM head on the last)
  between their owners; with `normalize="weight"` divide the gradients and the loss by the sum of
  the microbatch weights over every replica (it is known only after the last forward); with a
  GradScaler unscale, and agree on the found-inf flag across every rank, so all skip together;
- `clip_grad_norm_`: the norm over every stage, TP shard and replica, each value counted once
  (a TP-sharded parameter once per shard, a replicated one on TP rank 0, a tied one on its
  first stage, replicas only on DP replica 0), and the same clip factor everywhere.

One small all-reduce over the world (a duplicate of the grid's world communicator) carries the
weight sum and the found-inf flag together; the norm is one more. In-process pipelines hold every
stage, so their sums are local. Under MPI these need `grid=` (the world and the tie groups come
from it). Collectives are nonblocking, completed by the progress engine (requests.py); under
torchrun they run on the grid's torch.distributed groups (the world group of `torch_groups`, a
group per tie made by its owners) and complete through torch_requests.py.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np
import torch

from ..errors import ConfigError

__all__ = ["CrossStage", "GradScaler"]


class GradScaler:
    """Dynamic loss scaling whose found-inf flag every rank agrees on (torch.amp's rules).

    The Pipeline scales the last stage's backward root by `scale`, unscales the gradients at
    the end of the step and sets `found_inf` from every rank; then `step(optimizer)` skips on
    every rank together and `update()` moves the scale the same way everywhere.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, *, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000) -> None:
        if not init_scale > 0 or not growth_factor > 1 or not 0 < backoff_factor < 1:
            raise ConfigError("GradScaler factors", expected="init_scale > 0, growth_factor > 1,"
                              " 0 < backoff_factor < 1",
                              got=(init_scale, growth_factor, backoff_factor))
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.found_inf = False
        self._good_steps = 0

    def step(self, optimizer: Any) -> bool:
        """`optimizer.step()` unless some rank found an inf or NaN; True if it stepped."""
        if self.found_inf:
            return False
        optimizer.step()
        return True

    def update(self) -> None:
        if self.found_inf:
            self.scale *= self.backoff_factor
            self._good_steps = 0
            return
        self._good_steps += 1
        if self._good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self._good_steps = 0


class _Tie:
    __slots__ = ("name", "params", "first", "comm")

    def __init__(self, name: str, params: list[torch.Tensor], first: bool, comm: Any) -> None:
        self.name = name
        self.params = params  # this process's copies
        self.first = first  # the copy of the tie's lowest stage is here (counted in norms)
        self.comm = comm  # the owners' communicator across ranks, or None


class CrossStage:
    """The end-of-step and clipping reductions of one Pipeline (see the module docstring)."""

    def __init__(self, pipe: Any, *, tied: Mapping[str, Mapping[int, str]] | None,
                 scaler: GradScaler | None, normalize: str) -> None:
        self.pipe = pipe
        self.scaler = scaler
        self.weighted = normalize == "weight"
        grid = pipe.grid
        self.comms = None if grid is None else grid.comms
        c = None if self.comms is None else self.comms.coords
        self.tp_rank, self.dp_rank = (0, 0) if c is None else (c.tp_rank, c.dp)
        self.dp_size = 1 if self.comms is None else self.comms.grid.dp_size
        self.executors = [(rt, ex) for rt in pipe.runtimes for ex in (rt.executors or ())]
        self._world: Any = None
        self._requests: Any = None
        self._torch = False  # the grid's groups are torch.distributed ones (torchrun)
        if self.comms is not None:
            from ..tp.grid import GridGroups
            self._torch = isinstance(self.comms, GridGroups)
            what = f"cross-stage all-reduce (world rank {self.comms.grid.rank_of(c)})"
            if self._torch:
                from .torch_requests import TorchRequests
                self._world, self._requests = self.comms.world, TorchRequests(what)
            else:
                from .requests import Requests
                self._world, self._requests = self.comms.world.Dup(), Requests(what)
        elif self._spread(pipe) and (tied or scaler is not None or self.weighted):
            raise self._needs_grid(pipe, "tied weights, a GradScaler and normalize='weight'")
        self.ties = [self._tie(name, owners) for name, owners in sorted((tied or {}).items())]
        # a tied weight counts once in a norm: its lowest stage's copy (params are by stage)
        self._skip = {id(p) for t in self.ties for p in t.params[1 if t.first else 0:]}

    # -- construction ---------------------------------------------------------------------
    @staticmethod
    def _spread(pipe: Any) -> bool:
        """The pipeline's ranks live in several processes (a transport over a world > 1)."""
        return pipe.transport is not None and pipe.transport.world_size > 1

    @staticmethod
    def _needs_grid(pipe: Any, what: str) -> ConfigError:
        return ConfigError(f"{what} reduce over every rank", rank=pipe.transport.rank,
                           expected="Pipeline(..., grid=ProcessGrid(pp_size=N))",
                           got="a transport without a grid (each rank would see only its "
                           "own stages)")

    def _tie(self, name: str, owners: Mapping[int, str]) -> _Tie:
        placement = self.pipe.hint.placement
        if len(owners) < 2 or any(not 0 <= s < placement.num_stages for s in owners):
            raise ConfigError(f"tied weight {name!r}", expected="{stage: parameter name} for "
                              f"two or more of stages 0..{placement.num_stages - 1}",
                              got=dict(owners))
        params = []
        for rt, ex in sorted(self.executors, key=lambda re: re[1].stage):
            path = owners.get(ex.stage)
            if path is None:
                continue
            named = dict(ex.module.named_parameters())
            if path not in named:
                raise ConfigError(f"tied weight {name!r}: no parameter {path!r} in stage "
                                  f"{ex.stage}", rank=rt.rank, expected=sorted(named)[:8],
                                  got=path)
            params.append(named[path])
        first = min(owners) in [ex.stage for _, ex in self.executors]
        ranks = sorted({placement.rank_of(s) for s in owners})
        comm = None
        if self.comms is not None and len(ranks) > 1 and self._torch:
            c, g = self.comms.coords, self.comms.grid
            if c.pp_rank in ranks:  # only the owners make their group (as Split's colors do)
                import torch.distributed as dist

                from ..tp.grid import Coords
                comm = dist.new_group([g.rank_of(Coords(c.dp, r, c.tp_rank)) for r in ranks],
                                      use_local_synchronization=True)
        elif self.comms is not None and len(ranks) > 1:
            from mpi4py import MPI
            c, g = self.comms.coords, self.comms.grid
            mine = c.pp_rank in ranks
            color = c.dp * g.tp_size + c.tp_rank if mine else MPI.UNDEFINED
            comm = self.comms.world.Split(color, c.pp_rank)  # collective: every rank calls it
            if not mine:
                comm = None
        return _Tie(name, params, first, comm)

    # -- the step -------------------------------------------------------------------------
    def before_step(self) -> None:
        scale = 1.0 if self.scaler is None else self.scaler.scale
        for _, ex in self.executors:
            ex.loss_scale = scale
            ex.losses.clear()

    async def after_step(self, loss: Any) -> Any:
        reducer = self.pipe.grad_reducer
        if reducer is not None:
            await reducer.wait_reduced()
        for tie in self.ties:
            await self._sum_tie(tie)
        total_weight = 1.0
        if self.weighted or self.scaler is not None:
            weight, bad = await self._sum([self._local_weight(), self._local_nonfinite()])
            if self.weighted and not weight > 0:
                raise ConfigError("the step's microbatch weights do not sum to a positive "
                                  "number", expected="loss_fn weights with a sum > 0",
                                  got=weight)
            total_weight = weight
            factor = self.dp_size / weight if self.weighted else 1.0
            if self.scaler is not None:
                self.scaler.found_inf = bad > 0
                factor /= self.scaler.scale
            if factor != 1.0 and not (self.scaler is not None and self.scaler.found_inf):
                self._scale_grads(factor)
        if reducer is not None and loss is not None:
            loss = await reducer.mean(loss)
        if self.weighted and loss is not None:
            loss = loss * (self.dp_size / total_weight)
        return loss

    def _local_weight(self) -> float:
        if not self.weighted or self.tp_rank:
            return 0.0
        return float(sum(float(w) for _, ex in self.executors if ex.is_last
                         for _, w in ex.losses.values()))

    def _local_nonfinite(self) -> float:
        if self.scaler is None:
            return 0.0
        return float(any(not bool(torch.isfinite(p.grad).all()) for p in self._params()
                         if p.grad is not None))

    def _params(self) -> list[torch.Tensor]:
        return [p for _, ex in self.executors for p in ex.module.parameters()]

    def _scale_grads(self, factor: float) -> None:
        with torch.no_grad():
            for p in self._params():
                if p.grad is not None:
                    p.grad.mul_(factor)

    async def _sum_tie(self, tie: _Tie) -> None:
        if not tie.params:
            return
        with torch.no_grad():
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in tie.params]
            total = grads[0].detach().to("cpu", copy=True)
            for g in grads[1:]:
                total += g.to("cpu")
            if tie.comm is not None:
                await self._allreduce(tie.comm, total.numpy())
            for p in tie.params:
                p.grad = total.to(device=p.device, dtype=p.dtype, copy=True)

    async def _sum(self, values: list[float]) -> list[float]:
        """Sum over the world (in-process: the values themselves)."""
        array = np.array(values, dtype=np.float64)
        if self._world is not None:
            await self._allreduce(self._world, array)
        return [float(v) for v in array]

    async def _allreduce(self, comm: Any, array: np.ndarray) -> None:
        """Sum `array` in place over `comm`: an MPI communicator, or a torch group."""
        if self._torch:
            import torch.distributed as dist
            work = dist.all_reduce(torch.from_numpy(array), group=comm, async_op=True)
            self._requests.track(work, channel=id(comm))
        else:
            from mpi4py import MPI
            self._requests.track(comm.Iallreduce(MPI.IN_PLACE, array, op=MPI.SUM),
                                 nbytes=array.nbytes)
        await self._requests.wait_all()

    # -- clipping -------------------------------------------------------------------------
    def _counted(self, p: torch.Tensor) -> bool:
        if self.dp_rank or id(p) in self._skip:
            return False
        return self.tp_rank == 0 or getattr(p, "tp_shard_dim", None) is not None

    async def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip every local gradient by the global 2-norm (torch's rule); return the norm."""
        if self._world is None and self._spread(self.pipe):
            raise self._needs_grid(self.pipe, "clip_grad_norm_")
        with torch.no_grad():
            local = sum(float(p.grad.double().pow(2).sum()) for p in self._params()
                        if p.grad is not None and self._counted(p))
        (total,) = await self._sum([local])
        norm = math.sqrt(total)
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            self._scale_grads(coef)
        return torch.tensor(norm, dtype=torch.float64)

    def close(self) -> None:
        """Stop polling and free the world duplicate and the tie communicators (once)."""
        if self._requests is not None:
            self._requests.close()
        comms = [c for c in [self._world] + [t.comm for t in self.ties] if c is not None]
        if comms and not self._torch:  # torch frees its groups with the world
            from mpi4py import MPI
            for comm in comms:
                if comm != MPI.COMM_NULL:
                    comm.Free()
