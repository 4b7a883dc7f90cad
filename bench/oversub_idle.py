"""An idle waiting rank on an oversubscribed host: its CPU and how fast a message wakes it.

S MPI ranks share this machine's cores. Every rank but 0 has an MPITransport whose completion
engine is told its arbiter waits (`set_waiting(True)`, what a RankRuntime with nothing ready
says), and waits for one message; rank 0 sleeps `--idle-s`, then sends one message to each rank
in turn, `--gap-ms` apart, so each wakes alone (as a pipeline wakes one rank per message). Per
waiting rank: process CPU / wall while it waited, the engine's wake-ups a second, and the wake
delay (the send's CLOCK_MONOTONIC stamp, carried in the message, to the delivery callback).

The floor row is the same waits in a blocking `recv` on a datagram socket (no loop, no MPI): the
OS's own wake-up delay on this host at this load. Variants alternate launch by launch (the
floor, the fast paths off and on, `AIOREADY_MPI_FAST`, and with
`--baseline REV` an older commit's aioready), so they share the machine's load; figures are
medians over ranks per launch, then median [range] over launches.

Run: python -m bench.oversub_idle [--quick] [--ranks 16] [--launches 5]
(one launch: mpiexec -n 16 python -m bench.oversub_idle --worker --out f.json)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import median, other_load, write_result
from .e2e import mpiexec
from .oversub import ROOT, baseline_tree, wakes

FIELDS = ("cpu", "delay", "wakes")


def worker(args: argparse.Namespace) -> None:
    import asyncio

    import numpy as np
    import torch
    from mpi4py import MPI

    from aioready.launch import run
    from aioready.progress import ProgressEngine
    from aioready.transports.base import Message, MessageKind
    from aioready.transports.mpi import MPITransport

    comm = MPI.COMM_WORLD
    S, me = comm.Get_size(), comm.Get_rank()
    if args.floor:
        _floor(args, comm, np)
        return

    async def main() -> list[list[float]]:
        loop = asyncio.get_running_loop()
        transport = MPITransport(comm)
        box: dict[str, Any] = {}

        def deliver(msg: Message) -> None:
            fut = box.get("fut")
            if fut is not None and not fut.done():
                fut.set_result((time.monotonic(), msg))

        transport.open(deliver)
        engine = ProgressEngine.for_loop()
        out = []
        for rep in range(args.repeats):
            box["fut"] = loop.create_future()
            if me:
                engine.set_waiting(True)
            comm.Barrier()
            if me == 0:
                await asyncio.sleep(args.idle_s)
                for dest in range(1, S):
                    stamp = torch.tensor([time.monotonic()], dtype=torch.float64)
                    transport.send_nowait(dest, Message(0, MessageKind.ACTIVATION, 1, rep,
                                                        (stamp,)))
                    await asyncio.sleep(args.gap_ms / 1e3)
                await transport.wait_sent()
                continue
            c0, w0, p0 = time.process_time(), time.monotonic(), wakes(engine)
            got, msg = await box["fut"]
            wall = got - w0
            out.append([(time.process_time() - c0) / wall * 100,
                        (got - float(msg.tensors[0][0])) * 1e3, (wakes(engine) - p0) / wall])
        comm.Barrier()
        await transport.close()
        return out

    mine = np.array(run(main()) or [[0.0] * len(FIELDS)] * args.repeats, np.float64)
    _gather(args, comm, mine, np)


def _floor(args: argparse.Namespace, comm: Any, np: Any) -> None:
    """The machine's floor for the same waits: each rank blocks in `recv` on a datagram socket
    (no loop, no MPI), and rank 0 sends each the stamp: the OS's own wake-up delay."""
    import socket

    S, me = comm.Get_size(), comm.Get_rank()
    token = np.array([os.getpid()], np.int64)
    comm.Bcast(token, root=0)
    prefix = f"\0aioready-bench-{int(token[0])}-".encode()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(prefix + str(me).encode())
    comm.Barrier()
    out = []
    for _ in range(args.repeats):
        comm.Barrier()
        if me == 0:
            time.sleep(args.idle_s)
            for dest in range(1, S):
                sock.sendto(np.array([time.monotonic()]).tobytes(), prefix + str(dest).encode())
                time.sleep(args.gap_ms / 1e3)
            continue
        c0, w0 = time.process_time(), time.monotonic()
        data = sock.recv(64)
        got = time.monotonic()
        out.append([(time.process_time() - c0) / (got - w0) * 100,
                    (got - float(np.frombuffer(data, np.float64)[0])) * 1e3, 0.0])
    comm.Barrier()
    sock.close()
    mine = np.array(out or [[0.0] * len(FIELDS)] * args.repeats, np.float64)
    _gather(args, comm, mine, np)


