"""Running aioready scripts under mpirun: one rank's error must stop every rank, not hang them.

An exception that ends one rank's script leaves its peers waiting forever for messages that will
never come. `python -m aioready ...` already aborts the MPI job on an error; for your own scripts
either run them as `mpiexec -n 4 python -m mpi4py script.py` (mpi4py aborts on any unhandled
exception), or wrap the entry point:

    from aioready.runtime.launch import run
    run(main())                      # aioready.run + MPI_Abort on error

    with abort_on_error():           # or around any block
        ...
"""

from __future__ import annotations

import os
import socket
import sys
import traceback
from contextlib import contextmanager
from typing import Awaitable, Iterator, TypeVar

__all__ = ["abort_on_error", "run", "say", "world"]

T = TypeVar("T")


def say(*parts: object) -> None:
    """print() for programs whose ranks share one stdout pipe: the line goes out in a single
    write, so lines of different ranks never interleave mid-line (print writes the text and
    the newline separately)."""
    os.write(sys.stdout.fileno(), (" ".join(str(p) for p in parts) + "\n").encode())


def world() -> tuple[int, int]:
    """(rank, size) of MPI_COMM_WORLD if mpi4py is loaded, else (0, 1); never imports mpi4py."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        return 0, 1
    comm = mpi.COMM_WORLD  # type: ignore[attr-defined]
    return comm.Get_rank(), comm.Get_size()


@contextmanager
def abort_on_error(exit_code: int = 1) -> Iterator[None]:
    """On any exception, print it as "rank r of n on host: ..." and MPI_Abort the whole job.

    Outside MPI (or with one rank) the exception propagates unchanged.
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
        sys.modules["mpi4py.MPI"].COMM_WORLD.Abort(exit_code)  # type: ignore[attr-defined]
        raise


def run(main: Awaitable[T], *, debug: bool | None = None) -> T:
    """`aioready.run(main)` (uvloop when installed) that aborts the MPI job on an error."""
    from .. import run as run_loop
    with abort_on_error():
        return run_loop(main, debug=debug)
