"""hint="auto" choosing the microbatch order over MPITransport: every rank runs rank 0's choice.

Usage: mpiexec -n R python tests/mpi_scripts/auto_order.py
"agree": each rank runs 3 steps of Pipeline(hint=AutoHint(retune_every=1)) on its stage of a float64
MLP (M = 4R, unsplit, cap 2x), every rank passing step(costs=...): heavy microbatches cost 3
and take 3x as long (paced, following the microbatch in each slot), and hold 3x the rows.
Gradients and loss are compared with the unsplit model's every step. Then "differ", on a
duplicate communicator: rank R-1 passes other costs, and every rank must end the first choice
with a ConfigError. Then "partial": rank R-1 passes no costs, so no rank may reorder (every
choice keeps the given order, simulated in it alone). Every rank prints per case "RESULT case rank=r choices=... orders=...
grad_diff=... loss_diff=..." or "RESULT case rank=r error=...".
"""

import numpy as np
import torch
from mpi4py import MPI

from aioready.devices.inline import InlineDevice
from aioready.devices.paced import PacedDevice
from aioready.errors import ConfigError
from aioready.launch import run, say
from aioready.runtime.autotune import AutoHint
from aioready.runtime.pipeline import Pipeline
from aioready.sim.tune import SimChooser
from aioready.testing.helpers import make_mlp_stages, mse_loss, reference_step
from aioready.transports.mpi import MPITransport

WIDTH = 8
BASE_S = (0.002, 0.004, 0.0)  # F, B, W


def max_all(comm, value: float) -> float:
    out = np.zeros(1)
    comm.Allreduce(np.array([value]), out, op=MPI.MAX)
    return float(out[0])


async def case(name: str, comm) -> None:
    size, rank = comm.Get_size(), comm.Get_rank()
    S, M = size, 4 * size
    cost = [3.0 if m % 3 == 0 else 1.0 for m in range(M)]
    mine = list(cost)
    if name == "differ" and rank == size - 1:
        mine[1] = 2.0
    if name == "partial" and rank == size - 1:
        mine = None
    full = make_mlp_stages(S, width=WIDTH, hidden=8, blocks_per_stage=1, seed=7)
    transport = MPITransport(comm)
    pipe = None

    def duration(info) -> float:
        slots = pipe.microbatch_slots
        mb = info.microbatch if slots is None else slots[info.microbatch]
        return BASE_S[int(info.kind)] * cost[mb]

    chooser = SimChooser()
    pipe = Pipeline([full[rank]], mse_loss, microbatches=M, transport=transport, cap="2x",
                    hint=AutoHint(retune_every=1, comm=comm, chooser=chooser),
                    device=PacedDevice(InlineDevice(), duration))
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(int(c), WIDTH, generator=gen, dtype=torch.float64) for c in cost]
    ys = [torch.randn(int(c), WIDTH, generator=gen, dtype=torch.float64) for c in cost]
    gdiff = ldiff = 0.0
    error = ""
    try:
        for _ in range(3):
            for p in full[rank].parameters():
                p.grad = None
            loss = await pipe.step(xs if rank == 0 else None, ys if rank == S - 1 else None,
                                   costs=mine)
            ref_loss, ref = reference_step(make_mlp_stages(S, width=WIDTH, hidden=8,
                                                           blocks_per_stage=1, seed=7),
                                           mse_loss, xs, ys)
            for p, q in zip(full[rank].parameters(), ref[rank].parameters()):
                gdiff = max(gdiff, float((p.grad - q.grad).abs().max()))
            if loss is not None:
                ldiff = max(ldiff, abs(float(loss) - float(ref_loss)))
    except ConfigError as exc:
        error = type(exc).__name__ + ": " + str(exc).replace("\n", " ")
    await transport.close()
    pipe.close()
    if error:
        say(f"RESULT {name} rank={rank} error={error}")
        return
    choices = "|".join(f"{s}:{c.hint}:{c.mode}:{','.join(map(str, c.cap))}:{c.order}"
                       for s, c in pipe.auto.choices)
    orders = "" if chooser.last is None else ",".join(
        sorted({r.candidate.order for r in chooser.last.rows}))
    best = "" if chooser.last is None else chooser.last.best.candidate.order
    gdiff, ldiff = max_all(comm, gdiff), max_all(comm, ldiff)
    say(f"RESULT {name} rank={rank} choices={choices} orders={orders} best={best} "
        f"grad_diff={gdiff:.3e} loss_diff={ldiff:.3e}")


async def main() -> None:
    await case("agree", MPI.COMM_WORLD)
    await case("differ", MPI.COMM_WORLD.Dup())
    await case("partial", MPI.COMM_WORLD.Dup())


if __name__ == "__main__":
    run(main())
