"""`aioready train`'s loop with one rank stopping itself (SIGSTOP) outside `pipe.step`.

Usage: mpiexec -n N python tests/mpi_scripts/train_stop.py WHERE VICTIM STEP CKPT_DIR
WHERE = barrier (before the start barrier) | gather (in the report gather of step STEP) |
checkpoint (in its checkpoint write after step STEP). The victim prints `STOPPING rank=R` first;
a rank whose run fails prints `DETECTED rank=R type=... lost=... msg=...`, then aioready.launch
aborts the job (which also ends the stopped rank).
"""

import os
import signal
import sys

from aioready import AioreadyError, PeerLostError
from aioready.cli import trainer
from aioready.cli.train import mpi_comm
from aioready.launch import run, say
from aioready.runtime import checkpoint
from aioready.telemetry import gather

WHERE, VICTIM, AT_STEP, CKPT = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
comm = mpi_comm()
rank = comm.Get_rank()


def stop() -> None:
    say(f"STOPPING rank={rank} where={WHERE}")
    os.kill(os.getpid(), signal.SIGSTOP)


def patch() -> None:
    if WHERE == "barrier":
        real_barrier = gather.barrier

        async def barrier(comm):  # type: ignore[no-untyped-def]
            stop()
            await real_barrier(comm)
        gather.barrier = barrier
    elif WHERE == "gather":
        real_gather = gather.gather_reports

        async def gather_reports(reports, comm, **kw):  # type: ignore[no-untyped-def]
            if reports[0].step == AT_STEP:
                stop()
            return await real_gather(reports, comm, **kw)
        gather.gather_reports = gather_reports
    elif WHERE == "checkpoint":
        real_save = checkpoint.save_checkpoint

        def save_checkpoint(directory, pipe, *a, **kw):  # type: ignore[no-untyped-def]
            if pipe.step_index == AT_STEP + 1:
                stop()
            return real_save(directory, pipe, *a, **kw)
        checkpoint.save_checkpoint = save_checkpoint
    else:
        raise SystemExit(f"unknown WHERE {WHERE!r}")


async def main() -> None:
    if rank == VICTIM:
        patch()
    cfg = trainer.TrainConfig(stages=comm.Get_size(), microbatches=2, steps=AT_STEP + 2,
                              task_ms=0, batch=1, seq=4, dim=8, heads=1, vocab=16,
                              checkpoint_dir=os.path.join(CKPT, str(rank)))
    try:
        await trainer.train(cfg, comm=comm)
    except AioreadyError as exc:
        lost = exc.lost_rank if isinstance(exc, PeerLostError) else None
        say(f"DETECTED rank={rank} type={type(exc).__name__} lost={lost} msg={exc}")
        raise
    say(f"FINISHED rank={rank}")


if __name__ == "__main__":
    run(main())
