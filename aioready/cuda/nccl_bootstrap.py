"""NCCL unique ids over MPI: made on rank 0, broadcast as bytes, checked on every rank.

An NCCL communicator starts from a 128-byte `ncclUniqueId` that every member must hold. CuPy
returns it as a tuple of 128 C `char`s (signed on x86, unsigned on Arm and POWER) and takes the
same tuple back, so the id travels as plain bytes (`id_to_bytes`, `id_from_bytes`): an MPI Bcast
of a uint8 buffer, never a pickled object from the network.

`broadcast_ids` sends a block of ids at once (the data plane needs one per communicator, see
`pair_index`), preceded by their count, and fails on every rank, never on one alone (a rank that
raised while the others went on into NCCL's init would leave them waiting forever):

- a rank expecting another number of ids (a different world, a different plane layout) is a
  ConfigError naming both counts;
- after the broadcast every rank compares a SHA-256 of the block with every other rank's; any
  difference is a ProtocolError.

Nothing here imports CuPy or mpi4py: `make_id` is any callable returning 128 bytes, and `comm`
any mpi4py communicator, so tests run it under `mpiexec -n 2` on CPUs with random bytes.
"""

from __future__ import annotations

import hashlib
import platform
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import ConfigError, ProtocolError

__all__ = ["UNIQUE_ID_BYTES", "CHAR_SIGNED", "id_to_bytes", "id_from_bytes", "num_ids",
           "pair_index", "broadcast_ids"]

UNIQUE_ID_BYTES = 128
# C `char` is signed on x86 and unsigned on Arm, POWER and s390x (their ABIs)
CHAR_SIGNED = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")


def id_to_bytes(uid: Sequence[int]) -> bytes:
    """CuPy's `get_unique_id()` tuple (signed or unsigned chars) as 128 bytes."""
    if len(uid) != UNIQUE_ID_BYTES:
        raise ProtocolError("an NCCL unique id has the wrong length",
                            expected=f"{UNIQUE_ID_BYTES} chars", got=len(uid))
    return bytes(int(c) & 0xFF for c in uid)


def id_from_bytes(raw: bytes, *, signed: bool = CHAR_SIGNED) -> tuple[int, ...]:
    """128 bytes as the tuple `NcclCommunicator(ndev, commId, rank)` takes on this machine."""
    if len(raw) != UNIQUE_ID_BYTES:
        raise ProtocolError("an NCCL unique id has the wrong length",
                            expected=f"{UNIQUE_ID_BYTES} bytes", got=len(raw))
    return tuple(b - 256 if signed and b > 127 else b for b in raw)


def num_ids(size: int) -> int:
    """Ids the data plane of `size` ranks needs: the world, then each direction of each pair."""
    return 1 + size * (size - 1)


def pair_index(src: int, dst: int, size: int) -> int:
    """Index of the id of the one-way communicator `src -> dst` (0 is the world's)."""
    if not (0 <= src < size and 0 <= dst < size) or src == dst:
        raise ConfigError("no one-way NCCL communicator for this pair",
                          expected=f"two different ranks in 0..{size - 1}", got=(src, dst))
    return 1 + src * (size - 1) + (dst if dst < src else dst - 1)


def _all_agree(comm: Any, flag: bool) -> bool:
    """True when no rank raised `flag`: a MAX all-reduce of int64s, so every rank learns it."""
    out = np.zeros(1, np.int64)
    comm.Allreduce(np.array([int(flag)], np.int64), out, op=_max(comm))
    return not out[0]


def _max(comm: Any) -> Any:
    import mpi4py.MPI as MPI  # the communicator is an mpi4py one: mpi4py is loaded already
    return MPI.MAX


def _fill(blob: np.ndarray, count: int, make_id: Callable[[], bytes]) -> str:
    """Write `count` ids into `blob`; what went wrong, or ''."""
    try:
        raw = b"".join(make_id() for _ in range(count))
    except Exception as exc:  # told to every rank, so none is left waiting in a Bcast
        return f"making the ids failed: {type(exc).__name__}: {exc}"
    if len(raw) != blob.size:
        return f"make_id() gave {len(raw)} bytes for {count} ids"
    blob[:] = np.frombuffer(raw, np.uint8)
    return ""


def broadcast_ids(comm: Any, count: int, make_id: Callable[[], bytes], *,
                  root: int = 0) -> list[bytes]:
    """`count` ids made on `root` by `make_id()`, as bytes, identical on every rank."""
    me = comm.Get_rank()
    head = np.array([count, count * UNIQUE_ID_BYTES], np.int64)
    blob = np.zeros(count * UNIQUE_ID_BYTES, np.uint8)
    bad = ""
    if me == root:
        bad = _fill(blob, count, make_id)
    comm.Bcast(head, root=root)
    if me != root and int(head[0]) != count:
        bad = f"rank {root} sent {int(head[0])} ids, this rank expected {count}"
    if not _all_agree(comm, bool(bad)):
        raise ConfigError("the ranks could not share the NCCL unique ids", rank=me,
                          expected=f"{count} unique ids of {UNIQUE_ID_BYTES} bytes on every "
                          "rank", got=bad or "a mismatch on another rank",
                          fix="build the data plane at the same point on every rank, over "
                          "the same communicator")
    comm.Bcast(blob, root=root)
    digest = np.frombuffer(hashlib.sha256(blob.tobytes()).digest(), np.uint8)
    digests = np.empty((comm.Get_size(), digest.size), np.uint8)
    comm.Allgather(digest, digests)
    differ = [r for r in range(comm.Get_size()) if not np.array_equal(digests[r], digests[root])]
    if differ:
        raise ProtocolError("NCCL unique ids differ between ranks after their broadcast",
                            rank=me, expected=f"rank {root}'s ids on every rank",
                            got=f"other ids on ranks {differ}")
    ids = [blob[i * UNIQUE_ID_BYTES:(i + 1) * UNIQUE_ID_BYTES].tobytes() for i in range(count)]
    if any(not any(uid) for uid in ids):
        raise ProtocolError("an NCCL unique id is all zeros", rank=me,
                            expected="ids from ncclGetUniqueId", got="an uninitialised id")
    return ids
