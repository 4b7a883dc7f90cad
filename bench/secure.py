"""Sealed against plain: SecureTransport(MPITransport) vs MPITransport, side by side (2 ranks).

    mpiexec -n 2 python -m bench.secure [--quick]

Ping-pong bandwidth at 4 MiB and 64 MiB (and one-way latency at 8 B): rank 1 echoes every
message, rank 0 times the round trips; plain and sealed repeats are interleaved so both see the
same background load, medians of per-repeat medians. Sealing costs one AES-256-GCM pass on each
side, on the loop thread. Writes bench/results/secure.md (rank 0).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aioready.launch import run  # noqa: E402
from aioready.transports.mpi import MPITransport  # noqa: E402
from aioready.transports.secure import SecureTransport, secure_session  # noqa: E402
from bench.common import write_result  # noqa: E402
from bench.transport import Echo, aio_pingpong  # noqa: E402

MPI_RANKS = 2
TIMEOUT_S = 600
SIZES = [("8 B", 8), ("4 MiB", 4 << 20), ("64 MiB", 64 << 20)]


def iters_for(size: int, quick: bool) -> int:
    base = 200 if size <= 64 << 10 else (20 if size <= 4 << 20 else 3)
    return base if quick else base * 3


async def main(args: argparse.Namespace) -> None:
    comm = MPI.COMM_WORLD
    plain = MPITransport(comm)
    sealed = SecureTransport(MPITransport(comm), key=bytes(range(32)),  # the same on both
                             session=await secure_session(comm))
    echoes = {"plain": Echo(plain), "sealed": Echo(sealed)}  # type: ignore[arg-type]
    for name, t in (("plain", plain), ("sealed", sealed)):
        t.open(echoes[name].deliver)
    repeats = 3 if args.quick else 5
    rows = []
    for label, size in SIZES:
        times: dict[str, list[float]] = {"plain": [], "sealed": []}
        for _ in range(repeats):
            for name in ("plain", "sealed"):
                comm.Barrier()
                got = await aio_pingpong(echoes[name], comm, size, iters_for(size, args.quick))
                if got:
                    times[name].append(statistics.median(got))
        if comm.Get_rank() == 0:
            p, s = statistics.median(times["plain"]), statistics.median(times["sealed"])
            rows.append(f"| {label} | {p * 1e6:.0f} us | {s * 1e6:.0f} us | "
                        f"{size / p / 1e9:.2f} | {size / s / 1e9:.2f} | {p / s:.2f} |")
    await plain.close()
    await sealed.close()
    if comm.Get_rank() == 0:
        body = "\n".join([
            "# SecureTransport: sealed (AES-256-GCM) vs plain MPITransport", "",
            "| size | plain one-way | sealed one-way | plain GB/s | sealed GB/s | "
            "sealed / plain bandwidth |", "|---|---|---|---|---|---|", *rows, "",
            f"{repeats} interleaved repeats; one-way = median RTT/2. Sealed bandwidth is bound "
            "by one AEAD pass per side on the loop thread (encrypt_into / decrypt_into, no "
            "extra copy for a single tensor).", ""])
        print(body, flush=True)
        if not args.no_write:
            write_result("secure", body, f"mpiexec -n 2 python -m bench.secure"
                         f"{' --quick' if args.quick else ''}")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="SecureTransport vs plain MPITransport (2 ranks)")
    p.add_argument("--quick", action="store_true", help="fewer iterations and repeats")
    p.add_argument("--no-write", action="store_true", help="print only")
    return p.parse_args()


if __name__ == "__main__":
    run(main(parse()))
