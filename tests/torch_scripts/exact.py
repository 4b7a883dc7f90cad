"""Pipeline cases over TorchDistTransport (gloo) vs the unsplit model, under torchrun.

Usage: torchrun --nproc-per-node R tests/torch_scripts/exact.py CASE [CASE ...]
CASE = hint:mode:split:varlen as in tests/mpi_scripts/exact.py, or `ooo` (2 ranks): rank 0 runs
stage 0 by hand and sends microbatch 3 first, the others 0.3 s later; rank 1 runs stage 1 in
ready mode and must run F3 first. Rank 0 (rank 1 for ooo) prints one RESULT line per case.
The transport comes from `job_transport()`: torchrun's environment must select torch.distributed;
a case written `mesh/CASE` instead builds TorchDistTransport from a 1-D DeviceMesh named "pp".
"""

import asyncio
import sys
import time

import torch
import torch.distributed as dist

from aioready.launch import run, say
from aioready.runtime.pipeline import Pipeline
from aioready.schedulers import HINTS, make_hint
from aioready.testing.helpers import make_mlp_stages, mse_loss, reference_step
from aioready.transports.base import Message, MessageKind
from aioready.transports.select import job_transport

WIDTH = 16


def batch(M: int, varlen: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    lens = [3 + (5 * m) % 7 for m in range(M)] if varlen else [4] * M
    xs = [torch.randn(2, L, WIDTH, generator=gen, dtype=torch.float64) for L in lens]
    ys = [torch.randn(2, L, WIDTH, generator=gen, dtype=torch.float64) for L in lens]
    return xs, ys


def max_all(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def grad_diff(full, ref, stages) -> float:
    return max((float((p.grad - q.grad).abs().max()) for s in stages
                for p, q in zip(full[s].parameters(), ref[s].parameters())), default=0.0)


def mesh_transport():
    from torch.distributed.device_mesh import init_device_mesh

    from aioready.transports.torchdist import TorchDistTransport
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("pp",))
    return TorchDistTransport(mesh)


async def one_case(case: str, seed: int) -> None:
    hint_name, mode, split, varlen = case.removeprefix("mesh/").split(":")
    split_b, var = split == "1", varlen == "1"
    size, rank = dist.get_world_size(), dist.get_rank()
    S = size * HINTS[hint_name].chunks
    M = 2 * size
    hint = make_hint(hint_name, num_stages=S, num_ranks=size, num_microbatches=M,
                     split_backward=split_b)
    mine = hint.placement.stages_of(rank)
    full = make_mlp_stages(S, width=WIDTH, seed=seed)
    xs, ys = batch(M, var, seed + 1)
    transport = mesh_transport() if case.startswith("mesh/") else job_transport()
    pipe = Pipeline([full[s] for s in mine], mse_loss, microbatches=M, hint=hint, mode=mode,
                    transport=transport, split_backward=split_b)
    loss = await pipe.step(xs, ys)
    await transport.close()
    pipe.close()
    ref_loss, ref = reference_step(make_mlp_stages(S, width=WIDTH, seed=seed), mse_loss, xs, ys)
    ldiff = abs(float(loss) - float(ref_loss)) if loss is not None else 0.0
    has_loss = max_all(1.0 if loss is not None else 0.0)
    gdiff, ldiff = max_all(grad_diff(full, ref, mine)), max_all(ldiff)
    if rank == 0:
        say(f"RESULT {case} loss_diff={ldiff:.3e} grad_diff={gdiff:.3e} "
            f"loss_seen={int(has_loss)} transport={type(transport).__name__}")


async def out_of_order(seed: int) -> None:
    rank, M = dist.get_rank(), 4
    full = make_mlp_stages(2, width=WIDTH, seed=seed)
    xs, ys = batch(M, True, seed + 1)
    transport = job_transport()
    order = ""
    if rank == 0:
        grads: dict[int, tuple] = {}
        transport.open(lambda msg: msg.kind is MessageKind.GRADIENT
                       and grads.__setitem__(msg.microbatch, msg.tensors))
        outs = {m: full[0](xs[m]) for m in range(M)}
        for m in (3, 2, 1, 0):
            transport.send_nowait(1, Message(0, MessageKind.ACTIVATION, 1, m,
                                             (outs[m].detach(),)))
            if m == 3:
                await transport.wait_sent()
                await asyncio.sleep(0.3)
        while len(grads) < M:
            await asyncio.sleep(0.001)
        for m in range(M):
            outs[m].backward(grads[m][0])
    else:
        # memory for every microbatch: F3 may run ahead of F0, which the 1F1B order names
        # first (at the last stage's own cap of one, the reservation keeps the device for F0)
        pipe = Pipeline([full[1]], mse_loss, microbatches=M, hint="1f1b", mode="ready",
                        transport=transport, cap=M)
        await pipe.step(None, ys)
        pipe.close()
        spans = sorted((s for s in pipe.last_step.spans if s.kind.name == "F"),
                       key=lambda s: s.start)
        order = ",".join(f"F{s.microbatch}" for s in spans)
    await transport.close()
    _, ref = reference_step(make_mlp_stages(2, width=WIDTH, seed=seed), mse_loss, xs, ys)
    gdiff = max_all(grad_diff(full, ref, [rank]))
    if rank == 1:
        say(f"RESULT ooo order={order} grad_diff={gdiff:.3e}")


async def main() -> None:
    for i, case in enumerate(sys.argv[1:]):
        t0 = time.perf_counter()
        if case == "ooo":
            await out_of_order(seed=100 + i)
        else:
            await one_case(case, seed=100 + i)
        dist.barrier()
        if dist.get_rank() == 0:
            print(f"TIME {case} {time.perf_counter() - t0:.2f}s", file=sys.stderr, flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    run(main())
    dist.destroy_process_group()  # aborted the process while a transport thread was exiting
