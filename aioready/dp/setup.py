"""A Pipeline's process grid: `Pipeline(stages, loss_fn, grid=...)` under MPI or torchrun.

One spelling: `grid=` takes a `ProcessGrid` (split here over COMM_WORLD, a collective call;
under torchrun into torch.distributed groups, `ProcessGrid.torch_groups`) or the `GridComms` /
`GridGroups` of one already split (needed when tensor-parallel layers are built before the
Pipeline, since they take the TP communicator or group). The pipeline's activations and
gradients then travel on the rank's pipeline line (same replica, same TP rank:
`MPITransport(comms.pp)`, or `TorchDistTransport(groups.pp)` under torchrun, made here unless
given), a TP group in ready mode gets its decision stream (`Coordinator`), and a data-parallel
group its gradient reducer. World rank order is grid.py's. The transports made here are closed
by `await pipe.grid.close()` after the last step.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from ..launch import launcher
from ..tp.grid import GridComms, GridGroups, ProcessGrid

__all__ = ["PipelineGrid", "setup_grid", "grid_reducer", "torch_job"]


@dataclass(slots=True)
class PipelineGrid:
    """What a Pipeline built from its grid: communicators, transport, optional coordinator."""

    comms: GridComms
    transport: Any
    coordinator: Any
    owned: list[Any] = field(default_factory=list)  # transports made here, closed by close()

    async def close(self) -> None:
        """Close the transports the grid made (after the last step; each waits for its sends)."""
        while self.owned:
            await self.owned.pop().close()


def torch_job() -> bool:
    """Whether this job's groups are torch.distributed ones: launched by torchrun, or
    torch.distributed initialised in a process that did not load mpi4py (never imports)."""
    if launcher() == "torchrun":
        return True
    dist = sys.modules.get("torch.distributed")
    return ("mpi4py.MPI" not in sys.modules and dist is not None and dist.is_available()
            and dist.is_initialized())


def _split(grid: ProcessGrid) -> GridComms | GridGroups:
    on_torch = torch_job()
    if on_torch:
        import torch.distributed as dist

        from ..transports.torch_groups import resolve_group
        resolve_group()  # the world, initialised from torchrun's variables if nobody did
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        from mpi4py import MPI
        rank, world = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    if world != grid.world_size:
        inner = grid.tp_size * grid.dp_size
        raise ConfigError(
            f"the {'torch.distributed' if on_torch else 'MPI'} world does not match the grid",
            rank=rank,
            expected=f"{grid.world_size} ranks = pp {grid.pp_size} x tp {grid.tp_size} x dp "
            f"{grid.dp_size} (a world size divisible by tp*dp = {inner})",
            got=f"world size {world}" + ("" if world % inner else
                                         f" (pp would be {world // inner})"),
            fix=f"launch {'torchrun --nproc-per-node' if on_torch else 'mpiexec -n'} pp*tp*dp, "
            "or build the grid with ProcessGrid.for_world(world_size, tp=..., dp=...)")
    return grid.torch_groups() if on_torch else grid.split()


def grid_reducer(comms: GridComms | GridGroups, params: list[list[Any]]) -> Any:
    """The gradient reducer over the grid's DP group, of the grid's kind (MPI or torch)."""
    if isinstance(comms, GridGroups):
        from .torch_reducer import TorchGradReducer
        return TorchGradReducer(comms.dp, params)
    from .nccl_reducer import mpi_grad_reducer
    return mpi_grad_reducer(comms.dp, params)  # NCCL for CUDA gradients where agreed


def _pipeline_transport(comms: GridComms | GridGroups, group: Any) -> Any:
    if isinstance(comms, GridGroups):
        from ..transports.torchdist import TorchDistTransport
        return TorchDistTransport(group)
    from ..transports.mpi import MPITransport
    return MPITransport(group)


def setup_grid(grid: Any, *, transport: Any, coordinator: Any, mode: str) -> PipelineGrid:
    """Split `grid` if needed, and check or make the pipeline line's transport."""
    if isinstance(grid, ProcessGrid):
        comms = _split(grid)
    elif isinstance(grid, (GridComms, GridGroups)):
        comms = grid
    else:
        raise ConfigError("grid", expected="a ProcessGrid, or the GridComms of grid.split() "
                          "(the GridGroups of grid.torch_groups() under torchrun)",
                          got=type(grid).__name__)
    c, g = comms.coords, comms.grid
    owned = []
    if transport is None:
        transport = _pipeline_transport(comms, comms.pp)
        owned.append(transport)
    elif transport.world_size != g.pp_size or transport.rank != c.pp_rank:
        raise ConfigError(
            "with grid=, the transport connects one pipeline line", rank=g.rank_of(c),
            expected=f"{g.pp_size} ranks, this one pipeline rank {c.pp_rank} "
            "(MPITransport(comms.pp) or TorchDistTransport(groups.pp))",
            got=f"{transport.world_size} ranks, this one rank {transport.rank}",
            fix="leave transport= out: the Pipeline makes it from the grid")
    if coordinator is None and g.tp_size > 1 and mode == "ready":
        from ..tp.coordination import Coordinator
        decisions = comms.tp_decisions if isinstance(comms, GridGroups) else comms.tp
        coordinator = Coordinator(_pipeline_transport(comms, decisions))
        owned.append(coordinator.transport)
    return PipelineGrid(comms, transport, coordinator, owned)
