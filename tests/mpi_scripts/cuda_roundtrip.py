"""CUDA tensors through MPITransport (2 ranks): values, dtypes and shapes arrive intact.

Rank 0 sends CUDA tensors (small ones that would travel inline on the CPU, large ones, a None
slot, bfloat16, a non-contiguous view); rank 1 receives them onto its CUDA device and compares
with the same tensors rebuilt from the seed. Prints the path (CUDA-aware or staged) and OK.
"""

import asyncio
import logging

import torch
from mpi4py import MPI

from aioready.launch import run, say
from aioready.transports.base import Message, MessageKind
from aioready.transports.mpi import MPITransport

SHAPES = [((3,), torch.float32), ((2, 5), torch.float64), ((1024, 1024), torch.float32),
          ((7, 9), torch.bfloat16), ((4096, 33), torch.float16), ((), torch.int64)]


def payload(m: int) -> tuple:
    gen = torch.Generator().manual_seed(m)
    out = []
    for shape, dtype in SHAPES:
        t = (torch.randn(shape, generator=gen) * 100).to(dtype)
        out.append(t.to("cuda"))
    out.append(None)
    out.append(torch.arange(64, dtype=torch.float32).reshape(8, 8).t().to("cuda"))  # a view
    return tuple(out)


async def main() -> None:
    logging.basicConfig(level=logging.INFO)
    comm = MPI.COMM_WORLD
    t = MPITransport(comm, device="cuda")
    got: dict[int, tuple] = {}
    t.open(lambda msg: got.__setitem__(msg.microbatch, msg.tensors))
    if t.rank == 0:
        for m in range(4):
            t.send_nowait(1, Message(0, MessageKind.ACTIVATION, 1, m, payload(m)))
        await t.wait_sent()
    else:
        while len(got) < 4:
            await asyncio.sleep(0.001)
        for m in range(4):
            want = payload(m)
            for a, b in zip(got[m], want):
                if b is None:
                    assert a is None
                    continue
                assert a.is_cuda and a.dtype == b.dtype and a.shape == b.shape, (a, b)
                assert torch.equal(a, b), f"microbatch {m}: values differ"
        say(f"CUDA OK cuda_aware={t.cuda_aware}")
    comm.Barrier()
    await t.close()


if __name__ == "__main__":
    run(main())
