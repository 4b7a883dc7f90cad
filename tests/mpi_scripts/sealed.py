"""A step over SecureTransport(MPITransport) against the same step plain and the unsplit model,
then a step whose ranks hold different keys. Rank 0 prints the RESULT line.

Usage: mpiexec -n 2 python tests/mpi_scripts/sealed.py
   or: torchrun --nproc-per-node 2 tests/mpi_scripts/sealed.py   (TorchDistTransport, gloo)
Phase 1: one 1F1B step plain, one sealed (fresh models from one seed): the gradients and loss
must be bit-identical, and match the reference. Phase 2: rank 1 holds another key: each rank's
step must fail with ProtocolError naming the other; each prints `MISKEYED rank=R msg=...`.
"""

import asyncio
import os
import sys

import numpy as np
import torch

from aioready.errors import AioreadyError, ProtocolError
from aioready.launch import launcher, say
from aioready.runtime.pipeline import Pipeline
from aioready.testing.helpers import make_mlp_stages, mse_loss, reference_step
from aioready.transports.secure import SecureTransport, secure_session

TORCHRUN = launcher() == "torchrun"
if TORCHRUN:
    import torch.distributed as dist

    from aioready.telemetry.torch_comm import TorchComm
    from aioready.transports.torchdist import TorchDistTransport
else:
    from mpi4py import MPI

    from aioready.transports.mpi import MPITransport

KEY = bytes(range(32))


def data():
    gen = torch.Generator().manual_seed(5)
    return (torch.randn(8, 16, generator=gen, dtype=torch.float64),
            torch.randn(8, 16, generator=gen, dtype=torch.float64))


async def one_step(comm, sealed: bool, key: bytes = KEY, peer_timeout: float = 20):
    rank = comm.Get_rank()
    stages = make_mlp_stages(2, seed=11)
    transport = inner = TorchDistTransport() if TORCHRUN else MPITransport(comm)
    if sealed:
        transport = SecureTransport(transport, key=key, session=await secure_session(comm))
    pipe = Pipeline([stages[rank]], mse_loss, microbatches=4, hint="1f1b",
                    transport=transport, peer_timeout=peer_timeout)
    x, y = data()
    loss = await pipe.step(x if rank == 0 else None, y if rank == 1 else None)
    await transport.close()
    pipe.close()
    board = getattr(inner, "notice_board", None)  # notices posted there, not sealed
    return loss, [p.grad.clone() for p in stages[rank].parameters()], (
        -1 if board is None else board.num_posted)


def max_all(comm, value: float) -> float:
    if TORCHRUN:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t[0])
    out = np.zeros(1)
    comm.Allreduce(np.array([value]), out, op=MPI.MAX)
    return float(out[0])


async def main() -> None:
    if TORCHRUN:
        dist.init_process_group("gloo")
    comm = TorchComm() if TORCHRUN else MPI.COMM_WORLD
    rank = comm.Get_rank()
    plain_loss, plain, plain_board = await one_step(comm, False)
    sealed_loss, sealed, sealed_board = await one_step(comm, True)
    same = all(torch.equal(a, b) for a, b in zip(plain, sealed))
    same = same and (rank == 0 or torch.equal(plain_loss, sealed_loss))
    x, y = data()
    ref_loss, ref = reference_step(make_mlp_stages(2, seed=11), mse_loss, list(x.split(2)),
                                   list(y.split(2)))
    diff = max(float((a - b.grad).abs().max()) for a, b in zip(sealed, ref[rank].parameters()))
    if rank == 1:
        diff = max(diff, abs(float(sealed_loss) - float(ref_loss)))
    same_all = max_all(comm, 0.0 if same else 1.0) == 0.0
    diff = max_all(comm, diff)
    plain_board, sealed_board = (max_all(comm, float(n)) for n in (plain_board, sealed_board))
    if rank == 0:
        say(f"RESULT identical={same_all} ref_diff={diff:.3e} board_plain={plain_board:.0f} "
            f"board_sealed={sealed_board:.0f}")
    try:
        await one_step(comm, True, KEY if rank == 0 else bytes(32), peer_timeout=8)
        say(f"MISKEYED rank={rank} no error")
    except AioreadyError as exc:
        say(f"MISKEYED rank={rank} type={type(exc).__name__} "
            f"protocol={isinstance(exc, ProtocolError)} msg={exc}")
    if TORCHRUN:
        dist.barrier()
    else:
        comm.Barrier()
    sys.stdout.flush()
    os._exit(0)  # the failed step's transports still hold requests: no orderly finalize


if __name__ == "__main__":
    asyncio.run(main())
