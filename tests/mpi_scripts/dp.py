"""Pipeline x data parallel (x tensor parallel) over MPI vs one unsplit model on the whole batch.

Usage: mpiexec -n R python tests/mpi_scripts/dp.py TP DP CASE [CASE ...]
CASE = hint:mode:split. PP = R / (TP * DP). Every rank builds the same full model from a fixed
seed; replica d takes microbatches d*M .. d*M+M-1 of a batch of DP*M; each case trains 3 steps
with SGD, and the reference (every stage, every microbatch, one process) does the same. Every task
is followed by a random delay drawn per world rank, so replicas finish their stages in different
orders. World rank 0 prints `RESULT case loss_diff= grad_diff= loss_seen= reductions=
overlapped=`: the most buckets a rank reduced, and the fewest chunk reductions a rank started
while it still had a task of the step to start (interleaved placements: one per step at least).
"""

import random
import sys

import numpy as np
import torch
from mpi4py import MPI

from aioready.devices.cpu import CPUDevice
from aioready.devices.delayed import DelayedDevice
from aioready.errors import ConfigError
from aioready.launch import run, say
from aioready.runtime.pipeline import Pipeline
from aioready.schedulers import HINTS, make_hint
from aioready.testing.helpers import make_mlp_stages, mse_loss, reference_step
from aioready.tp.grid import ProcessGrid

WIDTH, STEPS, LR = 16, 3, 0.05


def batch(n: int, step: int) -> tuple[list, list]:
    gen = torch.Generator().manual_seed(1000 + step)
    xs = [torch.randn(2, 3, WIDTH, generator=gen, dtype=torch.float64) for _ in range(n)]
    ys = [torch.randn(2, 3, WIDTH, generator=gen, dtype=torch.float64) for _ in range(n)]
    return xs, ys


def max_all(comm, value: float) -> float:
    out = np.zeros(1)
    comm.Allreduce(np.array([value]), out, op=MPI.MAX)
    return float(out[0])


def build(comms, tp: int, S: int, seed: int):
    """(this rank's modules by stage, full reference stages, a grad-diff function, device)."""
    world_rank = comms.world.Get_rank()
    rng = random.Random(f"{seed}/{world_rank}")

    def delay(info) -> float:
        return rng.uniform(0.0, 2e-3)

    inner = CPUDevice(f"rank{world_rank}")
    if tp == 1:
        full = make_mlp_stages(S, width=WIDTH, seed=seed)
        ref = make_mlp_stages(S, width=WIDTH, seed=seed)

        def diff(copies, stages):
            return max(float((p.grad - q.grad).abs().max()) for s in stages
                       for p, q in zip(full[s].parameters(), copies[s].parameters()))
        return full, ref, diff, DelayedDevice(inner, delay)
    from aioready.tp.collectives import MPITPComm, TPDevice
    from aioready.tp.layers import make_tp_mlp_stages, max_tp_grad_diff
    tpcomm = MPITPComm(comms.tp, timeout=20.0)
    ref, shards = make_tp_mlp_stages(S, tpcomm, width=WIDTH, seed=seed)

    def diff(copies, stages):
        return max_tp_grad_diff([copies[s] for s in stages], [shards[s] for s in stages], tpcomm)
    return shards, ref, diff, TPDevice(DelayedDevice(inner, delay), tpcomm)


async def one_case(tp: int, dp: int, case: str, seed: int) -> None:
    hint, mode, split = case.split(":")
    split_b = split == "1"
    world = MPI.COMM_WORLD
    grid = ProcessGrid.for_world(world.Get_size(), tp=tp, dp=dp)
    comms = grid.split()
    c = comms.coords
    S = grid.pp_size * HINTS[hint].chunks
    M = 2 * grid.pp_size
    modules, ref, diff, device = build(comms, tp, S, seed)
    order = make_hint(hint, num_stages=S, num_ranks=grid.pp_size, num_microbatches=M,
                      split_backward=split_b)
    mine = list(order.placement.stages_of(c.pp_rank))
    pipe = Pipeline([modules[s] for s in mine], mse_loss, microbatches=M, hint=hint, mode=mode,
                    split_backward=split_b, device=device,
                    grid=comms if tp > 1 else ProcessGrid(pp_size=grid.pp_size, dp_size=dp))
    opt = torch.optim.SGD([p for s in mine for p in modules[s].parameters()], lr=LR)
    ref_opt = torch.optim.SGD([p for s in ref for p in s.parameters()], lr=LR)
    gdiff = ldiff = 0.0
    seen = early = 0
    for step in range(STEPS):
        xs, ys = batch(dp * M, step)
        part = slice(c.dp * M, (c.dp + 1) * M)
        loss = await pipe.step(xs[part] if 0 in mine else None,
                               ys[part] if S - 1 in mine else None)
        report = pipe.last_step
        last_start = max(span.start for span in report.spans)
        early += sum(1 for _, start, _ in pipe.grad_reducer.spans
                     if report.start <= start < last_start)
        ref_loss, copies = reference_step(ref, mse_loss, xs, ys)
        gdiff = max(gdiff, diff(copies, mine))
        if loss is not None:
            seen += 1
            ldiff = max(ldiff, abs(float(loss) - float(ref_loss)))
        for p, q in zip([p for s in ref for p in s.parameters()],
                        [q for s in copies for q in s.parameters()]):
            p.grad = q.grad
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
    reductions = pipe.grad_reducer.num_buckets if pipe.grad_reducer is not None else 0
    await pipe.transport.close()
    if pipe.grid.coordinator is not None:
        await pipe.grid.coordinator.transport.close()
    pipe.close()
    gdiff, ldiff = max_all(world, gdiff), max_all(world, ldiff)
    seen = max_all(world, float(seen))
    reductions = max_all(world, float(reductions))
    early = -max_all(world, -float(early))
    if world.Get_rank() == 0:
        say(f"RESULT {case} loss_diff={ldiff:.3e} grad_diff={gdiff:.3e} loss_seen={int(seen)} "
            f"reductions={int(reductions)} overlapped={int(early)}")


def grid_errors() -> None:
    """A grid that does not fit the world is refused on every rank, before any collective."""
    world = MPI.COMM_WORLD
    texts = []
    for make in (lambda: Pipeline([torch.nn.Linear(2, 2)], mse_loss, microbatches=2,
                                  grid=ProcessGrid(pp_size=3, dp_size=2)),
                 lambda: ProcessGrid.for_world(world.Get_size(), dp=3)):
        try:
            make()
            texts.append("accepted")
        except ConfigError as exc:
            texts.append(str(exc).replace(" ", "_").replace("\n", "_"))
    if world.Get_rank() == 0:
        say("RESULT grid_errors " + " ".join(f"error{i}={t}" for i, t in enumerate(texts)))


async def main() -> None:
    tp, dp = int(sys.argv[1]), int(sys.argv[2])
    for i, case in enumerate(sys.argv[3:]):
        if case == "grid_errors":
            grid_errors()
        else:
            await one_case(tp, dp, case, seed=100 + i)
        MPI.COMM_WORLD.Barrier()


if __name__ == "__main__":
    run(main())
