"""One process of the end-to-end comparison (bench/e2e.py launches it; not run by hand).

`python -m bench.e2e_worker aioready ...` runs under mpiexec (aioready over MPITransport);
`python -m bench.e2e_worker torch ...` runs under torchrun (torch.distributed.pipelining, gloo).
Both sides build the same model (the same GPT-style layer groups, seeded), the same microbatches,
and read the same group trace, so every task sleeps the same injected duration on both
(aioready/testing/inject.py). Rank 0 writes one JSON with the per-step times (max over ranks, after a
barrier), the loss, the squared gradient norm and what each rank slept.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from aioready.launch import run_loop
from aioready.placement import Placement
from aioready.runtime.rank import POLICIES
from aioready.tasks import Kind

from .e2e_compute import METER
from .e2e_counts import Counts
from .e2e_sized import read_sizes, split_order, step_costs
from .wire_json import bcast_int, gather_json, reduce_sum_float

__all__ = ["RunShape", "stage_seconds", "AIOREADY_SPLIT", "TORCH_SCHEDULES", "parse_straggler",
           "parse_config", "byte_budget", "DEFAULT", "default_start"]

# hint -> split backward; the placement comes from the hint registry.
AIOREADY_SPLIT = {"gpipe": False, "1f1b": False, "bf": False, "interleaved-1f1b": False,
                  "zb-h1": True, "zb-h2": True, "bfw": True, "interleaved-zb": True, "zbv": True,
                  "auto": True}  # auto: linear placement, chooses after its first step
# what `aioready train` runs with no schedule flags (cli/auto_start.py), on the model split
# torch's two-chunk schedules take (2 stages per rank); not a hint/mode form
DEFAULT = "default"
# torch schedule -> (placement style, chunks per rank, split backward)
TORCH_SCHEDULES = {
    "ScheduleGPipe": ("linear", 1, False),
    "Schedule1F1B": ("linear", 1, False),
    "ScheduleInterleaved1F1B": ("interleaved", 2, False),
    "ScheduleInterleavedZeroBubble": ("interleaved", 2, True),
    "ScheduleZBVZeroBubble": ("v", 2, True),
    "ScheduleDualPipeV": ("v", 2, True),
}


@dataclass(frozen=True)
class RunShape:
    """How the layer groups of the trace map onto one run's stages."""

    placement: Placement
    groups: int
    split_backward: bool

    @property
    def per_stage(self) -> int:
        return self.groups // self.placement.num_stages


# aioready's device for the stage compute: 'cpu' (worker thread, the default) or 'inline';
# AIOREADY_E2E_PROFILE=DIR writes a cProfile of each aioready rank's loop thread to DIR/rankN.prof:
# the measured steps only, timed by the thread's CPU time (a wall-clock profile of a loop that
# mostly waits reads the wait as the loop's own time)
DEVICE = os.environ.get("AIOREADY_E2E_DEVICE", "cpu")
PROFILE_DIR = os.environ.get("AIOREADY_E2E_PROFILE")


def parse_straggler(text: str | None) -> tuple[int, float] | None:
    if not text:
        return None
    rank, factor = text.split(":")
    return int(rank), float(factor)


def stage_seconds(table: np.ndarray, shape: RunShape, straggler: tuple[int, float] | None
                  ) -> np.ndarray:
    """Durations of one step for this run, seconds, shape (stages, M, 3).

    `table` is the group trace of the step in ms (groups, M, 3 with W). A stage's task takes the
    sum over its groups; unsplit backward takes B + W (both sleep inside it); a straggler rank's
    tasks take FACTOR x.
    """
    g = shape.per_stage
    S = shape.placement.num_stages
    out = table.reshape(S, g, table.shape[1], 3).sum(axis=1) * 1e-3
    if not shape.split_backward:
        out[:, :, Kind.B] += out[:, :, Kind.W]
        out[:, :, Kind.W] = 0.0
    if straggler is not None:
        rank, factor = straggler
        for s in shape.placement.stages_of(rank):
            out[s] *= factor
    return out


