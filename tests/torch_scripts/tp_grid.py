"""PP x TP under torchrun: TP stages whose all-reduces go through torch.distributed (gloo).

Usage: torchrun --nproc-per-node 4 tests/torch_scripts/tp_grid.py MODE [MODE ...]
MODE = ready (members follow the leader's decisions, sent over TorchDistTransport on the TP
decision group) | strict | nocoord (ready without a Coordinator: members pick different tasks,
which the tagged collectives must report as a CoordinationError, not a hang: 8 microbatches
and a 100 ms straggler make the divergence certain, not a matter of timing).
Random per-task delays, different on every rank, make members see readiness at different times.
World rank 0 prints `RESULT mode grad_diff=... loss_diff=... orders_equal=... collectives=...`.
"""

import random
import sys
import zlib

import torch
import torch.distributed as dist

from aioready.devices.cpu import CPUDevice
from aioready.devices.delayed import DelayedDevice
from aioready.launch import run, say
from aioready.runtime.pipeline import Pipeline
from aioready.tasks import Kind
from aioready.testing.helpers import mse_loss, reference_step
from aioready.tp.collectives import TPDevice
from aioready.tp.coordination import Coordinator
from aioready.tp.grid import ProcessGrid
from aioready.tp.layers import make_tp_mlp_stages, max_tp_grad_diff
from aioready.tp.torch_collectives import TorchTPComm
from aioready.transports.torchdist import TorchDistTransport

STEPS, WIDTH = 2, 16


def max_all(value: float, group=None) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t[0])


async def one_mode(groups, mode: str) -> None:
    c, pp = groups.coords, groups.grid.pp_size
    rank = dist.get_rank()
    tpcomm = TorchTPComm(groups.tp, verify="exchange", timeout=10.0 if mode != "nocoord" else 5.0)
    full, shards = make_tp_mlp_stages(pp, tpcomm, width=WIDTH, hidden=32, blocks_per_stage=2,
                                      seed=7)
    module = shards[c.pp_rank]
    coord = (Coordinator(TorchDistTransport(groups.tp_decisions), record=True)
             if mode == "ready" else None)
    rng = random.Random(f"{rank}/{mode}")
    M = 8 if mode == "nocoord" else 4
    # One member of the last stage holds its gradients: its partner on stage 0 receives B0's
    # input long after the other member of stage 0 did, while forwards are still to run. With
    # a Coordinator both follow the leader; without one they must pick different tasks.
    slow = (0.1 if mode == "nocoord" else 0.03) * (c.tp_rank == 1 and c.pp_rank == pp - 1)

    def delay(info) -> float:
        return c.tp_rank * 0.002 + rng.uniform(0.0, 0.004) + (slow if info.kind is Kind.B else 0)
    device = DelayedDevice(CPUDevice(f"rank{rank}"), delay)
    transport = TorchDistTransport(groups.pp)
    pipe = Pipeline([module], mse_loss, microbatches=M, hint="1f1b",
                    mode="ready" if mode == "nocoord" else mode, transport=transport,
                    device=TPDevice(device, tpcomm), coordinator=coord, cap=M)
    last = c.pp_rank == pp - 1
    gdiff = ldiff = 0.0
    same = 1.0
    for step in range(STEPS):
        module.zero_grad(set_to_none=True)
        g = torch.Generator().manual_seed(1000 + step)
        xs = [torch.randn(2, WIDTH, generator=g, dtype=torch.float64) for _ in range(M)]
        ys = [torch.randn(2, WIDTH, generator=g, dtype=torch.float64) for _ in range(M)]
        loss = await pipe.step(xs if c.pp_rank == 0 else None, ys if last else None)
        order = pipe.last_step.order(c.pp_rank)
        code = torch.tensor([zlib.crc32(','.join(order).encode())], dtype=torch.float64)
        lo, hi = code.clone(), code.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=groups.tp)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=groups.tp)
        same = min(same, float(lo[0] == hi[0]))
        ref_loss, ref = reference_step(full, mse_loss, xs, ys)
        gdiff = max(gdiff, max_tp_grad_diff([ref[c.pp_rank]], [module], tpcomm))
        if last:
            ldiff = max(ldiff, abs(float(loss) - float(ref_loss)))
    await transport.close()
    if coord is not None:
        await coord.transport.close()
    device.close()
    gdiff, ldiff, same = max_all(gdiff), max_all(ldiff), -max_all(-same)
    n = max_all(float(tpcomm.num_collectives))
    if rank == 0:
        say(f"RESULT {mode} grad_diff={gdiff:.3e} loss_diff={ldiff:.3e} "
            f"orders_equal={int(same)} collectives={int(n)}")


async def main() -> None:
    groups = ProcessGrid.for_world(dist.get_world_size(), tp=2).torch_groups()
    for mode in sys.argv[1:]:
        await one_mode(groups, mode)
        dist.barrier()


if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    run(main())
