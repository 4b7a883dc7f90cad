"""Which plane moves the CUDA tensors of an mpirun job: NCCL through CuPy, host staging, or MPI.

Three planes (docs/async.md "The GPU data plane"):

- ``mpi``: device buffers straight to MPI. Right when the MPI is CUDA-aware (cuda/mpi.py).
- ``nccl``: MPI stays the control plane (headers, decisions, errors) and the payloads of CUDA
  tensors go over NCCL communicators made with CuPy, bootstrapped over MPI (cuda/nccl.py).
- ``staged``: through pooled pinned host buffers and MPI (cuda/mpi.py's HostStager).

The choice is the explicit argument, else `AIOREADY_GPU_PLANE`, else automatic: ``mpi`` when MPI
is CUDA-aware, else ``nccl`` when CuPy with NCCL is usable on every rank and no two ranks share a
GPU (NCCL refuses that since 2.5), else ``staged``. An explicit ``nccl`` that some rank cannot
honour is a ConfigError on every rank, never a silent fallback.

NCCL is collective, so the ranks must agree. `settle_gpu_plane` decides from one table that
every rank gathers (what each asked, whether it can, which GPU it drives), so every rank reaches
the same answer without a second round; it is pure, and so is `choose_gpu_plane`, so both are
tested on machines without a GPU. cuda/nccl.py's `open_gpu_plane` is the one collective step
(an Allgather of int64s, never a pickle) and the log line.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple, Sequence

from ..errors import ConfigError

__all__ = ["GPU_PLANES", "ENV_GPU_PLANE", "PlaneChoice", "RankPlane", "forced_gpu_plane",
           "choose_gpu_plane", "settle_gpu_plane", "shared_gpu", "rank_row", "NCCL_FIX",
           "ASKED_NCCL", "ASKED_OTHER"]

GPU_PLANES = ("nccl", "staged", "mpi")
ENV_GPU_PLANE = "AIOREADY_GPU_PLANE"
NCCL_FIX = ("pip install 'aioready[cuda]' (cupy-cuda12x, nvidia-nccl-cu12), or set "
            f"{ENV_GPU_PLANE}=staged")

ASKED_NCCL, ASKED_OTHER = 1, 2


class PlaneChoice(NamedTuple):
    """A rank's plane; `how` is 'argument', 'env' or 'auto', `reason` says why in words;
    `shared` the first two ranks found on one GPU, once the ranks agreed."""

    plane: str
    how: str
    reason: str
    shared: tuple[int, int] | None = None


class RankPlane(NamedTuple):
    """One rank's row of the agreement table: what it asked, whether it can, which GPU."""

    asked: int  # 0: nothing explicit, 1: nccl, 2: another plane (argument or environment)
    can_nccl: bool  # CuPy with NCCL usable and a CUDA device to drive
    gpu: int  # a hash of (host, device UUID); 0 when the rank drives no GPU
    wants_nccl: bool = False  # its own choice is nccl (a CUDA-aware rank's is mpi)


def rank_row(wish: PlaneChoice, *, can_nccl: bool, gpu: int) -> RankPlane:
    """This rank's row of the agreement table."""
    asked = 0 if wish.how == "auto" else ASKED_NCCL if wish.plane == "nccl" else ASKED_OTHER
    return RankPlane(asked, can_nccl, gpu, wish.plane == "nccl")


def _valid(value: str, where: str) -> str:
    if value not in GPU_PLANES:
        raise ConfigError(f"{where} names an unknown GPU data plane",
                          expected=" | ".join(GPU_PLANES), got=repr(value),
                          fix=f"unset {ENV_GPU_PLANE} to choose automatically")
    return value


def forced_gpu_plane(environ: Any = None) -> str | None:
    """The AIOREADY_GPU_PLANE override, or None when unset; anything unknown raises."""
    value = (os.environ if environ is None else environ).get(ENV_GPU_PLANE)
    return None if value is None else _valid(value, ENV_GPU_PLANE)


def choose_gpu_plane(explicit: str | None = None, *, cuda_aware: bool | None,
                     nccl_missing: str | None, environ: Any = None) -> PlaneChoice:
    """This rank's wish, before the ranks agree: argument, then environment, then automatic.

    `nccl_missing` is None when CuPy with NCCL is usable here, else why not (it becomes the
    `got` of the error when nccl is asked for). An explicit choice is returned even when it
    cannot be honoured here: `settle_gpu_plane` raises on every rank, so none is left waiting.
    """
    if explicit is not None:
        return PlaneChoice(_valid(explicit, "gpu_plane="), "argument", "chosen by the caller")
    forced = forced_gpu_plane(environ)
    if forced is not None:
        return PlaneChoice(forced, "env", f"{ENV_GPU_PLANE}={forced}")
    if cuda_aware:
        return PlaneChoice("mpi", "auto", "MPI takes device buffers")
    if nccl_missing is not None:
        return PlaneChoice("staged", "auto", f"no NCCL through CuPy: {nccl_missing}")
    return PlaneChoice("nccl", "auto", "MPI is not CUDA-aware and CuPy has NCCL")


def settle_gpu_plane(me: int, wish: PlaneChoice, table: Sequence[RankPlane],
                     nccl_missing: str | None = None) -> PlaneChoice:
    """The plane of rank `me` once every rank's row is known; the same rule on every rank.

    NCCL is used only if every rank can; asked for explicitly by any rank and not possible on
    some, it is a ConfigError on every rank. Ranks that share a GPU fall back to staging unless
    nccl was asked for explicitly (then NCCL itself answers, see cuda/nccl.py).
    """
    asked = [r for r, row in enumerate(table) if row.asked == ASKED_NCCL]
    cannot = [r for r, row in enumerate(table) if not row.can_nccl]
    other = [r for r, row in enumerate(table) if row.asked == ASKED_OTHER]
    if asked and other:
        raise ConfigError(f"ranks {asked} asked for the nccl GPU data plane and ranks {other} "
                          "for another one", rank=me, expected="one plane on every rank",
                          got=f"{wish.plane} here", fix=f"set {ENV_GPU_PLANE} alike on every rank")
    if asked and cannot:
        here = f"; here: {nccl_missing}" if me in cannot and nccl_missing else ""
        raise ConfigError(f"the nccl GPU data plane was asked for on ranks {asked}, but ranks "
                          f"{cannot} cannot use it", rank=me,
                          expected="CuPy with NCCL (2.7+) and a CUDA device on every rank",
                          got=f"not usable on ranks {cannot}{here}", fix=NCCL_FIX)
    if wish.plane != "nccl" and not asked:
        return wish
    if cannot:  # this rank would have used NCCL, another cannot
        return PlaneChoice("staged", "auto", f"ranks {cannot} cannot use NCCL")
    others = [r for r, row in enumerate(table) if not row.wants_nccl]
    if others and not asked:  # e.g. a CUDA-aware rank: mpi and staged mix, nccl does not
        return PlaneChoice("staged", "auto", f"ranks {others} chose another plane")
    shared = shared_gpu(table)
    if shared and not asked:
        return PlaneChoice("staged", "auto", f"ranks {shared[0]} and {shared[1]} share a GPU, "
                           "which NCCL refuses")
    if wish.plane != "nccl":
        return PlaneChoice("nccl", wish.how, f"asked for on ranks {asked}")
    return wish


def shared_gpu(table: Sequence[RankPlane]) -> tuple[int, int] | None:
    seen: dict[int, int] = {}
    for r, row in enumerate(table):
        if row.gpu:
            if row.gpu in seen:
                return seen[row.gpu], r
            seen[row.gpu] = r
    return None
