"""Pipeline stages that are tensor-parallel groups, under MPI.

    mpiexec -n 4 python examples/tp_mlp.py --tp 2            # 2 stages x 2 TP ranks
    mpiexec -n 4 python examples/tp_mlp.py --tp 2 --mode strict --jitter-ms 5
    mpiexec -n 4 python examples/tp_mlp.py --tp 2 --no-coordinate   # shows the mismatch error

Every rank builds the same full MLP (aioready.testing.make_mlp_stages, float64), keeps its TP
shard of its pipeline stage, and trains `--steps` steps; each rank then compares its gradient
shard and the loss with the unsplit model (run locally on the same data). World rank 0 prints one
line `RESULT {json}`. Random per-task delays after each task's compute (`--jitter-ms`: uniform
in [0, J] plus tp_rank * J/2, seeded by world rank, so each TP member sees readiness at
different moments; `--straggler-ms`: one member holds its gradients longer) exercise the
coordination. Any error aborts the
whole job (aioready.launch.abort_on_error): a mismatch is an error message, not a hang.
"""

from __future__ import annotations

import argparse
import json
import random
import time
import zlib
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

import aioready
from aioready.devices.cpu import CPUDevice
from aioready.devices.delayed import DelayedDevice
from aioready.launch import abort_on_error
from aioready.runtime.pipeline import Pipeline
from aioready.tasks import Kind
from aioready.testing.helpers import mse_loss, reference_step
from aioready.tp.collectives import MPITPComm, TPDevice
from aioready.tp.coordination import Coordinator
from aioready.tp.grid import GridComms, ProcessGrid
from aioready.tp.layers import make_tp_mlp_stages, max_tp_grad_diff
from aioready.tp.nccl_collectives import mpi_tp_comm
from aioready.transports.mpi import MPITransport


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    p.add_argument("--mode", default="ready",
                   help="ready | strict | follow (strict order, but members follow the leader's "
                   "decisions: the pure cost of coordination), or a comma list to alternate")
    p.add_argument("--hint", default="1f1b")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1, help="alternate the modes this many times")
    p.add_argument("--warmup", type=int, default=0,
                   help="leading steps of each run left out of timings and decision stats")
    p.add_argument("--cap", type=int, default=None)
    p.add_argument("--split", action="store_true", help="split backward (B and W)")
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--blocks", type=int, default=2, help="blocks per stage")
    p.add_argument("--batch", type=int, default=2, help="rows per microbatch")
    p.add_argument("--jitter-ms", type=float, default=0.0, help="max random delay per task")
    p.add_argument("--straggler-ms", type=float, default=0.0,
                   help="the last stage's last TP rank holds every gradient this much longer")
    p.add_argument("--no-coordinate", dest="coordinate", action="store_false")
    p.add_argument("--verify", default="exchange",
                   help="how collectives check that all TP members are in the same task: "
                   "exchange | inline | off, or a comma list to alternate")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="skip the comparison with the unsplit model (benchmarks)")
    p.add_argument("--timeout", type=float, default=20.0, help="seconds per collective")
    p.add_argument("--device-comm", action="store_true",
                   help="TP sums through aioready.tp.nccl_collectives.mpi_tp_comm (NCCL for "
                   "CUDA tensors where the ranks agree on it, else MPI)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--print-orders", action="store_true", help="print each rank's task order")
    p.add_argument("--hot-wait-ms", type=float, default=2.0,
                   help="members poll hot this long when waiting for a decision (0: off)")
    return p.parse_args(argv)


def batch(args: argparse.Namespace, step: int) -> tuple[list[Any], list[Any]]:
    g = torch.Generator().manual_seed(1000 + step)
    shape = (args.batch, args.width)
    xs = [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(args.microbatches)]
    ys = [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(args.microbatches)]
    return xs, ys


def task_codes(order: list[str]) -> np.ndarray:
    """A rank's executed order as integers, to compare across TP members without pickles."""
    return np.array([zlib.crc32(t.encode()) for t in order], dtype=np.int64)