def _duration_fn(trace: Any, shape: RunShape, straggler: tuple[int, float] | None
                 ) -> Callable[[int, int, int, Kind], float]:
    cache: dict[int, list] = {}

    def seconds(step: int, stage: int, mb: int, kind: Kind) -> float:
        rows = cache.get(step)
        if rows is None:
            rows = cache[step] = stage_seconds(trace.table(step), shape, straggler).tolist()
        return rows[stage][mb][kind]  # type: ignore[no-any-return]
    return seconds


def _build(args: argparse.Namespace, shape: RunShape, mine: tuple[int, ...], trace: Any,
           straggler: tuple[int, float] | None) -> tuple[list[Any], Any]:
    import torch

    from aioready.testing.inject import Chain, wrap_stages
    from aioready.testing.models import gpt_stages

    from .e2e_thin import TrackingInjector, thin_groups

    dtype = getattr(torch, args.dtype)
    groups = (thin_groups(shape.groups, vocab=args.vocab, dim=args.dim, seed=args.seed,
                          dtype=dtype) if args.thin else
              gpt_stages(shape.groups, vocab=args.vocab, dim=args.dim, heads=args.heads,
                         layers_per_stage=1, seq=args.seq, seed=args.seed, dtype=dtype))
    g = shape.per_stage
    injector = TrackingInjector(_duration_fn(trace, shape, straggler),
                                weight=g * shape.placement.num_ranks / shape.groups)
    modules = [Chain(groups[s * g:(s + 1) * g]) for s in mine]
    return wrap_stages(modules, mine, shape.placement.num_stages, injector), injector


