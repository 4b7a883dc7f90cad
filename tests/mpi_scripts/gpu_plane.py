"""The GPU data plane's MPI steps on CPUs (2 ranks): the unique-id broadcast and the agreement.

Usage: mpiexec -n 2 python gpu_plane.py MODE[=PLANE] [MODE[=PLANE] ...]
- ids: broadcast_ids with random bytes (what ncclGetUniqueId gives is 128 opaque bytes); every
  rank checks it got rank 0's bytes (a second Bcast of their hash) and prints IDS OK;
- count: rank 1 expects one id more; fail: rank 0's id maker raises; zero: it makes zeros;
- transport: MPITransport(COMM_WORLD) agrees on the plane (AIOREADY_GPU_PLANE, set to PLANE for
  that token, unset without one) and logs it.
Every line a token prints, its log lines included, starts with "[TOKEN] ". An error is printed as
"[TOKEN] Type: message" on every rank that raised, the ranks meet at a barrier, and the next token
runs: one launch (each rank's imports paid once) for every mode.
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


class _Token(logging.Filter):
    """Puts the running token before each log line."""
    token = ""

    def filter(self, record: logging.LogRecord) -> bool:
        record.token = self.token
        return True


def main(mode: str, say) -> None:
    if mode == "transport":
        from aioready.transports.mpi import MPITransport
        transport = MPITransport(comm)
        say("PLANE OK", transport.gpu_plane, transport.cuda_aware)
        return
    count = boot.num_ids(comm.Get_size()) + (mode == "count" and me == 1)
    ids = boot.broadcast_ids(comm, count, maker(mode))
    digest = np.frombuffer(hashlib.sha256(b"".join(ids)).digest(), np.uint8).copy()
    root = digest.copy()
    comm.Bcast(root, root=0)
    assert np.array_equal(root, digest) and len(ids) == count
    assert all(boot.id_to_bytes(boot.id_from_bytes(i)) == i for i in ids)
    say("IDS OK", count)


def say(token: str, *words: object) -> None:
    """One line in one write: the two ranks' lines never interleave or lose their prefix."""
    line = " ".join([f"[{token}]", *map(str, words)]).replace("\n", " | ")
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


TOKEN = _Token()
handler = logging.StreamHandler(sys.stdout)
handler.setFormatter(logging.Formatter("[%(token)s] %(message)s"))
handler.addFilter(TOKEN)
logging.basicConfig(level=logging.INFO, handlers=[handler])
for token in sys.argv[1:]:
    mode, _, plane = token.partition("=")
    TOKEN.token = token
    if plane:
        os.environ["AIOREADY_GPU_PLANE"] = plane
    else:
        os.environ.pop("AIOREADY_GPU_PLANE", None)
    try:
        main(mode, lambda *words, t=token: say(t, *words))
    except AioreadyError as exc:
        say(token, f"{type(exc).__name__}: {exc}")
    comm.Barrier()