async def run_mode(comms: GridComms, args: argparse.Namespace, mode: str,
                   verify: str) -> dict[str, Any]:
    """Train `args.steps` steps in `mode`; return this rank's measurements."""
    c, pp = comms.coords, comms.grid.pp_size
    if args.device_comm:
        tpcomm = mpi_tp_comm(comms.tp, verify=verify, timeout=args.timeout)
    else:
        tpcomm = MPITPComm(comms.tp, verify=verify, timeout=args.timeout)
    full, shards = make_tp_mlp_stages(pp, tpcomm, width=args.width, hidden=args.hidden,
                                      blocks_per_stage=args.blocks, seed=args.seed)
    module = shards[c.pp_rank]
    coordinated = mode != "strict" and args.coordinate and comms.grid.tp_size > 1
    coord = Coordinator(MPITransport(comms.tp), record=True, follow_in_strict=mode == "follow",
                        hot_wait_s=args.hot_wait_ms / 1e3) if coordinated else None
    transport = MPITransport(comms.pp)
    rng = random.Random(f"{args.seed}/{comms.world.Get_rank()}/{mode}")
    jitter = args.jitter_ms / 1e3
    skew = c.tp_rank * jitter / 2  # members differ in distribution too, not only in draws
    slow = (c.pp_rank == pp - 1 and c.tp_rank == comms.grid.tp_size - 1) * args.straggler_ms / 1e3

    def delay(info: Any) -> float:
        return skew + rng.uniform(0.0, jitter) + (slow if info.kind is Kind.B else 0.0)

    device = TPDevice(DelayedDevice(CPUDevice(f"rank{comms.world.Get_rank()}"), delay), tpcomm)
    pipe = Pipeline([module], mse_loss, microbatches=args.microbatches, hint=args.hint,
                    mode="strict" if mode == "follow" else mode, transport=transport,
                    split_backward=args.split, cap=args.cap, device=device, coordinator=coord)
    last = c.pp_rank == pp - 1
    out: dict[str, Any] = {"grad_diff": 0.0, "loss_diff": 0.0, "orders_equal": True,
                           "step_s": []}
    for step in range(args.steps):
        module.zero_grad(set_to_none=True)
        xs, ys = batch(args, step)
        comms.world.Barrier()
        t0 = time.perf_counter()
        loss = await pipe.step(xs if c.pp_rank == 0 else None, ys if last else None)
        if step >= args.warmup:
            out["step_s"].append(time.perf_counter() - t0)
        elif coord is not None:  # warm-up: the decision stream's first step is not measured
            coord.times.clear()
            coord.waits.clear()
        mine = task_codes(pipe.last_step.order(c.pp_rank))  # type: ignore[union-attr]
        if args.print_orders:
            print(comms.world.Get_rank(), step, pipe.last_step.order(c.pp_rank), flush=True)
        everyone = np.empty((comms.grid.tp_size, len(mine)), dtype=np.int64)
        comms.tp.Allgather(mine, everyone)
        out["orders_equal"] &= bool((everyone == everyone[0]).all())
        if args.check:
            ref_loss, ref = reference_step(full, mse_loss, xs, ys)
            out["grad_diff"] = max(out["grad_diff"],
                                   max_tp_grad_diff([ref[c.pp_rank]], [module], tpcomm))
            if last:
                out["loss_diff"] = max(out["loss_diff"], abs(float(loss) - float(ref_loss)))
    await transport.close()
    out["num_collectives"] = tpcomm.num_collectives
    out["num_tasks"] = sum(len(r[0].spans) for r in pipe.history)
    if coord is not None:
        out.update(coordination_stats(comms, coord))
        await coord.transport.close()
    device.close()
    return out


def coordination_stats(comms: GridComms, coord: Coordinator) -> dict[str, Any]:
    """Decision counts, one-way latency (leader send -> member arrival) and member waits."""
    times = np.array([t for _, _, t in coord.times], dtype=np.float64)
    stats: dict[str, Any] = {"decisions_sent": coord.num_decisions_sent,
                             "decisions_received": coord.num_decisions_received}
    if coord.is_leader:
        for member in range(1, comms.tp.Get_size()):
            comms.tp.Send(times, dest=member)
        return stats
    sent = np.empty_like(times)
    comms.tp.Recv(sent, source=0)
    stats["latency_s"] = (times - sent).tolist()
    stats["wait_s"] = list(coord.waits)
    return stats


def summarize(per_rank: list[dict[str, Any]], mode: str) -> dict[str, Any]:
    steps = np.max(np.array([r["step_s"] for r in per_rank]), axis=0)
    lat = [x for r in per_rank for x in r.get("latency_s", [])]
    wait = [x for r in per_rank for x in r.get("wait_s", [])]
    q = (lambda xs, p: float(np.percentile(xs, p)) if xs else None)
    return {
        "mode": mode,
        "grad_diff": max(r["grad_diff"] for r in per_rank),
        "loss_diff": max(r["loss_diff"] for r in per_rank),
        "orders_equal": all(r["orders_equal"] for r in per_rank),
        "step_s": steps.tolist(),
        "decision_messages": sum(r.get("decisions_sent", 0) for r in per_rank),
        "decisions_received": sum(r.get("decisions_received", 0) for r in per_rank),
        "num_tasks": sum(r["num_tasks"] for r in per_rank),
        "num_collectives": sum(r["num_collectives"] for r in per_rank),
        "latency_median_s": q(lat, 50), "latency_p95_s": q(lat, 95),
        "wait_median_s": q(wait, 50), "wait_p95_s": q(wait, 95),
        "wait_total_s": float(sum(wait)), "num_waits": len(wait),
    }


def gather(comms: GridComms, out: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Send each rank's results to world rank 0 as JSON bytes (parsed, never unpickled)."""
    data = np.frombuffer(json.dumps(out).encode(), dtype=np.uint8)
    sizes = np.zeros(comms.world.Get_size(), dtype=np.int64)
    comms.world.Gather(np.array([len(data)], dtype=np.int64), sizes, root=0)
    if comms.world.Get_rank() != 0:
        comms.world.Send(data, dest=0, tag=7)
        return None
    parts = [data]
    for src in range(1, comms.world.Get_size()):
        buf = np.empty(int(sizes[src]), dtype=np.uint8)
        comms.world.Recv(buf, source=src, tag=7)
        parts.append(buf)
    return [json.loads(p.tobytes()) for p in parts]


async def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # one core per rank: MPI ranks already share the machine
    world = MPI.COMM_WORLD
    grid = ProcessGrid.for_world(world.Get_size(), tp=args.tp)
    comms = grid.split(world)
    levels = args.verify.split(",")
    runs = [(mode, level) for mode in args.mode.split(",") for level in levels]
    key = {(m, v): m if len(levels) == 1 else f"{m}/{v}" for m, v in runs}
    results: dict[str, list[dict[str, Any]]] = {key[r]: [] for r in runs}
    for _ in range(args.repeats):
        for mode, level in runs:
            per_rank = gather(comms, await run_mode(comms, args, mode, level))
            if per_rank is not None:
                results[key[mode, level]].append(summarize(per_rank, mode))
    if world.Get_rank() == 0:
        print("RESULT " + json.dumps({"world": world.Get_size(), "pp": grid.pp_size,
                                      "tp": grid.tp_size, "runs": results}), flush=True)
    comms.free()


if __name__ == "__main__":
    arguments = parse()
    with abort_on_error(3):
        aioready.run(main(arguments))
