"""hint="auto" over MPITransport: every rank switches identically, gradients stay exact.

Usage: mpiexec -n R python tests/mpi_scripts/auto.py STEPS [MEMORY]
With MEMORY (like "2x") it chooses within that byte budget instead of cap="2x" (microbatches of
unequal rows, the same batch every step), and each rank also prints the byte budgets of the
choices and "over=": the most its peak bytes went over the gate's bound in a step after the
first (negative: within it). A chosen byte budget may be below the heaviest microbatch's bytes
(a budget is factor x the mean): that microbatch then runs alone, so the bound is the larger.
Each rank runs STEPS steps of Pipeline(hint=AutoHint(retune_every=1)) on its stage of a float64
MLP (split backward, M = 2R), zeroing gradients between steps and comparing them with the
unsplit model's for that step's batch; rank 0 chooses from the gathered spans and broadcasts.
Every rank prints "RESULT rank=r choices=... grad_diff=... loss_diff=...".
"""

import sys

import numpy as np
import torch
from mpi4py import MPI

from aioready.launch import run, say
from aioready.runtime.autotune import AutoHint
from aioready.runtime.pipeline import Pipeline
from aioready.testing.helpers import make_mlp_stages, mse_loss, reference_step
from aioready.transports.mpi import MPITransport

WIDTH = 16


def batch(M: int, seed: int, sized: bool = False):
    gen = torch.Generator().manual_seed(seed)
    rows = [1 + (5 * m) % 7 if sized else 4 for m in range(M)]
    xs = [torch.randn(2, r, WIDTH, generator=gen, dtype=torch.float64) for r in rows]
    ys = [torch.randn(2, r, WIDTH, generator=gen, dtype=torch.float64) for r in rows]
    return xs, ys


def max_all(comm, value: float) -> float:
    out = np.zeros(1)
    comm.Allreduce(np.array([value]), out, op=MPI.MAX)
    return float(out[0])


async def main() -> None:
    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    steps, S, M = int(sys.argv[1]), size, 2 * size
    memory = sys.argv[2] if len(sys.argv) > 2 else None
    full = make_mlp_stages(S, width=WIDTH, seed=7)
    transport = MPITransport(comm)
    pipe = Pipeline([full[rank]], mse_loss, microbatches=M, transport=transport,
                    split_backward=True, cap=None if memory else "2x", memory=memory,
                    hint=AutoHint(retune_every=1, comm=comm))
    gdiff = ldiff = 0.0
    names, over = [], -float("inf")
    for step in range(steps):
        xs, ys = batch(M, seed=0 if memory else step, sized=memory is not None)
        rt = pipe.runtimes[0]
        budget, policy, peak = rt.memory, rt._policy, pipe.hint.peak(rank)
        for p in full[rank].parameters():
            p.grad = None
        loss = await pipe.step(xs if rank == 0 else None, ys if rank == S - 1 else None)
        if step and memory and budget is not None:
            # the gate's bound: its budget; a microbatch heavier than the budget runs alone
            # rather than hang the step; under the reservation the order's own forwards pass
            # it (docs/policy.md "Memory budgets"), at most its peak count of them
            report = pipe.last_step
            heaviest = max(b for b, _ in report.activation_bytes.values())
            bound = max(budget.bytes, heaviest) + (peak * heaviest if policy == "reserve" else 0)
            over = max(over, report.peak_activation_bytes[rank] - bound)
        names.append(f"{pipe.hint.name}:{pipe.mode}:{','.join(str(rt.cap) for rt in pipe.runtimes)}")
        ref_loss, ref = reference_step(make_mlp_stages(S, width=WIDTH, seed=7), mse_loss, xs, ys)
        for p, q in zip(full[rank].parameters(), ref[rank].parameters()):
            gdiff = max(gdiff, float((p.grad - q.grad).abs().max()))
        if loss is not None:
            ldiff = max(ldiff, abs(float(loss) - float(ref_loss)))
    await transport.close()
    pipe.close()
    choices = "|".join(f"{s}:{c.hint}:{c.mode}:{','.join(map(str, c.cap))}"
                       for s, c in pipe.auto.choices)
    gdiff, ldiff = max_all(comm, gdiff), max_all(comm, ldiff)
    last, gate = pipe.auto.choices[-1][1], pipe.runtimes[0].memory
    applied = (gate is None) if last.memory is None else (
        (gate.bytes, gate.count) == (last.memory[rank], last.cap[rank]))
    bytes_of = "" if memory is None else (f" applied={applied} over={over:g} memory=" + "|".join(
        ",".join(map(str, c.memory or ("none",))) for _, c in pipe.auto.choices))
    say(f"RESULT rank={rank} choices={choices} caps={'/'.join(names)} "
        f"grad_diff={gdiff:.3e} loss_diff={ldiff:.3e}{bytes_of}")


if __name__ == "__main__":
    run(main())
