"""TorchDistTransport against raw torch.distributed point-to-point, side by side in one run.

    python -m bench.transport_torch [--quick]        (launches itself under torchrun, 2 ranks)
    python -m bench transport --backend gloo         (the same, through the runner)

Ping-pong one-way latency (RTT/2) at 8 B and 64 KiB and bandwidth at 4 MiB and 64 MiB over gloo
(CPU): raw blocking `isend(...).wait()` / `irecv(...).wait()` of a reused tensor vs
`TorchDistTransport.send_nowait` of a tensor echoed back, awaited on the event loop (slot
header, waiter threads, delivery). Repeats are interleaved (both columns see the same load);
medians of per-repeat medians. Goals (issue: the torch.distributed backend): aioready / raw
<= 1.5 at 64 KiB, raw / aioready bandwidth >= 0.9 at 64 MiB. Writes
bench/results/transport_torch.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import median, write_result  # noqa: E402

SIZES = [("8 B", 8), ("64 KiB", 64 << 10), ("4 MiB", 4 << 20), ("64 MiB", 64 << 20)]
TIMEOUT_S = 900


def iters_for(size: int, quick: bool) -> int:
    base = 200 if size <= 64 << 10 else (20 if size <= 4 << 20 else 3)
    return base if quick else base * 4


def raw_pingpong(dist, torch, size: int, iters: int) -> list[float]:
    buf = torch.zeros(size, dtype=torch.uint8)
    rank = dist.get_rank()
    peer = 1 - rank
    out = []
    for i in range(iters + 2):
        t0 = time.perf_counter()
        if rank == 0:
            dist.isend(buf, peer).wait()
            dist.irecv(buf, peer).wait()
        else:
            dist.irecv(buf, peer).wait()
            dist.isend(buf, peer).wait()
        if i >= 2:
            out.append((time.perf_counter() - t0) / 2)
    return out


class Echo:
    """Rank 1 sends every message straight back; rank 0 awaits each reply."""

    def __init__(self, transport) -> None:
        self.t = transport
        self.fut: asyncio.Future | None = None
        self.count = self.expect = 0
        self.done: asyncio.Future | None = None

    def deliver(self, msg) -> None:
        if self.t.rank == 1:
            self.t.send_nowait(0, msg)
            self.count += 1
            if self.count == self.expect and self.done is not None:
                self.done.set_result(None)
        elif self.fut is not None:
            self.fut.set_result(msg)


async def aio_pingpong(echo: Echo, dist, torch, size: int, iters: int) -> list[float]:
    from aioready.transports.base import Message, MessageKind
    loop = asyncio.get_running_loop()
    out: list[float] = []
    if echo.t.rank == 1:
        echo.count, echo.expect, echo.done = 0, iters + 2, loop.create_future()
        dist.barrier()
        await echo.done
        await echo.t.wait_sent()
        return out
    tensor = torch.zeros(size, dtype=torch.uint8)
    dist.barrier()
    for i in range(iters + 2):
        echo.fut = loop.create_future()
        t0 = time.perf_counter()
        echo.t.send_nowait(1, Message(0, MessageKind.ACTIVATION, 1, i, (tensor,)))
        reply = await echo.fut
        if i >= 2:
            out.append((time.perf_counter() - t0) / 2)
        tensor = reply.tensors[0]
    await echo.t.wait_sent()
    return out


async def measure(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from aioready.transports.torchdist import TorchDistTransport
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    transport = TorchDistTransport()
    echo = Echo(transport)
    transport.open(echo.deliver)
    repeats = 3 if args.quick else 5
    rows = []
    for label, size in [(lb, sz) for lb, sz in SIZES if not args.sizes or lb in args.sizes]:
        n = iters_for(size, args.quick)
        raw, aio = [], []
        for _ in range(repeats):
            dist.barrier()
            raw.append(median(raw_pingpong(dist, torch, size, n)))
            times = await aio_pingpong(echo, dist, torch, size, n)
            if times:
                aio.append(median(times))
        if dist.get_rank() == 0:
            rows.append((label, size, median(raw), median(aio), n, repeats))
    await transport.close()
    if dist.get_rank() == 0:
        report(args, rows, torch.__version__)
    dist.destroy_process_group()


def report(args: argparse.Namespace, rows: list, version: str) -> None:
    lines = ["# Transport over torch.distributed (gloo): TorchDistTransport vs raw isend/irecv",
             "", f"torch {version}, 2 ranks on one host (loopback TCP).", "",
             "| size | raw one-way | aioready one-way | aioready / raw | raw GB/s | "
             "aioready GB/s | iters x repeats |", "|---|---|---|---|---|---|---|"]
    for label, size, raw, aio, n, rep in rows:
        lines.append(f"| {label} | {raw * 1e6:.1f} us | {aio * 1e6:.1f} us | {aio / raw:.2f} | "
                     f"{size / raw / 1e9:.2f} | {size / aio / 1e9:.2f} | {n} x {rep} |")
    lines += ["", "Reading it: one-way = median over repeats of each repeat's median RTT/2. The "
              "transport sends one slot per message into one of two 68 KiB receives posted "
              "ahead per peer (payloads up to 64 KiB ride in it, copied once into a reused send "
              "buffer; larger ones follow as a second transfer) and learns of each arrival from "
              "a waiter thread that wakes the loop (gloo's point-to-point Works only complete in "
              "`wait()`); the raw column blocks in `wait()` on the calling thread. With many "
              "more runnable threads than cores (see the load average) each of those wake-ups "
              "waits for a core, which dominates small messages; docs/torchrun.md gives the "
              "context switches and CPU time per message, which the load does not distort.", ""]
    text = "\n".join(lines)
    print(text, flush=True)
    if not args.no_write:
        write_result("transport_torch", text, "python -m bench transport --backend gloo"
                     + (" --quick" if args.quick else ""))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer iterations and repeats")
    p.add_argument("--no-write", action="store_true", help="print only")
    p.add_argument("--sizes", nargs="+", metavar="LABEL", help="only these rows, e.g. '64 KiB'")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if "MASTER_ADDR" in os.environ and "WORLD_SIZE" in os.environ:  # a torchrun rank
        from aioready.launch import run
        run(measure(args))
        return 0
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "bench.transport_torch", *(argv if argv is not None else sys.argv[1:])]
    return subprocess.run(cmd, cwd=ROOT, env=env, timeout=TIMEOUT_S - 30).returncode


if __name__ == "__main__":
    sys.exit(main())
