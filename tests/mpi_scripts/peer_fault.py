"""A 4-rank training run with one injected fault, for tests/test_faults_mpi.py, bench/faults and
tests/test_torchdist.py (the same script under torchrun: the transport is the launch's).

Usage: mpiexec -n 4 python tests/mpi_scripts/peer_fault.py FAULT VICTIM STEP
   or: torchrun --nproc-per-node 4 tests/mpi_scripts/peer_fault.py FAULT VICTIM STEP
FAULT = kill (SIGKILL) | stop (SIGSTOP) | raise (ValueError in the victim's forward) | none.
The victim injects it in its forward of microbatch 1 of step STEP, after printing
`FAULT rank=R t=<unix time>`; a rank whose step fails prints `DETECTED rank=R t=... type=... msg=...`
(and `PEER rank=R lost=... remote=...` for the errors that name a peer), then
aioready.launch ends the job.
"""

import os
import signal
import sys
import time

import torch

from aioready import AioreadyError, PeerLostError, StageError
from aioready.launch import run, say
from aioready.runtime.pipeline import Pipeline
from aioready.testing.helpers import make_mlp_stages, mse_loss
from aioready.transports.select import job_transport

FAULT, VICTIM, AT_STEP = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
STEPS = 4


class Faulty(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module, armed: bool) -> None:
        super().__init__()
        self.inner = inner
        self.armed = armed
        self.step = 0
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.armed and self.step == AT_STEP and self.calls == 2:
            say(f"FAULT rank={VICTIM} t={time.time():.6f}")
            if FAULT == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif FAULT == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif FAULT == "raise":
                raise ValueError(f"injected failure in stage {VICTIM}'s forward")
        return self.inner(x)


async def main() -> None:
    transport = job_transport()
    rank = transport.rank
    stage = Faulty(make_mlp_stages(4, seed=3)[rank], armed=rank == VICTIM)
    pipe = Pipeline([stage], mse_loss, microbatches=8, hint="1f1b", transport=transport)
    gen = torch.Generator().manual_seed(0)
    try:
        for step in range(STEPS):
            stage.step, stage.calls = step, 0
            x = torch.randn(16, 16, generator=gen, dtype=torch.float64)
            y = torch.randn(16, 16, generator=gen, dtype=torch.float64)
            await pipe.step(x if rank == 0 else None, y if rank == 3 else None)
            if rank == 0:
                say(f"STEP {step} done")
    except AioreadyError as exc:
        lines = f"DETECTED rank={rank} t={time.time():.6f} type={type(exc).__name__} msg={exc}"
        if isinstance(exc, (StageError, PeerLostError)):
            lines += f"\nPEER rank={rank} lost={exc.lost_rank} remote={exc.remote}"
        say(lines)  # one write: an abort from another rank cannot split the two lines
        raise
    await pipe.transport.close()
    pipe.close()


if __name__ == "__main__":
    run(main())
