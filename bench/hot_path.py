"""The hot path, piece by piece: what one message and one task cost the runtime.

Each piece is timed alone in one process (a tight loop, median of repeats, in microseconds), on
the real objects: the MPI pieces over COMM_SELF (a message to itself is matched and received
like one from a peer), the codec of the MPI transport, the ReadySet, the devices. The sum of the
pieces is what a message or a task cannot cost less than; the rest of a ping-pong or of a step is
the event loop. `--profile` adds a cProfile of a whole in-process step (zero-length tasks on the
inline device), sorted by own time. docs/hot_path.md holds the figures and what was cut.

Run: python -m bench.hot_path [--quick] [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import os
import pstats
import time
from typing import Any, Callable

from .common import median, other_load, write_result


def _spread(xs: list[float], fmt: str) -> str:
    return f"{median(xs):{fmt}} [{min(xs):{fmt}}-{max(xs):{fmt}}]"


def per_call(fn: Callable[[], Any], n: int, repeats: int) -> list[float]:
    """The mean time of one call (us), once per repeat."""
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        out.append((time.perf_counter_ns() - t0) / n / 1000)
    return out


def message_pieces(n: int, repeats: int, nbytes: int = 8) -> list[tuple[str, list[float]]]:
    import numpy as np
    import torch
    from mpi4py import MPI

    from aioready.transports.base import Message, MessageKind
    from aioready.transports.wire import WireCodec

    comm = MPI.COMM_SELF.Dup()
    codec = WireCodec()
    t = torch.zeros(nbytes // 4, dtype=torch.float32)
    size = "8 B" if nbytes == 8 else f"{nbytes >> 10} KiB"
    msg = Message(0, MessageKind.ACTIVATION, 1, 3, (t,), 0)
    status = MPI.Status()
    desc, sizes, _ = codec.describe(msg.tensors)
    wire = codec.encode_inline(msg, desc, sizes)
    arr = np.frombuffer(wire, np.uint8).copy()
    header, layout = codec.decode(arr, 0)
    rows = []

    def send_recv() -> None:
        req = comm.Isend(wire, 0, 5)
        m = comm.Improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)
        buf = np.empty(status.Get_count(MPI.BYTE), np.uint8)
        r = m.Irecv(buf)
        r.Test()
        req.Test()

    def isend_test() -> None:
        comm.Isend(wire, 0, 5).Test()
        comm.Mprobe(MPI.ANY_SOURCE, MPI.ANY_TAG).Recv(arr)

    def probe_empty() -> None:
        comm.Improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)

    rows.append(("send: describe (cached layout)", per_call(lambda: codec.describe(msg.tensors),
                                                            n, repeats)))
    rows.append((f"send: encode inline header + {size}", per_call(
        lambda: codec.encode_inline(msg, desc, sizes), n, repeats)))
    rows.append((f"send: Isend + Test of {size} (+ a blocking Mprobe/Recv to drain it)",
                 per_call(isend_test, n, repeats)))
    rows.append(("receive: Improbe, nothing there (one hot poll)", per_call(probe_empty, n,
                                                                           repeats)))
    rows.append((f"receive: Isend + Improbe + Irecv + Test of {size} (the whole MPI part)",
                 per_call(send_recv, n, repeats)))
    rows.append(("receive: decode header (cached layout)", per_call(
        lambda: codec.decode(arr, 0), n, repeats)))
    rows.append((f"receive: inline tensors of {size} (numpy view + torch.from_numpy)", per_call(
        lambda: codec.inline_tensors(arr, layout), n, repeats)))
    rows.append(("receive: Message object", per_call(
        lambda: codec.message(header, msg.tensors), n, repeats)))
    comm.Free()
    return rows


def task_pieces(n: int, repeats: int) -> list[tuple[str, list[float]]]:
    from aioready.arbiter import Wakeup
    from aioready.devices.base import TaskInfo
    from aioready.devices.cpu import CPUDevice
    from aioready.devices.inline import InlineDevice
    from aioready.ready_set import ReadySet
    from aioready.schedulers import make_hint
    from aioready.tasks import Kind, Task
    from aioready.telemetry.spans import Span

    hint = make_hint("1f1b", num_stages=1, num_microbatches=64)
    order, prio = hint.orders[0], hint.priority(0)
    rows = []

    def decisions() -> None:
        rs = ReadySet(prio, cap=64, num_chunks=1, split_backward=False)
        for task in order:
            rs.push(task)
        while (task := rs.pop_nowait()) is not None:
            rs.done(task)

    rows.append(("task: ReadySet push + pop + done", [
        us / len(order) for us in per_call(decisions, max(1, n // 100), repeats)]))
    rows.append(("task: TaskInfo + Span objects", per_call(
        lambda: (TaskInfo(0, 0, 0, 0, 1, Kind.F), Span(0, 0, 0, 1, Kind.F, 0.0, 0.0, 0.0)),
        n, repeats)))
    rows.append(("task: Task(...) and its hash (a dict key ~20 times a task)", per_call(
        lambda: hash(Task(Kind.B, 3, 0)), n, repeats)))

    async def await_device(device: Any, k: int) -> list[float]:
        info = TaskInfo(0, 0, 0, 0, 0, Kind.F)
        fn = tuple
        out = []
        for _ in range(repeats):
            t0 = time.perf_counter_ns()
            for _ in range(k):
                await device.run(info, fn)
            out.append((time.perf_counter_ns() - t0) / k / 1000)
        return out

    async def wake_cost(k: int) -> list[float]:
        wakeup = Wakeup()
        out = []

        async def waiter() -> None:
            for _ in range(k):
                await wakeup.wait()

        for _ in range(repeats):
            task = asyncio.ensure_future(waiter())
            await asyncio.sleep(0)
            t0 = time.perf_counter_ns()
            while not task.done():
                wakeup.notify()
                await asyncio.sleep(0)
            out.append((time.perf_counter_ns() - t0) / k / 1000)
        return out

    async def loop_pass(k: int) -> list[float]:
        return [await _passes(k) for _ in range(repeats)]

    async def main() -> list[tuple[str, list[float]]]:
        cpu = CPUDevice(inline_below_s=0.0)
        fast = CPUDevice(inline_below_s=100e-6)
        try:
            return [("task: CPUDevice.run of a no-op (thread hand-off)",
                     await await_device(cpu, max(1, n // 10))),
                    ("task: CPUDevice.run of a no-op, tiny-task fast path (inline below 100 us)",
                     await await_device(fast, n)),
                    ("task: InlineDevice.run of a no-op", await await_device(InlineDevice(), n)),
                    ("loop: one asyncio.sleep(0) pass", await loop_pass(n)),
                    ("wake: Wakeup.notify to the arbiter running (one loop pass)",
                     await wake_cost(max(1, n // 10)))]
        finally:
            cpu.close()
            fast.close()

    rows += _run(main())
    return rows


async def _passes(k: int) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(k):
        await asyncio.sleep(0)
    return (time.perf_counter_ns() - t0) / k / 1000


def _run(coro: Any) -> Any:
    try:
        import uvloop
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(coro)
    except ImportError:
        return asyncio.run(coro)


def whole_step(S: int, M: int, repeats: int, profile: bool) -> tuple[list[float], str]:
    """us per zero-length task of a whole in-process step on the inline device, and a profile."""
    import aioready
    from aioready.devices.inline import InlineDevice

    async def main() -> list[float]:
        out = []
        for _ in range(repeats):
            pipe = aioready.Pipeline([None] * S, None, microbatches=M, hint="1f1b",
                                     mode="ready", device=InlineDevice())
            await pipe.step()  # warm: the hint's one-off checks are not per task
            t0 = time.perf_counter()
            await pipe.step()
            out.append((time.perf_counter() - t0) / (2 * S * M) * 1e6)
        return out

    us = _run(main())
    text = ""
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        _run(main())
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(20)
        text = s.getvalue()
    return us, text


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--profile", action="store_true", help="add a cProfile of a whole step")
    args = ap.parse_args(argv)
    n, reps = (2000, 5) if args.quick else (20000, 9)
    load = os.getloadavg()
    rows = message_pieces(n, reps) + [
        row for row in message_pieces(max(1, n // 10), reps, 64 << 10)
        if "64 KiB" in row[0]] + task_pieces(n, reps)
    lines = ["## The hot path, piece by piece (us per call, one process)", "",
             f"Median [min-max] over {reps} repeats; {other_load()} after the pieces.", "",
             "| piece | us |", "|---|---|"]
    lines += [f"| {name} | {_spread(us, '.2f')} |" for name, us in rows]
    step_us, prof = whole_step(4, 64, 5 if args.quick else 7, args.profile)
    lines += ["", f"Whole in-process step, S=4 M=64 1f1b, zero-length tasks on the inline device "
              f"(4 ranks on one loop, reserving policy): {_spread(step_us, '.1f')} us per task "
              f"({len(step_us)} steps).", ""]
    if prof:
        lines += ["```", prof.strip(), "```"]
    body = "\n".join(lines)
    write_result("hot_path", body, "python -m bench.hot_path" + " --quick" * args.quick
                 + " --profile" * args.profile, load=list(load))
    print(body)
    return body


if __name__ == "__main__":
    main()
