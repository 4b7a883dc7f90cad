"""Tensors through MPITransport (2 ranks): values, dtypes and shapes arrive intact.

Usage: mpiexec -n 2 python cuda_roundtrip.py [cuda|cpu]. Rank 0 sends tensors (small ones that
would travel inline on the CPU, large ones, a None slot, bfloat16, a non-contiguous view); rank 1
receives them and compares with the same tensors rebuilt from the seed. `cuda` (the default)
sends CUDA tensors and receives onto the CUDA device; the pinned staging buffers must all be back
in their pools at the end, and the second round of microbatches (after a barrier) must reuse
the first round's. `cpu` sends and receives CPU
tensors, which never take a CUDA path whatever AIOREADY_MPI_CUDA_AWARE says (runs without a GPU).
Prints the path (CUDA-aware or staged) and OK.
"""

import asyncio
import logging
import sys

import torch
from mpi4py import MPI

from aioready.runtime.launch import run, say
from aioready.transports.base import Message, MessageKind
from aioready.transports.mpi import MPITransport

SHAPES = [((3,), torch.float32), ((2, 5), torch.float64), ((1024, 1024), torch.float32),
          ((7, 9), torch.bfloat16), ((4096, 33), torch.float16), ((), torch.int64)]
ROUNDS = [(0, 1), (2, 3)]  # microbatches; the second round may reuse the first's buffers
MICROBATCHES = 4


def payload(m: int, device: str) -> tuple:
    gen = torch.Generator().manual_seed(m)
    out = []
    for shape, dtype in SHAPES:
        t = (torch.randn(shape, generator=gen) * 100).to(dtype)
        out.append(t.to(device))
    out.append(None)
    out.append(torch.arange(64, dtype=torch.float32).reshape(8, 8).t().to(device))  # a view
    return tuple(out)


def check_pools(t: MPITransport, side: str) -> None:
    """Every pinned buffer went back to its pool; later microbatches reused them."""
    pools = {id(s.pool): s.pool for s in t._stagers.values()}
    assert pools, f"{side}: no staging pool was used"
    for pool in pools.values():
        assert pool.num_lent == 0, f"{side}: {pool.num_lent} pinned buffers never released"
        assert pool.num_reused > 0, f"{side}: pinned buffers were never reused"
    say(f"{side} pools lent=0 allocated={sum(p.num_allocated for p in pools.values())} "
        f"reused={sum(p.num_reused for p in pools.values())}")


async def main(device: str) -> None:
    logging.basicConfig(level=logging.INFO)
    comm = MPI.COMM_WORLD
    t = MPITransport(comm, device="cuda" if device == "cuda" else None)
    got: dict[int, tuple] = {}
    t.open(lambda msg: got.__setitem__(msg.microbatch, msg.tensors))
    staged = device == "cuda" and not t.cuda_aware
    for microbatches in ROUNDS:
        if t.rank == 0:
            for m in microbatches:
                t.send_nowait(1, Message(0, MessageKind.ACTIVATION, 1, m, payload(m, device)))
            await t.wait_sent()
        else:
            while not all(m in got for m in microbatches):
                await asyncio.sleep(0.001)
        comm.Barrier()  # every buffer of this round is back in its pool
    if t.rank == 0:
        if staged:
            check_pools(t, "sender")
    else:
        assert len(got) == MICROBATCHES, sorted(got)
        for m in range(MICROBATCHES):
            want = payload(m, device)
            for a, b in zip(got[m], want):
                if b is None:
                    assert a is None
                    continue
                assert a.device.type == device and a.dtype == b.dtype and a.shape == b.shape, \
                    (a, b)
                assert torch.equal(a, b), f"microbatch {m}: values differ"
        if staged:
            check_pools(t, "receiver")
        if device == "cpu":
            assert not t._stagers, "CPU tensors went through a CUDA staging path"
        say(f"{device.upper()} OK cuda_aware={t.cuda_aware}")
    comm.Barrier()
    await t.close()


if __name__ == "__main__":
    run(main(sys.argv[1] if len(sys.argv) > 1 else "cuda"))
