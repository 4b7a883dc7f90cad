"""Pipeline cases over MPITransport vs the unsplit model; rank 0 prints one RESULT line per case.

Usage: mpiexec -n R python tests/mpi_scripts/exact.py CASE [CASE ...]
CASE = hint:mode:split:varlen, e.g. 1f1b:ready:1:0. Every rank builds the same full model from a
fixed seed and keeps its own stages; the reference runs the whole model on every rank.
"""

import asyncio
import sys

import numpy as np
import torch
from mpi4py import MPI

from aioready.launch import run
from aioready.pipeline import Pipeline
from aioready.schedulers import HINTS, make_hint
from aioready.testing import make_mlp_stages, mse_loss, reference_step
from aioready.transports.mpi import MPITransport

WIDTH = 16


def batch(M: int, varlen: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    lens = [3 + (5 * m) % 7 for m in range(M)] if varlen else [4] * M
    xs = [torch.randn(2, L, WIDTH, generator=gen, dtype=torch.float64) for L in lens]
    ys = [torch.randn(2, L, WIDTH, generator=gen, dtype=torch.float64) for L in lens]
    return xs, ys


def max_all(comm, value: float) -> float:
    out = np.zeros(1)
    comm.Allreduce(np.array([value]), out, op=MPI.MAX)
    return float(out[0])


async def one_case(comm, case: str, seed: int) -> None:
    hint_name, mode, split, varlen = case.split(":")
    split_b, var = split == "1", varlen == "1"
    size, rank = comm.Get_size(), comm.Get_rank()
    spec = HINTS[hint_name]
    S = size * spec.chunks
    M = 2 * size
    hint = make_hint(hint_name, num_stages=S, num_ranks=size, num_microbatches=M,
                     split_backward=split_b)
    mine = hint.placement.stages_of(rank)
    full = make_mlp_stages(S, width=WIDTH, seed=seed)
    xs, ys = batch(M, var, seed + 1)
    transport = MPITransport(comm)
    pipe = Pipeline([full[s] for s in mine], mse_loss, microbatches=M, hint=hint, mode=mode,
                    transport=transport, split_backward=split_b)
    loss = await pipe.step(xs, ys)
    await transport.close()
    pipe.close()
    ref_loss, ref = reference_step(make_mlp_stages(S, width=WIDTH, seed=seed), mse_loss, xs, ys)
    gdiff = 0.0
    for s in mine:
        for p, q in zip(full[s].parameters(), ref[s].parameters()):
            gdiff = max(gdiff, float((p.grad - q.grad).abs().max()))
    ldiff = abs(float(loss) - float(ref_loss)) if loss is not None else 0.0
    has_loss = max_all(comm, 1.0 if loss is not None else 0.0)
    gdiff, ldiff = max_all(comm, gdiff), max_all(comm, ldiff)
    if rank == 0:
        print(f"RESULT {case} loss_diff={ldiff:.3e} grad_diff={gdiff:.3e} "
              f"loss_seen={int(has_loss)}", flush=True)


async def main() -> None:
    comm = MPI.COMM_WORLD
    for i, case in enumerate(sys.argv[1:]):
        await one_case(comm, case, seed=100 + i)
        comm.Barrier()


if __name__ == "__main__":
    run(main())
