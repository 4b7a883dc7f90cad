"""Data-parallel gradient reduction overlapped with the pipeline vs a blocking all-reduce after it.

PP=2 x DP=2 on 4 ranks (`python -m bench.dp` relaunches itself under `mpiexec -n 4`). The same
modules train in three ways, alternating step by step inside one job (side by side, same load):
- `none`: the pipeline step alone, no reduction (the floor);
- `blocking`: the step, then a blocking `Allreduce` of every gradient bucket (what a training loop
  does without help, and what `overlap_grad_reduce=False` is in Megatron);
- `overlapped`: `Pipeline(grid=...)`: each chunk's buckets start (`Iallreduce`) as soon as its last
  backward piece ended, completed by the progress engine while other work runs.
Step time is the slowest rank's (a barrier before each step). Two views of what the reduction
costs: from step times, `T - T_none` (noisy on a shared machine: steps vary by more than the
reduction); and per rank inside one step, the time the rank spent after its last task waiting for
its reductions (`overlapped`) against the time its blocking all-reduce took (`blocking`), the
slowest rank of each step; the share hidden is `1 - wait / blocking`. Tasks hold the device a
fixed time after their compute (a sleep, like an accelerator: the host is free), so the bubbles
are real. Writes bench/results/dp.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MPI_RANKS = 4
TIMEOUT_S = 900
ROOT = Path(__file__).resolve().parent.parent
HINTS = [("1f1b", False), ("interleaved-1f1b", False), ("zb-h1", True)]
MODES = ("none", "blocking", "overlapped")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer steps")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--rows", type=int, default=1, help="samples per microbatch")
    p.add_argument("--task-ms", type=float, default=10.0, help="device time per task")
    p.add_argument("--microbatches", type=int, default=8)
    return p.parse_args()


class NoReduce:
    """A GradReducer that does nothing (the `none` and `blocking` pipelines)."""

    size = 2

    def reduce_nowait(self, chunk: int) -> None:
        pass

    async def wait_reduced(self) -> None:
        pass

    async def mean(self, value: Any) -> Any:
        return value


def blocking_allreduce(comm: Any, modules: list[Any]) -> None:
    """The baseline: every bucket's mean, one blocking Allreduce after another."""
    import torch
    from mpi4py import MPI

    from aioready.dp.reducer import DEFAULT_BUCKET_BYTES, plan_buckets
    for module in modules:
        for bucket in plan_buckets(list(module.parameters()), DEFAULT_BUCKET_BYTES):
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])
            comm.Allreduce(MPI.IN_PLACE, flat.numpy(), op=MPI.SUM)
            flat /= comm.Get_size()
            offset = 0
            for p in bucket:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()


async def measure(args: argparse.Namespace, hint: str, split: bool, steps: int
                  ) -> dict[str, list[float]]:
    import torch
    from mpi4py import MPI

    from aioready.devices.cpu import CPUDevice
    from aioready.devices.delayed import DelayedDevice
    from aioready.runtime.pipeline import Pipeline
    from aioready.schedulers import HINTS as SPECS
    from aioready.schedulers import make_hint
    from aioready.testing.helpers import make_mlp_stages, mse_loss
    from aioready.tp.grid import ProcessGrid
    world = MPI.COMM_WORLD
    comms = ProcessGrid(pp_size=2, dp_size=2).split()
    c = comms.coords
    chunks = SPECS[hint].chunks
    S = 2 * chunks
    stages = make_mlp_stages(S, width=args.width, hidden=args.hidden, dtype=torch.float32)
    pipes = {}
    for mode in MODES:
        order = make_hint(hint, num_stages=S, num_ranks=2, num_microbatches=args.microbatches,
                          split_backward=split)
        mine = list(order.placement.stages_of(c.pp_rank))
        device = DelayedDevice(CPUDevice(f"{mode}{world.Get_rank()}"),
                               lambda info: args.task_ms / 1e3)
        pipe = Pipeline([stages[s] for s in mine], mse_loss, microbatches=args.microbatches,
                        hint=hint, split_backward=split, grid=comms, device=device,
                        grad_reducer=None if mode == "overlapped" else NoReduce())
        pipes[mode] = (pipe, [stages[s] for s in mine], mine)
    gen = torch.Generator().manual_seed(c.dp)
    xs = [torch.randn(args.rows, args.width, generator=gen) for _ in range(args.microbatches)]
    times: dict[str, list[float]] = {m: [] for m in MODES}
    tail: dict[str, list[float]] = {"blocking": [], "overlapped": []}
    for step in range(steps + 1):
        for mode in MODES:
            pipe, modules, mine = pipes[mode]
            for m in modules:
                m.zero_grad(set_to_none=True)
            world.Barrier()
            t0 = time.perf_counter()
            await pipe.step(xs if 0 in mine else None, xs if S - 1 in mine else None)
            after = time.monotonic()
            if mode == "blocking":
                blocking_allreduce(comms.dp, modules)
            elapsed = time.perf_counter() - t0
            exposed = time.monotonic() - (after if mode == "blocking" else pipe.last_step.end)
            slowest = world.allreduce(elapsed, op=MPI.MAX)
            exposed = world.allreduce(exposed, op=MPI.MAX)
            if step:  # the first round warms up
                times[mode].append(slowest)
                if mode in tail:
                    tail[mode].append(exposed)
    for pipe, _, _ in pipes.values():
        await pipe.grid.close()
        pipe.close()
    times.update({f"tail_{m}": v for m, v in tail.items()})
    return times


