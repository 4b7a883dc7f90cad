"""The torch.distributed.pipelining side of the end-to-end comparison, one process under torchrun
(bench/e2e_worker.py's `torch` and `both` sides call it; not run by hand).

The same modules, microbatches and injected durations as the aioready side (bench/e2e_worker.py
builds them for both); rank 0 hands each schedule's record to `emit` as soon as it is complete, so
a schedule that fails or hangs later costs only its own row.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

from aioready.placement import Placement

from .e2e_compute import METER
from .e2e_worker import (
    TORCH_SCHEDULES,
    RunShape,
    _begin_step,
    _build,
    _data,
    _grad_sq,
    _per_step,
    _record,
    parse_straggler,
)
from .wire_json import all_gather_json_torch

__all__ = ["run_torch"]


def _static_meta(args: argparse.Namespace, stage: int, num_stages: int) -> tuple[Any, Any]:
    """Example inputs and outputs of a stage, so torch skips its shape inference (which would
    run the module on uninitialised tensors, tags included)."""
    import torch
    dtype = getattr(torch, args.dtype)
    b, T = args.mb_size, args.seq
    tag = torch.zeros(b, dtype=torch.int64)
    hidden = torch.zeros(b, T, args.dim, dtype=dtype, requires_grad=True)
    inputs = (torch.zeros(b, T, dtype=torch.int64), tag) if stage == 0 else (hidden, tag)
    outputs = (torch.zeros(b, T, args.vocab, dtype=dtype, requires_grad=True)
               if stage == num_stages - 1 else (hidden, tag))
    return inputs, outputs


def run_torch(args: argparse.Namespace, trace: Any, configs: list[str],
              emit: Callable[[dict[str, Any]], None]) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining

    from aioready.testing.models import lm_loss

    if not dist.is_initialized():  # an aioready run over gloo in this process did already
        dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    METER.install()
    x, y, tags = _data(args)
    M = args.microbatches
    straggler = parse_straggler(args.straggler)
    for name in configs:
        style, chunks, split = TORCH_SCHEDULES[name]
        shape = RunShape(Placement(size * chunks, size, style), args.groups, split)
        mine = shape.placement.stages_of(rank)
        modules, injector = _build(args, shape, mine, trace, straggler)
        S = shape.placement.num_stages
        stages = [pipelining.PipelineStage(m, s, S, torch.device("cpu"),
                                           *_static_meta(args, s, S))
                  for m, s in zip(modules, mine)]
        cls = getattr(pipelining, name)
        schedule = cls(stages if chunks > 1 else stages[0], n_microbatches=M,
                       loss_fn=METER.wrap(lm_loss), scale_grads=True)
        has_first, has_last = 0 in mine, S - 1 in mine
        times, cpu, compute, loss = [], [], [], 0.0
        for step in range(args.warmup + args.steps):
            _begin_step(modules, injector, step, args.warmup)
            losses: list[Any] = []
            call_args = (x, tags) if has_first else ()
            kwargs: dict[str, Any] = {"target": y, "losses": losses} if has_last else {}
            dist.barrier()
            m0, c0, t0 = METER.seconds, time.process_time(), time.perf_counter()
            schedule.step(*call_args, **kwargs)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            compute.append(METER.seconds - m0)
            if has_last:
                loss = float(sum(float(v.detach()) for v in losses) / M)
        gathered = all_gather_json_torch([
            times[args.warmup:], loss if has_last else None, _grad_sq(modules),
            list(injector.slept), list(injector.count), _per_step(cpu, args.warmup),
            injector.peak_activations(), _per_step(compute, args.warmup)])
        if rank == 0:
            all_times = [g[0] for g in gathered]
            the_loss = next(g[1] for g in gathered if g[1] is not None)
            emit(_record(name, shape, all_times, the_loss, sum(g[2] for g in gathered),
                         [g[3] for g in gathered], [g[4] for g in gathered],
                         [g[5] for g in gathered], [g[6] for g in gathered],
                         [g[7] for g in gathered]))
        dist.barrier()
    dist.destroy_process_group()


