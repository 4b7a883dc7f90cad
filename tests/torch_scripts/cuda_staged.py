"""CUDA tensors through a gloo-only group: staged through pinned host memory (torch_staging.py).

Usage: torchrun --nproc-per-node 2 tests/torch_scripts/cuda_staged.py   (one GPU is enough: both
ranks use cuda:0, which NCCL would refuse). Rank 0 sends three messages to rank 1: CUDA payloads
of several dtypes and shapes (> 64 KiB, a view, 0-d, empty, bool, bfloat16), then CPU tensors
that must queue behind the staged ones (gloo matches a peer's payloads in posting order), then
CUDA again. Rank 1's transport has device="cuda": it checks every tensor arrived on the GPU,
intact and in order, and echoes the first message back; rank 0 checks the echo too. Prints
`STAGED OK` on rank 0 when everything matched.
"""

import asyncio

import torch
import torch.distributed as dist

from aioready.launch import run, say
from aioready.transports.base import Message, MessageKind
from aioready.transports.torchdist import TorchDistTransport


def payload(seed: int, device: torch.device) -> tuple:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(300, 70, generator=g, dtype=torch.float64).to(device),
            torch.randn(4, 6, generator=g).to(device).t(), torch.tensor(7 + seed, device=device),
            torch.empty(0, 4, device=device), (torch.randn(5, generator=g) > 0).to(device),
            torch.randn(3, 3, generator=g).to(torch.bfloat16).to(device))


def mismatches(got: tuple, want: tuple, device: torch.device, where: str) -> list[str]:
    return [f"{where} slot {i}" for i, (a, b) in enumerate(zip(got, want))
            if a.device != device or a.dtype != b.dtype or a.shape != b.shape
            or not torch.equal(a.cpu(), b.cpu())]


async def main() -> None:
    cuda = torch.device("cuda", 0)
    torch.cuda.set_device(cuda)
    transport = TorchDistTransport(device=cuda)
    assert not transport.device_backend, "expected a gloo-only group"
    got: list[Message] = []
    transport.open(got.append)
    sent = [payload(1, cuda), payload(2, torch.device("cpu")), payload(3, cuda)]
    bad: list[str] = []
    if dist.get_rank() == 0:
        for mb, tensors in enumerate(sent):
            transport.send_nowait(1, Message(0, MessageKind.ACTIVATION, 1, mb, tensors))
        while not got:
            await asyncio.sleep(0.001)
        bad += mismatches(got[0].tensors, sent[0], cuda, "echo")
    else:
        while len(got) < 3:
            await asyncio.sleep(0.001)
        for msg, want in zip(sorted(got, key=lambda m: m.microbatch), sent):
            bad += mismatches(msg.tensors, want, cuda, f"microbatch {msg.microbatch}")
        transport.send_nowait(0, Message(0, MessageKind.GRADIENT, 0, 0, got[0].tensors))
    await transport.wait_sent()
    await transport.close()
    flags = torch.tensor([len(bad)])
    dist.all_reduce(flags)
    if bad:
        say(f"rank {dist.get_rank()}: {bad}")
    if dist.get_rank() == 0 and int(flags[0]) == 0:
        say("STAGED OK")


if __name__ == "__main__":
    dist.init_process_group("gloo")
    run(main())
