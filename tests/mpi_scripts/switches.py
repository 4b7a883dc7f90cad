"""Switches that decide the MPI transport's collective set-up, set differently on the ranks.

Usage: mpiexec -n 2 python tests/mpi_scripts/switches.py VARIABLE
Rank 1 sets VARIABLE=0 in its own environment, rank 0 leaves it on; each rank then makes an
MPITransport and prints one RESULT line: the error's class and text, or "made" if none came.
Without the check a rank would wait in a collective the other skips (the test's timeout).
"""

import asyncio
import os
import sys

from mpi4py import MPI

from aioready.errors import ConfigError
from aioready.transports.mpi import MPITransport

comm = MPI.COMM_WORLD
if comm.Get_rank() == 1:
    os.environ[sys.argv[1]] = "0"
try:
    asyncio.run(MPITransport(comm).close())
    line = f"RESULT {comm.Get_rank()} made"
except ConfigError as exc:
    line = f"RESULT {comm.Get_rank()} ConfigError {exc}".replace("\n", " | ")
sys.stdout.write(line + "\n")  # one write: the two ranks' lines do not interleave
sys.stdout.flush()