async def run_all(args: argparse.Namespace) -> None:
    from mpi4py import MPI

    from bench.common import write_result
    world = MPI.COMM_WORLD
    steps = 4 if args.quick else 12
    rows = []
    for hint, split in HINTS:
        t = await measure(args, hint, split, steps)
        med = {m: statistics.median(v) for m, v in t.items()}
        exposed_block = med["blocking"] - med["none"]
        exposed_over = med["overlapped"] - med["none"]
        hidden = 1 - med["tail_overlapped"] / med["tail_blocking"]
        rows.append(f"| {hint}{' (split)' if split else ''} | {med['none'] * 1e3:.1f} | "
                    f"{med['blocking'] * 1e3:.1f} | {med['overlapped'] * 1e3:.1f} | "
                    f"{med['blocking'] / med['overlapped']:.3f} | {exposed_block * 1e3:.1f} | "
                    f"{exposed_over * 1e3:.1f} | {med['tail_blocking'] * 1e3:.1f} | "
                    f"{med['tail_overlapped'] * 1e3:.1f} | {100 * hidden:.0f} % |")
    if world.Get_rank() != 0:
        return
    params = 2 * (2 * args.width * args.hidden + args.width + args.hidden + 2 * args.width)
    body = "\n".join([
        "# Data parallelism: reductions overlapped with the pipeline vs blocking after it", "",
        f"PP=2 x DP=2 on 4 ranks, M={args.microbatches}, residual MLP stages (width "
        f"{args.width}, hidden {args.hidden}, 2 blocks: ~{params * 4 / 2 ** 20:.0f} MiB of "
        f"float32 gradients per stage), {args.rows} row(s) per microbatch, every task holds "
        f"its device {args.task_ms:g} ms "
        f"after its compute; median of {steps} steps per mode, alternating; times in ms, "
        "slowest rank.", "",
        "| hint | step alone | + blocking all-reduce | overlapped | blocking / overlapped | "
        "T - T_none, blocking | T - T_none, overlapped | blocking all-reduce | wait after the "
        "last task, overlapped | hidden |",
        "|---|---|---|---|---|---|---|---|---|---|", *rows, "",
        "Reading it: with one chunk per rank (1f1b, zb-h1) the last stage's reduction overlaps",
        "the first stage's final backward work, but the first stage's own reduction starts when",
        "its step ends, so at most about half is hidden; with interleaved chunks a rank's later",
        "chunk reduces while its earlier chunk still computes. Both per-rank columns include",
        "waiting for the other replica to reach its reduction (replicas drift apart within a",
        "step), which no overlap can hide. The machine is shared: see its load above; compare",
        "the columns of one row (same run), not rows of different runs."])
    path = write_result("dp", body, "python -m bench.dp" + (" --quick" if args.quick else ""))
    print(body)
    print(f"wrote {path}", file=sys.stderr)


def main() -> None:
    args = parse()
    launched = any(k in os.environ for k in ("PMI_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK"))
    if not launched:  # `python -m bench.dp`: relaunch under mpiexec
        from bench.e2e import mpiexec
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        cmd = [mpiexec(), "-n", str(MPI_RANKS), sys.executable, "-m", "bench.dp", *sys.argv[1:]]
        raise SystemExit(subprocess.run(cmd, env=env, cwd=ROOT).returncode)
    import torch

    import aioready
    torch.set_num_threads(1)
    aioready.run(run_all(args))


if __name__ == "__main__":
    main()
