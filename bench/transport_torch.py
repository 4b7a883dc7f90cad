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

The wall clock of a shared machine moves with its load, so each row also counts, per round trip
and summed over both ranks, the voluntary context switches and the CPU time of every thread
(read from /proc: what the load does not change much), and the page gives what one thread
hand-off costs here (`handoff`), the unit in which the transport's extra latency is paid.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import queue
import subprocess
import sys
import threading
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


def thread_counters() -> tuple[float, float, float]:
    """Voluntary context switches of every thread of this process, and the CPU seconds of its
    main thread and of the others (Linux /proc; zeros elsewhere)."""
    switches = main = others = 0.0
    me = str(os.getpid())
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return 0.0, 0.0, 0.0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                cpu = int(f.read().split()[0]) / 1e9
            with open(f"/proc/self/task/{tid}/status") as f:
                status = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        switches += int(status.split("\nvoluntary_ctxt_switches:")[1].split()[0])
        if tid == me:
            main += cpu
        else:
            others += cpu
    return switches, main, others


def counted(dist, torch, start: tuple[float, float, float], n: int) -> list[float]:
    """Switches, main-thread CPU us and other threads' CPU us per round trip since `start`,
    summed over the ranks."""
    end = thread_counters()
    t = torch.tensor([(end[i] - start[i]) / n for i in range(3)], dtype=torch.float64)
    dist.all_reduce(t)
    return [float(t[0]), float(t[1]) * 1e6, float(t[2]) * 1e6]


async def handoff(n: int = 2000) -> tuple[float, float]:
    """One-way latency (us) of a hand-off between two Python threads (a blocked thread woken
    through a futex, what raw `wait()` pays once per message) and from a thread to an event
    loop through an eventfd (what the transport's waiter thread adds), each a ping-pong / 2."""
    there, back = queue.SimpleQueue(), queue.SimpleQueue()

    def echo() -> None:
        while (x := there.get()) is not None:
            back.put(x)
    thread = threading.Thread(target=echo)
    thread.start()
    t0 = time.perf_counter()
    for i in range(n):
        there.put(i)
        back.get()
    threads = (time.perf_counter() - t0) / n / 2
    there.put(None)
    thread.join()
    if not hasattr(os, "eventfd"):
        return threads * 1e6, 0.0
    loop = asyncio.get_running_loop()
    fd = os.eventfd(0, os.EFD_NONBLOCK)
    box: list[asyncio.Future] = []
    loop.add_reader(fd, lambda: (os.eventfd_read(fd), box[0].set_result(None)))

    def ring() -> None:
        while there.get() is not None:
            os.eventfd_write(fd, 1)
    ringer = threading.Thread(target=ring)
    ringer.start()
    t0 = time.perf_counter()
    for i in range(n):
        box[:] = [loop.create_future()]
        there.put(i)
        await box[0]
    to_loop = (time.perf_counter() - t0) / n / 2
    there.put(None)
    ringer.join()
    loop.remove_reader(fd)
    os.close(fd)
    return threads * 1e6, to_loop * 1e6


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
    load = list(os.getloadavg())
    for label, size in [(lb, sz) for lb, sz in SIZES if not args.sizes or lb in args.sizes]:
        n = iters_for(size, args.quick)
        raw, aio, raw_counts, aio_counts = [], [], [], []
        for _ in range(repeats):
            dist.barrier()
            start = thread_counters()
            raw.append(median(raw_pingpong(dist, torch, size, n)))
            raw_counts.append(counted(dist, torch, start, n + 2))
            start = thread_counters()
            times = await aio_pingpong(echo, dist, torch, size, n)
            aio_counts.append(counted(dist, torch, start, n + 2))
            if times:
                aio.append(median(times))
        if dist.get_rank() == 0:
            rows.append((label, size, median(raw), median(aio), n, repeats,
                         [median(c[i] for c in raw_counts) for i in range(3)],
                         [median(c[i] for c in aio_counts) for i in range(3)],
                         min(a / r for a, r in zip(aio, raw)), max(a / r for a, r in zip(aio, raw))))
    await transport.close()
    if dist.get_rank() == 0:
        report(args, rows, torch.__version__, load, await handoff())
    dist.destroy_process_group()


def report(args: argparse.Namespace, rows: list, version: str, load: list[float],
           hop: tuple[float, float]) -> None:
    lines = ["# Transport over torch.distributed (gloo): TorchDistTransport vs raw isend/irecv",
             "", f"torch {version}, 2 ranks on one host (loopback TCP).", "",
             "| size | raw one-way | aioready one-way | aioready / raw (repeats) | raw GB/s | "
             "aioready GB/s | iters x repeats |", "|---|---|---|---|---|---|---|"]
    for label, size, raw, aio, n, rep, _, _, lo, hi in rows:
        lines.append(f"| {label} | {raw * 1e6:.1f} us | {aio * 1e6:.1f} us | {aio / raw:.2f} "
                     f"({lo:.2f}-{hi:.2f}) | {size / raw / 1e9:.2f} | {size / aio / 1e9:.2f} | "
                     f"{n} x {rep} |")
    lines += ["", "Per round trip, both ranks together (medians over repeats; /proc):", "",
              "| size | raw switches | aioready switches | raw CPU main + others | "
              "aioready CPU main + others |", "|---|---|---|---|---|"]
    for label, _, _, _, _, _, rc, ac, _, _ in rows:
        lines.append(f"| {label} | {rc[0]:.2f} | {ac[0]:.2f} | {rc[1]:.0f} + {rc[2]:.0f} us | "
                     f"{ac[1]:.0f} + {ac[2]:.0f} us |")
    lines += ["", f"One hand-off measured in the same run (rank 0, after the rows): Python thread "
              f"to blocked Python thread {hop[0]:.1f} us, thread to event loop through an "
              f"eventfd {hop[1]:.1f} us (ping-pong / 2).", "",
              "Reading it: one-way = median over repeats of each repeat's median RTT/2; the "
              "parenthesis gives the lowest and highest ratio of single repeats. The transport "
              "sends one slot per message into one of two 68 KiB receives posted ahead per peer "
              "(payloads up to 64 KiB ride in it, copied once into a reused send buffer; larger "
              "ones follow as a second transfer) and learns of each arrival from a waiter thread "
              "that wakes the loop through an eventfd (gloo's point-to-point Works only complete "
              "in `wait()`); the raw column blocks in `wait()` on the calling thread. So each "
              "message costs the receiving rank one thread hand-off more than raw (one voluntary "
              "switch more per rank and message: the switches column), plus the Python of "
              "framing, delivery and the awaiting task (the CPU column); docs/torchrun.md does "
              "the arithmetic.", ""]
    text = "\n".join(lines)
    print(text, flush=True)
    if not args.no_write:
        write_result("transport_torch", text, "python -m bench transport --backend gloo"
                     + (" --quick" if args.quick else ""), load=load)


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
