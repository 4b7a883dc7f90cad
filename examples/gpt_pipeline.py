"""Train a tiny GPT-style model with a pipeline: in one process, or one stage per MPI rank.

    mpiexec -n 4 python examples/gpt_pipeline.py --steps 30      # 4 ranks, MPI transport
    python examples/gpt_pipeline.py --stages 4 --steps 30        # every stage in this process

Each rank builds the whole model from the same seed and keeps its own stages; rank 0 feeds the
microbatches, the last rank holds the targets and prints the loss. The optimizer steps each rank's
own parameters after `await pipe.step(...)`, when their gradients are complete. The data are
arithmetic token sequences, so the loss goes down within a few dozen steps.
"""

from __future__ import annotations

import argparse

import torch

import aioready
from aioready.cli.trainer import synthetic_microbatch
from aioready.launch import run
from aioready.testing.models import gpt_stages, lm_loss


def mpi_world() -> tuple[int, int]:
    """(rank, size) of COMM_WORLD; (0, 1) without mpi4py or outside mpirun."""
    try:
        from mpi4py import MPI
    except ImportError:
        return 0, 1
    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


async def main(args: argparse.Namespace) -> None:
    rank, size = mpi_world()
    transport = None
    if size > 1:
        from aioready.transports import MPITransport
        transport = MPITransport()
    stages = size if size > 1 else args.stages
    model = gpt_stages(stages, vocab=64, dim=args.dim, heads=4, layers_per_stage=2, seq=32,
                       seed=0)
    mine = [model[rank]] if transport is not None else model
    pipe = aioready.Pipeline(mine, lm_loss, microbatches=args.microbatches, hint=args.hint,
                             mode=args.mode, transport=transport)
    opt = torch.optim.AdamW([p for m in mine for p in m.parameters()], lr=args.lr)
    first, last = (rank == 0 or transport is None), (rank == size - 1 or transport is None)
    try:
        for step in range(args.steps):
            pairs = [synthetic_microbatch(step, m, batch=4, seq=32, vocab=64)
                     for m in range(args.microbatches)]
            loss = await pipe.step([x for x, _ in pairs] if first else None,
                                   [y for _, y in pairs] if last else None)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if last and (step % 5 == 0 or step == args.steps - 1):
                assert pipe.last_step is not None
                print(f"step {step:3d}  loss {float(loss):.4f}  "
                      f"step time {pipe.last_step.step_time * 1e3:.1f} ms", flush=True)
    finally:
        pipe.close()
        if transport is not None:
            await transport.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, default=4, help="stages when not under mpirun")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--hint", default="1f1b")
    p.add_argument("--mode", choices=("ready", "strict"), default="ready")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    torch.set_num_threads(1)
    run(main(p.parse_args()))
