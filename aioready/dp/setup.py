"""A Pipeline's process grid: `Pipeline(stages, loss_fn, grid=...)` under MPI.

One spelling: `grid=` takes a `ProcessGrid` (split here over COMM_WORLD, a collective call) or
the `GridComms` of one already split (needed when tensor-parallel layers are built before the
Pipeline, since they take the TP communicator). The pipeline's activations and gradients then
travel on the rank's pipeline line (same replica, same TP rank: `MPITransport(comms.pp)`, made
here unless given), a TP group in ready mode gets its decision stream (`Coordinator`), and a
data-parallel group its gradient reducer. World rank order is grid.py's. The transports made
here are closed by `await pipe.grid.close()` after the last step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from ..tp.grid import GridComms, ProcessGrid

__all__ = ["PipelineGrid", "setup_grid"]


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


def _split(grid: ProcessGrid) -> GridComms:
    from mpi4py import MPI
    world = MPI.COMM_WORLD.Get_size()
    if world != grid.world_size:
        inner = grid.tp_size * grid.dp_size
        raise ConfigError(
            "the MPI world does not match the grid", rank=MPI.COMM_WORLD.Get_rank(),
            expected=f"{grid.world_size} ranks = pp {grid.pp_size} x tp {grid.tp_size} x dp "
            f"{grid.dp_size} (a world size divisible by tp*dp = {inner})",
            got=f"world size {world}" + ("" if world % inner else
                                         f" (pp would be {world // inner})"),
            fix="launch mpiexec -n pp*tp*dp, or build the grid with "
            "ProcessGrid.for_world(world_size, tp=..., dp=...)")
    return grid.split()


def setup_grid(grid: Any, *, transport: Any, coordinator: Any, mode: str) -> PipelineGrid:
    """Split `grid` if needed, and check or make the pipeline line's transport."""
    if isinstance(grid, ProcessGrid):
        comms = _split(grid)
    elif isinstance(grid, GridComms):
        comms = grid
    else:
        raise ConfigError("grid", expected="a ProcessGrid or the GridComms of grid.split()",
                          got=type(grid).__name__)
    c, g = comms.coords, comms.grid
    owned = []
    if transport is None:
        from ..transports.mpi import MPITransport
        transport = MPITransport(comms.pp)
        owned.append(transport)
    elif transport.world_size != g.pp_size or transport.rank != c.pp_rank:
        raise ConfigError(
            "with grid=, the transport connects one pipeline line", rank=comms.world.Get_rank(),
            expected=f"{g.pp_size} ranks, this one pipeline rank {c.pp_rank} "
            "(MPITransport(comms.pp))",
            got=f"{transport.world_size} ranks, this one rank {transport.rank}",
            fix="leave transport= out: the Pipeline makes it from the grid")
    if coordinator is None and g.tp_size > 1 and mode == "ready":
        from ..tp.coordination import Coordinator
        from ..transports.mpi import MPITransport
        coordinator = Coordinator(MPITransport(comms.tp))
        owned.append(coordinator.transport)
    return PipelineGrid(comms, transport, coordinator, owned)
