"""Train a residual MLP split over MPI ranks: rank r holds stage r (or its chunks).

    mpiexec -n 4 python examples/mpi_train.py --steps 20 --hint 1f1b --mode ready

Every rank builds the same full model from a fixed seed (aioready.testing.make_mlp_stages) and
keeps only its own stages; data comes from a seeded generator, so every rank agrees on the batch
without sending it. The last rank prints the loss of each step. With --check, the first step's
loss and gradients are compared against the unsplit model (float64, max abs diff <= 1e-10).
An error on any rank aborts the whole job (aioready.launch.run).
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np
import torch
from mpi4py import MPI

from aioready.launch import run
from aioready.runtime.pipeline import Pipeline
from aioready.schedulers import HINTS, make_hint
from aioready.testing.helpers import make_mlp_stages, mse_loss, reference_step
from aioready.transports.mpi import MPITransport


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--batch", type=int, default=64, help="samples per step")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--hint", default="1f1b", choices=sorted(HINTS))
    p.add_argument("--mode", default="ready", choices=["ready", "strict"])
    p.add_argument("--split-backward", action="store_true")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="compare step 0 with the unsplit model")
    return p.parse_args()


def make_batch(step: int, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(args.seed * 100_003 + step)
    x = torch.randn(args.batch, args.width, generator=gen, dtype=torch.float64)
    return x, torch.sin(x).roll(1, dims=1)  # a fixed target function to learn


async def main(args: argparse.Namespace) -> None:
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    num_stages = size * HINTS[args.hint].chunks
    hint = make_hint(args.hint, num_stages=num_stages, num_ranks=size,
                     num_microbatches=args.microbatches, split_backward=args.split_backward)
    full = make_mlp_stages(num_stages, width=args.width, hidden=2 * args.width, seed=args.seed)
    mine = [full[s] for s in hint.placement.stages_of(rank)]
    transport = MPITransport(comm)
    pipe = Pipeline(mine, mse_loss, microbatches=args.microbatches, hint=hint, mode=args.mode,
                    transport=transport, split_backward=args.split_backward)
    params = [p for m in mine for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=args.lr)
    for step in range(args.steps):
        x, y = make_batch(step, args)
        start = time.perf_counter()
        loss = await pipe.step(x, y)
        took = time.perf_counter() - start
        if step == 0 and args.check:
            await check(pipe, comm, full, hint.placement.stages_of(rank), loss, x, y, args)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if loss is not None:
            print(f"step {step:3d}  loss {float(loss):.6f}  {took * 1e3:7.1f} ms", flush=True)
    # outside pipe.step, a wait on the peers goes under the peer timeout: a rank that stops
    # answering ends the job with PeerLostError instead of a hang
    await pipe.watch(transport.close(), what="the transport's close")
    pipe.close()


async def max_over_ranks(comm, value: float) -> float:
    """A nonblocking all-reduce, polled so the loop (and its peer timeout) keeps running."""
    out = np.zeros(1)
    request = comm.Iallreduce(np.array([value]), out, op=MPI.MAX)  # numpy: nothing pickled
    while not request.Test():
        await asyncio.sleep(1e-3)
    return float(out[0])


async def check(pipe, comm, full, stages, loss, x, y, args) -> None:
    M = args.microbatches
    ref = make_mlp_stages(len(full), width=args.width, hidden=2 * args.width, seed=args.seed)
    ref_loss, ref = reference_step(ref, mse_loss, list(x.chunk(M)), list(y.chunk(M)))
    diff = max(float((p.grad - q.grad).abs().max())
               for s in stages for p, q in zip(full[s].parameters(), ref[s].parameters()))
    if loss is not None:
        diff = max(diff, abs(float(loss) - float(ref_loss)))
    worst = await pipe.watch(max_over_ranks(comm, diff), what="the check's all-reduce")
    if comm.Get_rank() == 0:
        print(f"check: max abs diff vs unsplit model {worst:.2e} "
              f"({'ok' if worst <= 1e-10 else 'FAILED'})", flush=True)
    if worst > 1e-10:
        raise RuntimeError(f"pipeline differs from the unsplit model by {worst:.2e}")


if __name__ == "__main__":
    run(main(parse()))