def _gather(args: argparse.Namespace, comm: Any, mine: Any, np: Any) -> None:
    S, me = comm.Get_size(), comm.Get_rank()
    every = np.zeros((S,) + mine.shape, np.float64) if me == 0 else None
    comm.Gather(mine, every, root=0)
    if me == 0:
        per = {k: every[1:, :, i].ravel().tolist() for i, k in enumerate(FIELDS)}
        Path(args.out).write_text(json.dumps(per))


def launch(S: int, variant: tuple[str, str, dict[str, str]], args: argparse.Namespace,
           out: Path) -> dict[str, list[float]] | str:
    label, tree, extra = variant
    extra = dict(extra)
    floor = extra.pop("floor", "")
    cmd = [mpiexec(), "-n", str(S), sys.executable, "-m", "bench.oversub_idle", "--worker",
           "--idle-s", str(args.idle_s), "--gap-ms", str(args.gap_ms), "--repeats",
           str(args.repeats), "--out", str(out), "--tree", tree] + ["--floor"] * bool(floor)
    try:
        proc = subprocess.run(cmd, env={**os.environ, **extra}, capture_output=True, text=True,
                              timeout=600, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return "timed out after 600 s"
    if proc.returncode != 0 or not out.exists():
        return f"failed (rc {proc.returncode}): {proc.stderr.strip()[-300:]}"
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def _cell(xs: list[float], fmt: str) -> str:
    return f"{median(xs):{fmt}} [{min(xs):{fmt}}-{max(xs):{fmt}}]"


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--worker", action="store_true", help="one launch (under mpiexec)")
    ap.add_argument("--quick", action="store_true", help="8 ranks, 2 launches")
    ap.add_argument("--ranks", default="16")
    ap.add_argument("--launches", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2, help="waits per launch")
    ap.add_argument("--idle-s", type=float, default=1.0)
    ap.add_argument("--gap-ms", type=float, default=20.0)
    ap.add_argument("--fast", default="0,1", help="AIOREADY_MPI_FAST values to alternate")
    ap.add_argument("--baseline", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--tree", default="")
    ap.add_argument("--floor", action="store_true", help="(worker) blocking socket recv")
    args = ap.parse_args(argv)
    if args.worker:
        if args.tree:
            sys.path.insert(0, args.tree)
        worker(args)
        return ""
    if args.quick:
        args.ranks, args.launches = "8", 2
    load = os.getloadavg()
    rows: dict[tuple[int, str], list[dict[str, float]]] = {}
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        variants = [(f"AIOREADY_MPI_FAST={f}", str(ROOT), {"AIOREADY_MPI_FAST": f})
                    for f in args.fast.split(",")]
        if args.baseline:
            variants.insert(0, (f"commit {args.baseline}",
                                baseline_tree(args.baseline, Path(tmp)), {}))
        variants.insert(0, ("floor: blocking socket recv", str(ROOT), {"floor": "1"}))
        for S in (int(r) for r in args.ranks.split(",")):
            for i in range(args.launches):
                for j, variant in enumerate(variants):
                    got = launch(S, variant, args, Path(tmp) / f"{S}-{i}-{j}.json")
                    if isinstance(got, str):
                        failures.append(f"S={S} {variant[0]} launch {i}: {got}")
                        continue
                    row = {k: median(v) for k, v in got.items()}
                    rows.setdefault((S, variant[0]), []).append(row)
                    print(f"S={S} {variant[0]} #{i}: {row}", flush=True)
    lines = ["## An idle waiting rank on an oversubscribed host", "",
             f"Every rank but 0 waits ~{args.idle_s:g} s for one message (its engine in the "
             f"waiting state); rank 0 sends them {args.gap_ms:g} ms apart. {args.launches} "
             f"launches per row, {args.repeats} waits each, the variants alternating; medians "
             f"over ranks per launch, then median [range]. {os.cpu_count()} cores; "
             f"{other_load()} at the end.", "",
             "| S | code | idle waiting rank CPU % | wake delay ms | engine wakes/s |",
             "|---|---|---|---|---|"]
    for (S, label), got in rows.items():
        lines.append(f"| {S} | {label} | {_cell([r['cpu'] for r in got], '.2f')} | "
                     f"{_cell([r['delay'] for r in got], '.2f')} | "
                     f"{_cell([r['wakes'] for r in got], '.0f')} |")
    if failures:
        lines += ["", "Failed launches:", *[f"- {f}" for f in failures]]
    body = "\n".join(lines)
    command = ("python -m bench.oversub_idle --quick" if args.quick else
               f"python -m bench.oversub_idle --ranks {args.ranks} --launches {args.launches}")
    command = (command
               + f" --fast {args.fast}" * (args.fast != "0,1")
               + f" --baseline {args.baseline}" * bool(args.baseline))
    write_result("oversub_idle", body, command, load=list(load))
    print(body)
    return body


if __name__ == "__main__":
    main()