def _data(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    import torch

    from aioready.testing.inject import make_tags
    gen = torch.Generator().manual_seed(args.seed + 1)
    n = args.microbatches * args.mb_size
    x = torch.randint(0, args.vocab, (n, args.seq), generator=gen)
    y = torch.randint(0, args.vocab, (n, args.seq), generator=gen)
    return x, y, make_tags(args.microbatches, args.mb_size)


def _begin_step(modules: list[Any], injector: Any, step: int, warmup: int) -> None:
    """What both runtimes do before each step, from one place so the sides stay alike: fresh
    gradients, the injector told the step, its sleep totals reset when measuring begins."""
    for m in modules:
        m.zero_grad(set_to_none=True)
    injector.step = step
    if step == warmup:
        injector.reset()


def _grad_sq(stages: list[Any]) -> float:
    return float(sum(float((p.grad.double() ** 2).sum()) for s in stages
                     for p in s.inner.parameters() if p.grad is not None))


def _per_step(cpu: list[float], warmup: int) -> float:
    """Process CPU time (every thread) inside the measured steps, barriers excluded, per step."""
    measured = cpu[warmup:]
    return sum(measured) / len(measured)


def _record(name: str, shape: RunShape, times: list[list[float]], loss: float,
            grad_sq: float, slept: list[list[float]], counts: list[list[int]],
            cpu: list[float], peak: list[float], compute: list[float]) -> dict[str, Any]:
    return {"name": name, "style": shape.placement.style,
            "num_stages": shape.placement.num_stages, "split_backward": shape.split_backward,
            "step_s": [max(per_rank) for per_rank in zip(*times)], "loss": loss,
            "grad_sq": grad_sq, "slept_s": slept, "sleep_counts": counts,
            "cpu_s_per_step": cpu, "compute_s_per_step": compute, "peak_activations": peak}


def default_start(groups: int, ranks: int, microbatches: int, trace: Any,
                  straggler: tuple[int, float] | None) -> Any:
    """The start `aioready train` chooses with no schedule flags (sim/start.py), on the
    durations of the trace's first step as this harness maps them to a placement's stages."""
    from aioready.sim.start import choose_start
    from aioready.sim.traces import Trace

    def durations(placement: Placement, split: bool) -> dict[str, Any]:
        table = stage_seconds(trace.table(0), RunShape(placement, groups, split), straggler)
        return {"trace": Trace(table[None] * 1e3, placement=placement, split_backward=split,
                               source="e2e default")}
    return choose_start(num_stages=2 * ranks, num_ranks=ranks, num_microbatches=microbatches,
                        split_backward=None, durations=durations)


def _agreed_start(args: argparse.Namespace, trace: Any, straggler: Any, comm: Any) -> Any:
    """Rank 0 chooses the default's start; the others get it as integers (no pickle)."""
    from aioready.sim.start import Start
    size = comm.Get_size()
    start = (default_start(args.groups, size, args.microbatches, trace, straggler)
             if comm.Get_rank() == 0 else None)
    buf = np.array(start.encode() if start is not None else [0] * Start.width(size),
                   dtype=np.int64)
    request = comm.Ibcast(buf, root=0)
    while not request.Test():  # not a blocking Bcast: its busy wait would starve rank 0
        time.sleep(0.02)
    return start if start is not None else Start.decode([int(v) for v in buf])


def parse_config(config: str) -> tuple[str, str, str, int | str | None]:
    """'hint/mode[:policy][@CAP]': CAP in-flight microbatches per rank (an int), 'Nx' (N times
    the hint's own peak count) or 'memNx' (a byte budget: N times the bytes the hint's order
    holds at its peak, measured: Pipeline(memory="Nx")); policy of ready mode, default the
    reserving one. `auto/ready@2x`: hint="auto" within twice the start hint's peak count;
    `auto/ready@mem2x`: within twice its peak bytes."""
    hint, _, rest = config.partition("/")
    rest, _, cap = rest.partition("@")
    mode, _, policy = rest.partition(":")
    policy = policy or "reserve"
    factor = cap[3:] if cap.startswith("mem") else cap
    good_cap = not cap or (cap.isdigit() and factor == cap) or (
        factor.endswith("x") and factor[:-1].replace(".", "", 1).isdigit())
    if mode not in ("strict", "ready") or policy not in POLICIES or not good_cap:
        raise SystemExit(f"bad aioready config {config!r}: expected "
                         f"hint/strict|ready[:{'|'.join(POLICIES)}][@CAP], CAP an int, Nx "
                         "or memNx")
    return hint, mode, policy, int(cap) if cap.isdigit() else cap or None


def byte_budget(cap: int | str | None) -> tuple[int | str | None, str | None]:
    """(count cap, byte budget) of a parsed CAP: 'memNx' is Pipeline(memory="Nx"), no count."""
    if isinstance(cap, str) and cap.startswith("mem"):
        return None, cap[3:]
    return cap, None


def _peak_bytes(report: Any, rank: int, before: int | None) -> int | None:
    """The most activation bytes this rank held in any measured step (None: not measured)."""
    now = None if report is None else report.peak_activation_bytes.get(rank)
    return before if now is None else max(now, before or 0)


SPANS_DIR = os.environ.get("AIOREADY_E2E_SPANS")  # DIR: every aioready step's spans as CSV
COUNTS_DIR = os.environ.get("AIOREADY_E2E_COUNTS")  # DIR: per-task counters (bench/e2e_counts.py)


def _dump_spans(spans: Any, config: str, rank: int, step: int) -> None:
    path = Path(SPANS_DIR) / f"{config.replace('/', '-')}-rank{rank}.csv"  # type: ignore[arg-type]
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or step == 0
    with open(path, "w" if new else "a") as f:
        if new:
            f.write("step,rank,stage,microbatch,kind,ready,start,end\n")
        for s in spans:
            f.write(f"{step},{s.rank},{s.stage},{s.microbatch},{s.kind.name},{s.ready:.6f},"
                    f"{s.start:.6f},{s.end:.6f}\n")


# -- aioready under mpiexec --------------------------------------------------------------------
def run_aioready(args: argparse.Namespace, trace: Any, configs: list[str],
                 emit: Callable[[dict[str, Any]], None]) -> None:

    import torch
    from mpi4py import MPI

    from aioready.runtime.autotune import AutoHint
    from aioready.runtime.pipeline import Pipeline
    from aioready.schedulers import HINTS
    from aioready.sim.tune import SimChooser
    from aioready.testing.models import lm_loss
    from aioready.transports.mpi import MPITransport

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    gloo = args.aioready_backend == "gloo"  # TorchDistTransport; MPI still gathers the results
    if gloo:
        import torch.distributed as dist

        from aioready.transports.torchdist import TorchDistTransport
        _gloo_env_from_mpi()
        if not dist.is_initialized():
            dist.init_process_group("gloo")
    x, y, tags = _data(args)
    M, b = args.microbatches, args.mb_size
    inputs = [(x[m * b:(m + 1) * b], tags[m * b:(m + 1) * b]) for m in range(M)]
    targets = list(y.split(b))
    straggler = parse_straggler(args.straggler)
    sizes = read_sizes(args.mb_sizes) if args.mb_sizes else None  # known before each step
    # activation bytes measured on every aioready row of a launch with a byte budget, so its
    # rows pay the same hooks and compare at equal memory (docs/policy.md "Memory budgets")
    measure = any(byte_budget(parse_config(c)[3])[1] for c in (split_order(c)[0] for c in configs)
                  if c != DEFAULT)

    async def one(hint: str, mode: str, policy: str, written: int | str | None,
                  order: str | None = None) -> dict[str, Any]:
        cap, memory = byte_budget(written)
        start = _agreed_start(args, trace, straggler, comm) if hint == DEFAULT else None
        if start is not None:  # as `aioready train` starts it: its mode, policy and caps,
            # then choices held to its activation budget (cli/auto_start.py)
            split, mode, policy, cap = (start.split_backward, start.choice.mode,
                                        start.choice.policy, list(start.choice.cap))
            shape = RunShape(Placement(2 * size, size, start.choice.placement), args.groups,
                             split)
            auto: Any = AutoHint(start=start.order(num_stages=2 * size, num_ranks=size,
                                                   num_microbatches=M), comm=comm,
                                 chooser=SimChooser(activations=start.budget))
        else:
            spec = HINTS["1f1b" if hint == "auto" else hint]
            split = AIOREADY_SPLIT[hint]
            shape = RunShape(Placement(size * spec.chunks, size, spec.style), args.groups, split)
            auto = AutoHint(start="1f1b", retune_every=0, comm=comm) if hint == "auto" else hint
        mine = shape.placement.stages_of(rank)
        stages, injector = _build(args, shape, mine, trace, straggler)
        transport = TorchDistTransport() if gloo else MPITransport(comm)
        pipe = Pipeline(stages, METER.wrap(lm_loss), microbatches=M, mode=mode, policy=policy,
                        hint=auto, transport=transport, split_backward=split, device=DEVICE,
                        num_stages=shape.placement.num_stages, cap=cap, memory=memory,
                        measure_memory=measure, microbatch_order=order)
        times, cpu, compute, loss, peak_bytes = [], [], [], None, None
        counts = None if COUNTS_DIR is None else Counts(COUNTS_DIR)
        for step in range(args.warmup + args.steps):
            _begin_step(stages, injector, step, args.warmup)
            comm.Barrier()
            measured = profiler is not None and step >= args.warmup
            if measured:
                profiler.enable()
            if counts is not None and step >= args.warmup:
                counts.begin(transport)
            m0, c0, t0 = METER.seconds, time.process_time(), time.perf_counter()
            out = await pipe.step(inputs, targets, costs=step_costs(sizes, step, pipe))
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            compute.append(METER.seconds - m0)
            if counts is not None and step >= args.warmup:
                counts.end(transport, sum(len(rt._missing) for rt in pipe.runtimes))
            if measured:
                profiler.disable()
            if SPANS_DIR:
                _dump_spans(pipe.last_step.spans, f"{hint}-{mode}", rank, step)
            if out is not None:
                loss = float(out)
            if step >= args.warmup:
                peak_bytes = _peak_bytes(pipe.last_step, rank, peak_bytes)
        await transport.close()
        pipe.close()
        if counts is not None:
            counts.write(f"{hint}-{mode}", rank)
        grad_sq = reduce_sum_float(comm, _grad_sq(stages))
        gathered = gather_json(comm, [
            times[args.warmup:], loss, list(injector.slept), list(injector.count),
            _per_step(cpu, args.warmup), injector.peak_activations(),
            _per_step(compute, args.warmup), [rt.cap for rt in pipe.runtimes], peak_bytes,
            [None if rt.memory is None else rt.memory.bytes for rt in pipe.runtimes]])
        if gathered is None:
            return {}
        all_times, losses, slept, counts, cpus, peaks, computes, caps, held, budgets = (
            [g[i] for g in gathered] for i in range(10))
        the_loss = next(v for v in losses if v is not None)
        name = (DEFAULT if start is not None else f"{hint}/{mode}"
                + (f":{policy}" if policy != "reserve" else "")
                + (f"@{written}" if written else "")
                + (f"+{order}" if order else "")) + ("+gloo" if gloo else "")
        record = _record(name, shape, all_times, the_loss, grad_sq, slept, counts, cpus, peaks,
                         computes)
        record.update(caps=[c for per_rank in caps for c in per_rank],
                      order=pipe.microbatch_order, peak_activation_bytes=held,
                      memory_bytes=[b for per_rank in budgets for b in per_rank])
        if start is not None:  # what the simulator's twin starts from (e2e_scale_report.py)
            record["start"] = {"hint": start.choice.hint, "label": start.label,
                               "budget": start.budget, "budget_unit": "activations"}
        if pipe.auto is not None and pipe.auto.choices:
            choice = pipe.auto.choices[-1][1]
            suffix = f"+{choice.order}" if choice.order != "given" else ""
            record["chosen"] = f"{choice.label}{suffix} {choice.how} caps {list(choice.cap)}"
        return record

    async def all_configs() -> None:
        for config in configs:
            # each config from the same process state: the previous config's closed pipeline,
            # left in reference cycles, cost the next one CPU until collected
            # (docs/hot_path_measurements.md "Not done yet")
            gc.collect()
            config, order = split_order(config)
            record = await one(*((DEFAULT, "ready", "reserve", None) if config == DEFAULT
                                 else parse_config(config)), order)
            if record:
                emit(record)

    torch.set_num_threads(1)
    METER.install()
    profiler = None
    if PROFILE_DIR:
        import cProfile
        profiler = cProfile.Profile(time.thread_time)
    run_loop(all_configs())  # aioready.run's loop (uvloop), as a launched job has
    if profiler is not None:
        Path(PROFILE_DIR).mkdir(parents=True, exist_ok=True)
        profiler.dump_stats(str(Path(PROFILE_DIR) / f"rank{rank}.prof"))


def _rank() -> int:
    for var in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def _gloo_env_from_mpi() -> None:
    """torch.distributed's env:// rendezvous from the MPI job: rank 0 picks a free port."""
    import socket

    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    port = None
    if comm.Get_rank() == 0:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
    port = bcast_int(comm, port)
    os.environ.update(RANK=str(comm.Get_rank()), WORLD_SIZE=str(comm.Get_size()),
                      LOCAL_RANK=str(comm.Get_rank()), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("side", choices=("aioready", "torch", "both"),
                    help="both: aioready then torch in the same mpiexec-launched processes "
                    "(gloo set up from MPI ranks), one start-up for the two sides")
    ap.add_argument("--trace", required=True, help="group trace CSV (ms)")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--straggler", default="", help="RANK:FACTOR")
    ap.add_argument("--configs", default="", help="aioready: hint/mode,...")
    ap.add_argument("--torch-configs", default="", help="torch schedule class names")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--mb-size", type=int, default=2)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--thin", action="store_true",
                    help="the thin model of bench/e2e_thin.py instead of the GPT-style groups")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", required=True)
    ap.add_argument("--mb-sizes", default="",
                    help="JSON of each step's microbatch sizes (bench/e2e_sized.py)")
    ap.add_argument("--aioready-backend", choices=("mpi", "gloo"), default="mpi",
                    help="aioready's transport: MPITransport, or TorchDistTransport over gloo")
    args = ap.parse_args(argv)
    from aioready.sim.traces import read_trace
    trace = read_trace(args.trace, placement=Placement(args.groups, args.groups, "linear"))
    a_cfg = [c for c in args.configs.split(",") if c]
    t_cfg = [c for c in args.torch_configs.split(",") if c]
    records: list[dict[str, Any]] = []

    def emit(side: str) -> Callable[[dict[str, Any]], None]:
        """Rank 0 writes the file again after every config: a later hang keeps the rows."""
        def write(record: dict[str, Any]) -> None:
            records.append(dict(record, side=side))
            tmp = args.out + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"side": args.side, "records": records}, f)
            os.replace(tmp, args.out)
        return write
    if args.side in ("aioready", "both") and a_cfg:
        run_aioready(args, trace, a_cfg, emit("aioready"))
    if args.side == "both" and t_cfg and "MASTER_ADDR" not in os.environ:
        _gloo_env_from_mpi()
    if args.side in ("torch", "both") and t_cfg:
        from .e2e_torch import run_torch
        run_torch(args, trace, t_cfg, emit("torch"))


if __name__ == "__main__":
    main()
