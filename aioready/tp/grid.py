"""The process grid: world = DP x PP x TP, and the communicators each rank needs.

Layout (Megatron's): the tensor-parallel rank varies fastest, then the pipeline rank, then the
data-parallel replica, so a TP group is a block of adjacent world ranks (one node, fast links)
and DP comes later without renumbering:

    world_rank = (dp * pp_size + pp_rank) * tp_size + tp_rank

Each rank needs two communicators (docs/architecture.md "Tensor-parallel coordination"):
- its TP group (same dp, same pp_rank): collectives inside a stage and the leader's decisions;
- its PP line (same dp, same tp_rank): activations and gradients travel TP rank to TP rank,
  member t of pipeline rank p talks only to member t of p-1 and p+1.
The arithmetic is pure (testable without MPI); `split` makes the mpi4py communicators and
imports mpi4py lazily, so this module is safe to import anywhere; `torch_groups` makes the same
groups with torch.distributed (torchrun jobs), plus a second TP group for the leader's decisions:
torch has no communicator duplication to keep decisions and collectives apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

__all__ = ["ProcessGrid", "Coords", "GridComms", "GridGroups"]


@dataclass(frozen=True, slots=True)
class Coords:
    """Where one world rank sits in the grid."""

    dp: int
    pp_rank: int
    tp_rank: int

    @property
    def is_tp_leader(self) -> bool:
        """TP rank 0 arbitrates for its group."""
        return self.tp_rank == 0


@dataclass(frozen=True, slots=True)
class ProcessGrid:
    """Sizes of the grid; `ProcessGrid.for_world(n, tp=2)` derives PP from the world size."""

    pp_size: int
    tp_size: int = 1
    dp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("pp_size", "tp_size", "dp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer", expected=">= 1",
                                  got=repr(value))

    @classmethod
    def for_world(cls, world_size: int, *, tp: int = 1, dp: int = 1) -> "ProcessGrid":
        """The grid for `world_size` ranks with the given TP and DP sizes (PP is the rest)."""
        if tp < 1 or dp < 1 or world_size % (tp * dp):
            raise ConfigError("the world does not split into the requested groups",
                              expected=f"a world size divisible by tp*dp = {tp}*{dp}",
                              got=f"world size {world_size}",
                              fix="launch mpiexec -n with a multiple of tp*dp")
        return cls(world_size // (tp * dp), tp, dp)

    @property
    def world_size(self) -> int:
        return self.dp_size * self.pp_size * self.tp_size

    def coords(self, rank: int) -> Coords:
        self._check(rank)
        tp_rank = rank % self.tp_size
        pp_rank = (rank // self.tp_size) % self.pp_size
        return Coords(rank // (self.tp_size * self.pp_size), pp_rank, tp_rank)

    def rank_of(self, coords: Coords) -> int:
        return (coords.dp * self.pp_size + coords.pp_rank) * self.tp_size + coords.tp_rank

    def tp_group(self, rank: int) -> list[int]:
        """World ranks of `rank`'s TP group, in TP-rank order (the leader first)."""
        c = self.coords(rank)
        return [self.rank_of(Coords(c.dp, c.pp_rank, t)) for t in range(self.tp_size)]

    def pp_group(self, rank: int) -> list[int]:
        """World ranks of `rank`'s pipeline line (same TP rank), in pipeline-rank order."""
        c = self.coords(rank)
        return [self.rank_of(Coords(c.dp, p, c.tp_rank)) for p in range(self.pp_size)]

    def dp_group(self, rank: int) -> list[int]:
        """World ranks holding the same shard of the same stages, in replica order."""
        c = self.coords(rank)
        return [self.rank_of(Coords(d, c.pp_rank, c.tp_rank)) for d in range(self.dp_size)]

    def _check(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ConfigError("rank outside the grid", expected=f"0..{self.world_size - 1}",
                              got=rank)

    def split(self, comm: Any = None) -> "GridComms":
        """Split `comm` (default COMM_WORLD) into this rank's TP, PP and DP communicators.

        Collective over `comm`: every rank must call it. Ranks inside each new communicator are
        numbered as in `tp_group` / `pp_group` / `dp_group`, so `tp.Get_rank()` is the TP rank
        and `pp.Get_rank()` the pipeline rank.
        """
        from mpi4py import MPI

        comm = MPI.COMM_WORLD if comm is None else comm
        if comm.Get_size() != self.world_size:
            raise ConfigError("the communicator does not match the grid",
                              expected=f"{self.world_size} ranks ({self.dp_size} dp x "
                              f"{self.pp_size} pp x {self.tp_size} tp)",
                              got=f"{comm.Get_size()} ranks")
        rank = comm.Get_rank()
        c = self.coords(rank)
        tp = comm.Split(color=c.dp * self.pp_size + c.pp_rank, key=c.tp_rank)
        pp = comm.Split(color=c.dp * self.tp_size + c.tp_rank, key=c.pp_rank)
        dp = comm.Split(color=c.pp_rank * self.tp_size + c.tp_rank, key=c.dp)
        return GridComms(self, c, comm, tp, pp, dp)

    def torch_groups(self) -> "GridGroups":
        """This rank's TP, TP-decision, PP and DP groups (and a world group of its own) over the
        torch.distributed world.

        Collective over the world: every rank creates every group, in the same order (torch's
        `new_group` rule), and keeps its own.
        """
        import torch.distributed as dist
        rank = dist.get_rank()
        if dist.get_world_size() != self.world_size:
            raise ConfigError("the torch.distributed world does not match the grid",
                              expected=f"{self.world_size} ranks "
                              f"(pp {self.pp_size} x tp {self.tp_size} x dp {self.dp_size})",
                              got=f"{dist.get_world_size()} ranks")
        mine: dict[str, Any] = {}
        for name, members in (("tp", self.tp_group), ("tp_decisions", self.tp_group),
                              ("pp", self.pp_group), ("dp", self.dp_group)):
            seen: set[tuple[int, ...]] = set()
            for r in range(self.world_size):
                ranks = tuple(members(r))
                if ranks in seen:
                    continue
                seen.add(ranks)
                group = dist.new_group(list(ranks))
                if rank in ranks:
                    mine[name] = group
        world = dist.new_group(list(range(self.world_size)))  # the cross-stage sums' own
        return GridGroups(self, self.coords(rank), world=world, **mine)


@dataclass(frozen=True, slots=True)
class GridComms:
    """One rank's place in the grid and its communicators (mpi4py Intracomms)."""

    grid: ProcessGrid
    coords: Coords
    world: Any
    tp: Any
    pp: Any
    dp: Any

    def free(self) -> None:
        for comm in (self.tp, self.pp, self.dp):
            comm.Free()


@dataclass(frozen=True, slots=True)
class GridGroups:
    """One rank's place in the grid and its torch.distributed groups (`world`: every rank, a
    group of its own so the cross-stage sums never match a user's collective on the world)."""

    grid: ProcessGrid
    coords: Coords
    world: Any
    tp: Any
    tp_decisions: Any
    pp: Any
    dp: Any

    @property
    def world_rank(self) -> int:
        return self.grid.rank_of(self.coords)
