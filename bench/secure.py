"""Sealed against plain: SecureTransport(MPITransport) vs MPITransport, side by side (2 ranks).

    mpiexec -n 2 python -m bench.secure [--quick]

Ping-pong bandwidth at 4 MiB and 64 MiB (and one-way latency at 8 B): rank 1 echoes every
message, rank 0 times the round trips; plain and sealed repeats (sealed with the default segment
size and with one segment per message, `--segments` to choose) are interleaved so all see the
same background load, medians of per-repeat medians and their range. Writes
bench/results/secure.md (rank 0).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aioready.launch import run  # noqa: E402
from aioready.runtime.pipeline import Pipeline  # noqa: E402
from aioready.testing.helpers import make_mlp_stages, mse_loss  # noqa: E402
from aioready.transports.mpi import MPITransport  # noqa: E402
from aioready.transports.secure import (  # noqa: E402
    SEGMENT_BYTES,
    SecureTransport,
    secure_session,
)
from bench.common import other_load, write_result  # noqa: E402
from bench.transport import Echo, aio_pingpong  # noqa: E402

MPI_RANKS = 2
TIMEOUT_S = 600
SIZES = [("8 B", 8), ("4 MiB", 4 << 20), ("64 MiB", 64 << 20)]
ONE_SEGMENT = (1 << 32) - 1  # larger than any message here: the whole message at once


def iters_for(size: int, quick: bool) -> int:
    base = 200 if size <= 64 << 10 else (20 if size <= 4 << 20 else 3)
    return base if quick else base * 3


async def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # two ranks on two cores
    load_at_start = other_load()
    comm = MPI.COMM_WORLD
    key, session = bytes(range(32)), await secure_session(comm)  # the same on both ranks
    variants = {"plain": MPITransport(comm)}
    for seg in args.segments:
        for threads in (False, True) if args.threads and seg < ONE_SEGMENT else (False,):
            name = f"sealed {_mib(seg)}{', threads' if threads else ''}"
            variants[name] = SecureTransport(MPITransport(comm), key=key, session=session,
                                             segment_bytes=seg, threads=threads)
    echoes = {name: Echo(t) for name, t in variants.items()}  # type: ignore[arg-type]
    for name, t in variants.items():
        t.open(echoes[name].deliver)
    repeats = args.repeats or (3 if args.quick else 5)
    rows = []
    for label, size in SIZES:
        times: dict[str, list[float]] = {name: [] for name in variants}
        cpu: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(repeats):
            for name in variants:
                comm.Barrier()
                iters = iters_for(size, args.quick)
                c0 = time.process_time()
                got = await aio_pingpong(echoes[name], comm, size, iters)
                both = comm.allreduce(time.process_time() - c0)  # the two ranks' CPU time
                cpu[name].append(both / (2 * (iters + 2)))  # per one-way message
                if got:
                    times[name].append(statistics.median(got))
        if comm.Get_rank() == 0:
            p = statistics.median(times["plain"])
            pc = statistics.median(cpu["plain"])
            for name in variants:
                t, c = statistics.median(times[name]), statistics.median(cpu[name])
                spread = f"{min(times[name]) * 1e6:.0f}-{max(times[name]) * 1e6:.0f}"
                rows.append(f"| {label} | {name} | {t * 1e6:.0f} us | {spread} us | "
                            f"{size / t / 1e9:.2f} | {p / t:.2f} | {c * 1e6:.0f} us | "
                            f"{pc / c:.2f} |")
    for t in variants.values():
        await t.close()
    step_rows = await pipeline_steps(comm, key, session, repeats)
    cipher = cipher_alone(key) if comm.Get_rank() == 0 else ""
    if comm.Get_rank() == 0:
        body = "\n".join([
            "# SecureTransport: sealed (AES-256-GCM) vs plain MPITransport", "",
            "## Ping-pong", "",
            "| size | transport (segment) | one-way | per-repeat range | GB/s | "
            "bandwidth / plain | CPU per message | plain CPU / this CPU |",
            "|---|---|---|---|---|---|---|---|", *rows, "",
            f"{repeats} interleaved repeats; one-way = median RTT/2 (median of per-repeat "
            "medians; the range is over the repeats). A message larger than one segment is "
            "sealed one segment per loop pass while the earlier segments travel, and opened "
            "segment by segment as they arrive ('threads': in one worker thread per direction); "
            "'one segment' rows seal the whole message at once on the loop thread, as before "
            "segments. CPU per message: both ranks' process time (all threads, polling "
            "included) per one-way message, median over the repeats; on a loaded machine the "
            "bandwidth ratio tends to the CPU ratio, since every busy microsecond waits for a "
            f"core. At the start: {load_at_start}; at the end: {other_load()}.", "",
            cipher, "", "## A pipeline step", "",
            f"2 stages of one MLP block (float32, width {STEP_WIDTH}, hidden {STEP_HIDDEN}), "
            f"1F1B, {STEP_M} microbatches of {STEP_BATCH} rows: "
            f"{STEP_BATCH * STEP_WIDTH * 4 >> 10} KiB per activation and gradient message. "
            "Plain and sealed pipelines step in turn (interleaved); median step time over the "
            "steps, first two dropped.", "",
            "| transport | step | per-step range | plain / this |", "|---|---|---|---|",
            *step_rows, ""])
        print(body, flush=True)
        if not args.no_write:
            write_result("secure", body, "mpiexec -n 2 python -m bench.secure" + (
                " --quick" if args.quick else "") + (
                f" --repeats {args.repeats}" if args.repeats else "") + (
                " --segments " + ",".join(f"{seg / (1 << 20):g}" for seg in args.segments)) + (
                " --threads" if args.threads else ""))


STEP_WIDTH, STEP_HIDDEN, STEP_BATCH, STEP_M = 128, 32, 2048, 8  # 1 MiB messages


def cipher_alone(key: bytes) -> str:
    """AES-256-GCM alone, one thread, best of 5: in cache (4 MiB) and beyond it (64 MiB)."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    aead, parts = AESGCM(key), []
    for label, size in SIZES[1:]:
        plain = np.ones(size, np.uint8)
        out = np.empty(size + 16, np.uint8)
        best = min(_timed(lambda: aead.encrypt_into(bytes(12), plain, b"", out))
                   for _ in range(5))
        copy = min(_timed(lambda: np.copyto(out[:size], plain)) for _ in range(5))
        parts.append(f"{label}: {size / best / 1e9:.1f} GB/s (memcpy {size / copy / 1e9:.1f})")
    return "The cipher alone on rank 0 (encrypt_into, best of 5): " + "; ".join(parts) + "."


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


