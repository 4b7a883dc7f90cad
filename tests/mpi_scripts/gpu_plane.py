"""The GPU data plane's MPI steps on CPUs (2 ranks): the unique-id broadcast and the agreement.

Usage: mpiexec -n 2 python gpu_plane.py MODE
- ids: broadcast_ids with random bytes (what ncclGetUniqueId gives is 128 opaque bytes); every
  rank checks it got rank 0's bytes (a second Bcast of their hash) and prints IDS OK;
- count: rank 1 expects one id more; fail: rank 0's id maker raises; zero: it makes zeros;
- transport: MPITransport(COMM_WORLD) agrees on the plane (AIOREADY_GPU_PLANE) and logs it.
Errors are printed as "Type: message" on every rank that raised, then the rank exits 1 after a
barrier (so no rank is killed before it printed).
"""

import hashlib
import logging
import os
import sys

import numpy as np
from mpi4py import MPI

from aioready.cuda import nccl_bootstrap as boot
from aioready.errors import AioreadyError

comm = MPI.COMM_WORLD
me = comm.Get_rank()


def maker(mode: str):
    def make() -> bytes:
        if mode == "fail":
            raise RuntimeError("no NCCL here")
        return bytes(128) if mode == "zero" else os.urandom(128)
    return make


def main(mode: str) -> None:
    if mode == "transport":
        logging.basicConfig(level=logging.INFO, stream=sys.stdout)
        from aioready.transports.mpi import MPITransport
        transport = MPITransport(comm)
        print("PLANE OK", transport.gpu_plane, transport.cuda_aware, flush=True)
        return
    count = boot.num_ids(comm.Get_size()) + (mode == "count" and me == 1)
    ids = boot.broadcast_ids(comm, count, maker(mode))
    digest = np.frombuffer(hashlib.sha256(b"".join(ids)).digest(), np.uint8).copy()
    root = digest.copy()
    comm.Bcast(root, root=0)
    assert np.array_equal(root, digest) and len(ids) == count
    assert all(boot.id_to_bytes(boot.id_from_bytes(i)) == i for i in ids)
    print("IDS OK", count, flush=True)


try:
    main(sys.argv[1])
except AioreadyError as exc:
    print(f"{type(exc).__name__}: {exc}", flush=True)
    comm.Barrier()
    sys.exit(1)
