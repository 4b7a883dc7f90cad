"""CUDA tensors through TorchDistTransport (NCCL) and TorchTPComm, under torchrun, one GPU a rank.

Usage: torchrun --nproc-per-node N tests/torch_scripts/cuda_roundtrip.py   (N <= number of GPUs)
With 2+ ranks: rank 0 sends CUDA payloads of several dtypes, shapes (0-d, empty, a view, > 64 KiB)
to rank 1, which echoes them back; a tagged all-reduce of a CUDA tensor over all ranks. With one
rank (one GPU): the NCCL code paths alone, a 1-rank NCCL all-reduce polled through the transport's
WorkWaiter and through TorchTPComm's wait. Prints `CUDA OK` on rank 0 when everything matched.
"""

import asyncio
import os

import torch
import torch.distributed as dist

from aioready.launch import run, say
from aioready.tp.torch_collectives import TorchTPComm
from aioready.transports.base import Message, MessageKind
from aioready.transports.torch_work import WorkWaiter
from aioready.transports.torchdist import TorchDistTransport


def payload(device: torch.device) -> tuple:
    g = torch.Generator().manual_seed(3)
    return (torch.randn(300, 70, generator=g, dtype=torch.float64).to(device),
            torch.randn(4, 6, generator=g).to(device).t(), torch.tensor(7, device=device),
            torch.empty(0, 4, device=device), (torch.randn(5, generator=g) > 0).to(device),
            torch.randn(3, 3, generator=g).to(torch.bfloat16).to(device))


async def roundtrip(device: torch.device) -> list[str]:
    transport = TorchDistTransport(device=device)
    assert transport.device_backend, "the group has no CUDA backend"
    got: list[Message] = []
    transport.open(got.append)
    rank = transport.rank
    if rank == 0:
        transport.send_nowait(1, Message(0, MessageKind.ACTIVATION, 1, 0, payload(device)))
    while not got and rank <= 1:
        await asyncio.sleep(0.001)
    if rank == 1:
        transport.send_nowait(0, Message(0, MessageKind.GRADIENT, 0, 0, got[0].tensors))
    await transport.wait_sent()
    await transport.close()
    bad = []
    if rank == 0:
        for i, (a, b) in enumerate(zip(got[0].tensors, payload(device))):
            if a.device != device or a.dtype != b.dtype or a.shape != b.shape \
                    or not torch.equal(a, b):
                bad.append(f"slot {i}")
    return bad


async def one_rank_paths(device: torch.device) -> list[str]:
    t = torch.ones(1000, device=device)
    done: list = []
    waiter = WorkWaiter(asyncio.get_running_loop())
    waiter.add("nccl", dist.all_reduce(t, async_op=True), done.append, pollable=True)
    while not done:
        await asyncio.sleep(0.001)
    await waiter.aclose(5.0)
    comm = TorchTPComm(None)
    u = torch.full((10,), 2.0, device=device)
    comm._wait(dist.all_reduce(u, async_op=True), "all-reduce")
    ok = done == [None] and bool((t == 1).all()) and bool((u == 2).all())
    return [] if ok else [f"1-rank NCCL: {done} {t[:3]} {u[:3]}"]


async def main() -> None:
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    if dist.get_world_size() == 1:
        bad = await one_rank_paths(device)
    else:
        bad = await roundtrip(device)
        comm = TorchTPComm(None, verify="inline")
        x = torch.full((1 << 16,), float(dist.get_rank() + 1), dtype=torch.float64,
                       device=device)
        comm.allreduce_tensor_(x)
        n = dist.get_world_size()
        if not bool((x == n * (n + 1) / 2).all()):
            bad.append("all-reduce")
    flags = torch.tensor([len(bad)], device=device)
    dist.all_reduce(flags)
    if dist.get_rank() == 0:
        say("CUDA OK" if int(flags[0]) == 0 else f"CUDA BAD {bad}")


if __name__ == "__main__":
    dist.init_process_group("cpu:gloo,cuda:nccl")
    run(main())
    dist.destroy_process_group()