async def pipeline_steps(comm: Any, key: bytes, session: bytes, repeats: int) -> list[str]:
    """Step times of the same 2-stage pipeline over plain and sealed MPITransport."""
    rank = comm.Get_rank()
    pipes = {}
    for name in ("plain", "sealed"):
        inner = MPITransport(comm)
        transport = inner if name == "plain" else SecureTransport(inner, key=key,
                                                                  session=session)
        stage = make_mlp_stages(2, width=STEP_WIDTH, hidden=STEP_HIDDEN, blocks_per_stage=1,
                                dtype=torch.float32)[rank]
        pipes[name] = Pipeline([stage], mse_loss, microbatches=STEP_M, hint="1f1b",
                               transport=transport)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(STEP_BATCH * STEP_M, STEP_WIDTH, generator=gen)
    times: dict[str, list[float]] = {name: [] for name in pipes}
    for i in range(2 + 2 * repeats):
        for name, pipe in pipes.items():
            comm.Barrier()
            t0 = time.perf_counter()
            await pipe.step(x if rank == 0 else None, x if rank == 1 else None)
            if i >= 2:
                times[name].append(time.perf_counter() - t0)
    for pipe in pipes.values():
        await pipe.transport.close()
        pipe.close()
    p = statistics.median(times["plain"])
    return [f"| {name} | {statistics.median(t) * 1e3:.1f} ms | {min(t) * 1e3:.1f}-"
            f"{max(t) * 1e3:.1f} ms | {p / statistics.median(t):.2f} |"
            for name, t in times.items()]


def _mib(seg: int) -> str:
    return "one segment" if seg >= ONE_SEGMENT else f"{seg >> 20} MiB segments"


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="SecureTransport vs plain MPITransport (2 ranks)")
    p.add_argument("--quick", action="store_true", help="fewer iterations and repeats")
    p.add_argument("--no-write", action="store_true", help="print only")
    p.add_argument("--threads", action="store_true",
                   help="also seal and open segments in worker threads")
    p.add_argument("--repeats", type=int, default=0, help="interleaved repeats (default 5)")
    p.add_argument("--segments", type=lambda v: [int(float(x) * (1 << 20)) for x in
                                                 v.split(",")],
                   default=[SEGMENT_BYTES, ONE_SEGMENT],
                   help="segment sizes in MiB to compare, comma separated (default: the "
                   "transport's default and one segment per message)")
    return p.parse_args()


if __name__ == "__main__":
    run(main(parse()))
