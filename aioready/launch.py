"""Running aioready scripts under mpirun or torchrun: one rank's error must stop every rank, not
hang them.

An exception that ends one rank's script leaves its peers waiting forever for messages that will
never come. `python -m aioready ...` already aborts the job on an error; for your own scripts
either run them as `mpiexec -n 4 python -m mpi4py script.py` (mpi4py aborts on any unhandled
exception), or wrap the entry point:

    from aioready.launch import run
    run(main())                      # aioready.run + MPI_Abort on error

    with abort_on_error():           # or around any block
        ...

Under MPI the abort is MPI_Abort. Under torchrun (torch.distributed initialised, mpi4py not
loaded) the failing rank prints the error and leaves at once with `os._exit`: a normal exit would
wait in gloo/NCCL teardown for peers that are themselves waiting, and torchrun ends the other
ranks as soon as one exits with an error. The runtime has already sent the error to every peer
(runtime/faults.py), so each of them fails with it too rather than with a transport timeout.

A failing rank leaves LEAVE_LINGER_S later: its exit closes its own links, and a survivor that
saw that closure before the error itself would name this rank instead of the cause: the rank
that died (for a rank that saw a peer die), or the stage that raised (for a rank that received
its error: on 4 ranks under torchrun, rank 0 once reported rank 1's closed link instead of the
StageError rank 2 had sent it, rank 1 having left at once).

`launcher()` says how this process was started (from the environment only, importing nothing);
`aioready.transports.select.job_transport` builds the matching transport from it.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import time
import traceback
import weakref
from contextlib import contextmanager
from typing import Any, Awaitable, Iterator, Mapping, TypeVar

__all__ = ["abort_on_error", "launcher", "owns_loop", "run", "run_loop", "say", "world",
           "TORCHRUN_VARS", "MPI_VARS"]

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
MPI_VARS = ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")

T = TypeVar("T")
LEAVE_LINGER_S = 0.5
"""How long a failing rank waits before leaving a torchrun job (module note)."""
ABORT_DRAIN_S = 0.1
"""How long a failing rank waits between printing its error and MPI_Abort: mpiexec forwards a
rank's output through a pipe that the abort's kill can cut before it is read, and a CI run once
lost the whole error text (an empty stderr) that way."""


def say(*parts: object) -> None:
    """print() for programs whose ranks share one stdout pipe: the line goes out in a single
    write, so lines of different ranks never interleave mid-line (print writes the text and
    the newline separately)."""
    os.write(sys.stdout.fileno(), (" ".join(str(p) for p in parts) + "\n").encode())


def launcher(environ: Mapping[str, str] | None = None) -> str | None:
    """"torchrun" (torchrun/srun+torchrun variables set), "mpi" (an MPI launcher's), else None.

    torchrun wins when both are present: torchrun inside an MPI allocation sets its own ranks.
    """
    env = os.environ if environ is None else environ
    if all(k in env for k in TORCHRUN_VARS):
        return "torchrun"
    if any(k in env for k in MPI_VARS):
        return "mpi"
    return None


def world() -> tuple[int, int]:
    """(rank, size) of MPI_COMM_WORLD if mpi4py is loaded, else of the torch.distributed world if
    it is initialised, else (0, 1); never imports mpi4py or torch."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None:
        comm = mpi.COMM_WORLD  # type: ignore[attr-defined]
        return comm.Get_rank(), comm.Get_size()
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():  # type: ignore
        return dist.get_rank(), dist.get_world_size()  # type: ignore[attr-defined]
    return 0, 1


@contextmanager
def abort_on_error(exit_code: int = 1) -> Iterator[None]:
    """On any exception, print it as "rank r of n on host: ..." and end the whole job: MPI_Abort
    under MPI, `os._exit(exit_code)` under torch.distributed (see the module's docstring).

    Outside a job (or with one rank) the exception propagates unchanged.
    """
    try:
        yield
    except Exception as exc:
        rank, size = world()
        if size <= 1:
            raise
        tb = "".join(traceback.format_exception(exc))
        print(f"rank {rank} of {size} on {socket.gethostname()}: "
              f"{type(exc).__name__}: {exc}\n{tb}", file=sys.stderr, flush=True)
        mpi = sys.modules.get("mpi4py.MPI")
        if mpi is None:
            sys.stdout.flush()
            # its own exit closes its links too, and a survivor that sees that closure before
            # the error would blame this rank: leave a moment later (the module note)
            time.sleep(LEAVE_LINGER_S)
            os._exit(exit_code)
        time.sleep(ABORT_DRAIN_S)
        mpi.COMM_WORLD.Abort(exit_code)  # type: ignore[attr-defined]
        raise


_OWN_LOOPS: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()


def owns_loop(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether `loop` was made by `aioready.run` (an entry point: the CLI, a launched script),
    not by a service that embeds a pipeline. Only on its own loop may the runtime block the
    loop thread with a task's compute (devices/cpu.py): a service's loop must keep serving."""
    return loop in _OWN_LOOPS


def run_loop(main: Awaitable[T], *, debug: bool | None = None) -> T:
    """`asyncio.run` on a uvloop loop when uvloop is installed; never changes the loop policy.

    This is `aioready.run`: the library itself never installs uvloop, only entry points do.
    """
    try:
        import uvloop
        factory: Any = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(debug=debug, loop_factory=factory) as runner:
        _OWN_LOOPS.add(runner.get_loop())
        return runner.run(main)  # type: ignore[arg-type]


def run(main: Awaitable[T], *, debug: bool | None = None) -> T:
    """`aioready.run(main)` (uvloop when installed) that ends the MPI or torchrun job on an
    error."""
    with abort_on_error():
        return run_loop(main, debug=debug)
