"""The training loop behind `aioready train` and the demo: a GPT-style model, paced tasks.

One function runs in-process (every stage on one loop) or as one rank of an MPI job (this rank's
stages, MPITransport): `await train(config, comm=...)`. Each task takes at least the duration the
jitter model or trace gives it (aioready/sim/durations.py), real compute included, so `strict` and
`ready` runs with the same seed see the same durations. Under MPI each step's spans and loss are
gathered to rank 0 as numbers (aioready/telemetry/gather.py), where metrics, progress and
exports happen.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from ..caps import CapSpec, parse_cap
from ..devices.cpu import CPUDevice
from ..devices.inline import InlineDevice
from ..devices.paced import PACE_MODES, PacedDevice
from ..errors import ConfigError, DivergedError
from ..memory import MemorySpec, check_one_gate, parse_memory
from ..runtime.autotune import AutoHint, parse_auto, start_hint
from ..runtime.pipeline import Pipeline
from ..schedulers import make_hint
from ..schedulers.order import ORDERS
from ..sim.durations import paced_duration
from ..telemetry.export import spans_table
from ..telemetry.instruments import Instruments, instrument_pipeline
from ..telemetry.metrics import StepMetrics, peak_activations, step_metrics
from ..telemetry.spans import StepReport
from ..testing.models import gpt_stages, lm_loss
from .auto_start import agreed_start, auto_budget, auto_chooser
from .sized_microbatches import sequence_lengths

__all__ = ["TrainConfig", "TrainResult", "train", "synthetic_microbatch", "ON_NAN"]

ON_NAN = ("warn", "stop")


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainConfig:
    """What `aioready train` runs; durations in ms."""

    stages: int = 4
    microbatches: int = 8
    hint: str = "1f1b"
    mode: str = "ready"
    policy: str = "reserve"
    """ready mode's rule (aioready.runtime.rank.POLICIES)"""
    cap: CapSpec = None
    """in-flight microbatches per rank, any form of aioready.caps; None: the hint's own peak"""
    memory: MemorySpec = None
    """activation bytes per rank instead of `cap`, any form of aioready.memory ("2x", "64MiB")"""
    jitter: str | None = None
    seed: int = 0
    trace: str | None = None
    trace_mode: str = "floor"
    """floor: a task takes at least its duration (compute inside it); add: the compute, then a
    sleep of the whole duration (devices/paced.py)"""
    steps: int = 3
    split_backward: bool | None = False
    """None: a plain hint="auto" chooses it before step 0 (cli/auto_start.py)"""
    task_ms: float = 20.0
    """base F duration (B = 2F unsplit); 0: tasks take their compute time only"""
    batch: int = 2
    seq: int = 32
    dim: int = 32
    heads: int = 2
    layers_per_stage: int = 1
    vocab: int = 64
    lr: float = 3e-3
    metrics_port: int | None = None
    """serve Prometheus metrics on this port (+ rank under MPI); None: off"""
    dashboard: int | None = None
    """serve the live dashboard (telemetry/dashboard.py) on this port, rank 0; None: off"""
    sleep_only: bool = False
    """tasks only sleep their durations, no model compute (replays a trace's timing alone)"""
    checkpoint_dir: str | None = None
    """write a checkpoint (aioready.runtime.checkpoint) here after every step; None: off"""
    resume: bool = False
    """continue from the latest checkpoint in checkpoint_dir (from step 0 if there is none)"""
    check_config: bool = True
    """on resume, refuse a checkpoint written with another hint, microbatch count or split"""
    verify: bool = True
    """on resume, check every file against its SHA-256; False: a checkpoint from before them"""
    key_file: str | None = None
    """seal every message between ranks with the key in this file (transports/secure.py);
    None: AIOREADY_KEY_FILE if set, else plain"""
    on_nan: str = "warn"
    """a loss that is not finite: "warn" (once, on stderr, and in the summary) or "stop" (raise
    DivergedError)"""
    dp: int = 1
    """data-parallel replicas under MPI or torchrun (the pipeline has world / dp ranks)"""
    tp: int = 1
    """tensor-parallel size under MPI or torchrun: each block's MLP is split (aioready.tp.layers)"""
    microbatch_order: str | None = None
    """schedulers.order.ORDERS, by each microbatch's input bytes; None: "given", or with
    hint="auto" the order its chooser simulates fastest (runtime/auto_order.py)"""
    sized_microbatches: bool = False
    """each microbatch's sequence length follows its size in the jitter model (multimodal: a
    heavy one FACTOR times a light one's, the longest `seq`), so its input bytes, the costs a
    microbatch order goes by, know what its durations will be; False: every one `seq` long"""

    def __post_init__(self) -> None:
        object.__setattr__(self, "cap", parse_cap(self.cap))  # "8" -> 8: the summary shows 8
        parse_memory(self.memory)
        check_one_gate(self.cap, self.memory)
        if self.resume and not self.checkpoint_dir:
            raise ConfigError("resume needs a checkpoint directory",
                              expected="checkpoint_dir (--checkpoint-dir D)", got=None)
        if self.checkpoint_dir and self.sleep_only:
            raise ConfigError("sleep_only runs no model: nothing to checkpoint",
                              expected="checkpoint_dir without sleep_only", got="both")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError("lr must be a positive finite number", expected="> 0",
                              got=self.lr)
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError("metrics_port out of range", expected="0..65535",
                              got=self.metrics_port)
        if self.dashboard is not None and not 0 <= self.dashboard <= 65535:
            raise ConfigError("dashboard port out of range", expected="0..65535",
                              got=self.dashboard)
        if self.trace_mode not in PACE_MODES:
            raise ConfigError("trace_mode", expected=" | ".join(PACE_MODES),
                              got=repr(self.trace_mode))
        if self.split_backward is None and parse_auto(self.hint) != "":
            raise ConfigError("split_backward=None (chosen before step 0) needs hint='auto'",
                              expected="True or False", got=f"None with hint {self.hint!r}")
        if self.microbatch_order is not None and self.microbatch_order not in ORDERS:
            raise ConfigError("microbatch_order", expected=" | ".join(ORDERS),
                              got=repr(self.microbatch_order))
        if self.sized_microbatches and (self.jitter is None or self.trace is not None):
            raise ConfigError("sized_microbatches follows the jitter model's microbatch sizes",
                              expected="a jitter with sizes (multimodal:...) and no trace",
                              got=f"jitter={self.jitter!r}, trace={self.trace!r}")
        if self.on_nan not in ON_NAN:
            raise ConfigError("on_nan", expected=" | ".join(ON_NAN), got=repr(self.on_nan))
        for name in ("stages", "microbatches", "steps", "batch", "seq", "dim", "heads",
                     "layers_per_stage", "vocab", "dp", "tp"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1", expected=">= 1",
                                  got=getattr(self, name))


@dataclass(slots=True)
class TrainResult:
    """Rank 0's view of a run (other ranks: empty lists)."""

    reports: list[StepReport] = field(default_factory=list)
    metrics: list[StepMetrics] = field(default_factory=list)
    losses: list[float | None] = field(default_factory=list)
    rank: int = 0
    world_size: int = 1
    durations: str = ""
    overruns: int = 0
    diverged_at: int | None = None
    """the first step whose loss was not finite (None: none)"""
    key_fingerprint: str | None = None
    """the sealing key's fingerprint when messages were sealed (None: plain)"""
    transport: str = ""  # "mpi" or "torch" for a multi-rank job
    choices: list[Any] = field(default_factory=list)  # hint="auto": (first step, Choice)
    start: Any = None  # plain hint="auto": the sim.start.Start it began from (None: fixed)
    split_backward: bool = False  # as run (a plain "auto" may have chosen it)

    def summary(self, cfg: TrainConfig) -> dict[str, Any]:
        """The `--json` summary: lists per step, times in ms."""
        return {
            "step_time": [m.step_time * 1e3 for m in self.metrics],
            "lower_bound": [m.lower_bound * 1e3 for m in self.metrics],
            "efficiency": [m.efficiency for m in self.metrics],
            "bubble_fraction": [m.bubble_fraction for m in self.metrics],
            "busy_fraction": [list(m.busy_fraction) for m in self.metrics],
            "peak_in_flight": [list(m.peak_in_flight) for m in self.metrics],
            "peak_activations": [[peak_activations(r.spans, k) for k in range(r.num_ranks)]
                                 for r in self.reports],  # (chunk, microbatch) pairs held
            "peak_activation_bytes": [list(m.peak_activation_bytes) for m in self.metrics],
            "memory": cfg.memory,
            "loss": list(self.losses), "unit": "ms", "mode": cfg.mode, "policy": cfg.policy, "hint": cfg.hint,
            "stages": cfg.stages, "microbatches": cfg.microbatches, "cap": cfg.cap,
            "split_backward": self.split_backward, "jitter": cfg.jitter, "seed": cfg.seed,
            "trace": cfg.trace, "task_ms": cfg.task_ms, "durations": self.durations,
            "transport": self.transport or ("mpi" if self.world_size > 1 else "inproc"),
            "ranks": self.world_size, "overruns": self.overruns,
            "sleep_only": cfg.sleep_only, "diverged_at": self.diverged_at,
            "sealed": self.key_fingerprint, "dp": cfg.dp, "tp": cfg.tp,
            "layers_per_stage": cfg.layers_per_stage, "trace_mode": cfg.trace_mode,
            "auto": self._auto(),
            "spans": spans_table(self.reports),  # what `aioready advise` reads
        }

    def _auto(self) -> dict[str, Any] | None:
        """hint="auto": where it started and what it chose (None for a fixed hint)."""
        if self.start is None and not self.choices:
            return None
        start = None if self.start is None else {
            "hint": self.start.choice.label, "placement": self.start.choice.placement,
            "mode": self.start.choice.how, "split_backward": self.start.split_backward,
            "budget": self.start.budget}
        return {"start": start, "choices": [
            {"from_step": step, "hint": c.label, "placement": c.placement, "mode": c.how,
             "caps": list(c.cap), "memory": None if c.memory is None else list(c.memory)}
            for step, c in self.choices]}


def synthetic_microbatch(step: int, microbatch: int, *, batch: int, seq: int, vocab: int,
                         seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Arithmetic token sequences (start a, stride d): next tokens are learnable from context."""
    gen = torch.Generator().manual_seed(hash((seed, step, microbatch)) & 0x7FFF_FFFF)
    start = torch.randint(0, vocab, (batch, 1), generator=gen)
    stride = torch.randint(1, 4, (batch, 1), generator=gen)
    tokens = (start + stride * torch.arange(seq + 1)) % vocab
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


async def train(cfg: TrainConfig, *, comm: Any = None,
                on_step: Callable[[int, StepMetrics, float | None], None] | None = None
                ) -> TrainResult:
    """Run `cfg.steps` steps; with `comm` of size > 1, as one rank of an MPI job."""
    world = comm.Get_size() if comm is not None else 1
    rank = comm.Get_rank() if comm is not None else 0
    grid, line = _grid(cfg, comm)
    world, rank = (world, rank) if grid is None else (grid.grid.pp_size, grid.coords.pp_rank)
    follower = grid is not None and (grid.coords.dp > 0 or grid.coords.tp_rank > 0)
    transport = _mpi_transport(line) if world > 1 else None
    kind = "torch" if type(transport).__name__ == "TorchDistTransport" else ""
    key_file = cfg.key_file or os.environ.get("AIOREADY_KEY_FILE") or None
    fingerprint = None
    if key_file and transport is not None:
        from ..transports.secure import SecureTransport, load_key, secure_session
        transport = SecureTransport(transport, key=load_key(key_file),
                                    session=await secure_session(line))
        fingerprint = transport.fingerprint
    auto = parse_auto(cfg.hint)  # "auto": start from its start hint, then choose
    ranks = world if world > 1 else None
    chosen = await agreed_start(cfg, num_ranks=ranks, comm=line if world > 1 else None)
    split = chosen.split_backward if chosen is not None else bool(cfg.split_backward)
    hint = chosen.order(num_stages=cfg.stages, num_ranks=ranks,
                       num_microbatches=cfg.microbatches) if chosen is not None else make_hint(
        cfg.hint if auto is None else auto or start_hint("linear", split),
        num_stages=cfg.stages, num_ranks=ranks, num_microbatches=cfg.microbatches,
        split_backward=split)
    placement = hint.placement
    model = gpt_stages(cfg.stages, vocab=cfg.vocab, dim=cfg.dim, heads=cfg.heads,
                       layers_per_stage=cfg.layers_per_stage, seq=cfg.seq, seed=cfg.seed)
    mine = placement.stages_of(rank) if transport is not None else tuple(range(cfg.stages))
    modules = [None if cfg.sleep_only else model[s] for s in mine]
    wrap = _tensor_parallel(grid, modules)
    duration, source = paced_duration(
        placement=placement, num_microbatches=cfg.microbatches,
        split_backward=split, task_ms=cfg.task_ms, jitter=cfg.jitter,
        seed=cfg.seed, trace=cfg.trace, steps=cfg.steps)
    devices: list[PacedDevice] = []

    def make_device(r: int) -> Any:
        # sleep-only tasks compute nothing: a worker-thread hand-off per task would only cost
        # two wake-ups, and on an oversubscribed host its wait for a core (bench.oversub)
        inner = InlineDevice() if cfg.sleep_only and cfg.tp == 1 else CPUDevice(
            f"aioready-rank{r}")
        devices.append(PacedDevice(inner, follow, cfg.trace_mode))
        return wrap(devices[-1])

    def follow(info: Any) -> float:  # a reordered slot runs the caller's microbatch: its time
        slots = pipe.microbatch_slots
        return duration(info if slots is None else info._replace(
            microbatch=slots[info.microbatch]))

    # a chosen start runs its simulated mode and policy from step 0 (its caps: the budget)
    pipe = Pipeline(modules, lm_loss, microbatches=cfg.microbatches,
                    mode=cfg.mode if chosen is None else chosen.choice.mode,
                    policy=cfg.policy if chosen is None else chosen.choice.policy,
                    hint=hint if auto is None else AutoHint(
                        start=hint.name if chosen is None else hint, comm=line,
                        chooser=auto_chooser(cfg, chosen)),
                    transport=transport, split_backward=split,
                    cap=auto_budget(cfg, ranks, chosen),
                    memory=cfg.memory, measure_memory=True, microbatch_order=cfg.microbatch_order,
                    device=make_device, num_stages=cfg.stages, grid=grid)
    ordered = pipe.takes_costs
    lengths = None if not cfg.sized_microbatches else sequence_lengths(
        cfg.jitter or "none", seed=cfg.seed, seq=cfg.seq, placement=placement,
        num_microbatches=cfg.microbatches, split_backward=split)
    params = [p for m in modules if m is not None for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=cfg.lr) if params else None
    result = TrainResult(rank=rank if comm is None else comm.Get_rank(),
                         world_size=1 if comm is None else comm.Get_size(), durations=source,
                         key_fingerprint=fingerprint,
                         transport=kind, start=chosen, split_backward=split)
    start = 0
    if cfg.checkpoint_dir:
        _check_writable(Path(cfg.checkpoint_dir))
    if cfg.resume:
        from ..runtime.checkpoint import resume
        start = resume(cfg.checkpoint_dir, pipe, opt,  # type: ignore[arg-type]
                       check_config=cfg.check_config, verify=cfg.verify)
    if world > 1:
        from ..telemetry.gather import barrier
        # ranks built their models at different speeds: start together
        await pipe.watch(barrier(comm), what="the start barrier")
    with _live_metrics(cfg, pipe, rank, board=rank == 0 and not follower) as instruments:
        try:
            for step in range(start, cfg.steps):
                inputs, targets, costs = _batch(cfg, step, mine,
                                                0 if grid is None else grid.coords.dp,
                                                None if lengths is None else lengths(step))
                loss = await pipe.step(inputs, targets, costs=costs if ordered else None)
                if opt is not None:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                if cfg.checkpoint_dir:  # on a grid, replica 0 writes for its DP group
                    from ..runtime.checkpoint import save_checkpoint
                    # in a thread: the loop keeps beating, so a long write is not a lost rank
                    await pipe.watch(asyncio.to_thread(save_checkpoint, cfg.checkpoint_dir,
                                                       pipe, opt), what="a checkpoint write")
                report, loss_value = await pipe.watch(
                    _collect(pipe, line if world > 1 else None, loss),
                    what=f"the report gather of step {step}")
                if follower:  # replica 0, TP rank 0 reports for the others
                    continue
                if instruments:
                    local = pipe.last_step
                    assert local is not None
                    instruments.call("after_step", report or local,
                                     step_metrics(report or local))
                if report is None:
                    continue
                _check_loss(cfg, result, step, loss_value)
                metrics = step_metrics(report)
                result.reports.append(report)
                result.metrics.append(metrics)
                result.losses.append(loss_value)
                if on_step is not None:
                    on_step(step, metrics, loss_value)
            overruns = sum(d.num_overruns for d in devices)
            if world > 1:
                from ..telemetry.gather import reduce_sum
                overruns = await pipe.watch(reduce_sum(comm, overruns),
                                            what="the final reduce") or 0
                await pipe.watch(transport.close(), what="the transport's close")
        finally:
            pipe.close()
            if pipe.grid is not None:  # a TP group's decision transport
                await pipe.grid.close()
    result.overruns = overruns
    result.choices = [] if pipe.auto is None else list(pipe.auto.choices)
    return result


def _check_writable(directory: Path) -> None:
    """Before step 0, not after it: a checkpoint directory this process cannot write to."""
    probe = directory / f".aioready-write-test-{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"cannot write checkpoints to {directory}", expected="a writable "
                          "directory", got=f"{type(exc).__name__}: {exc.strerror or exc}"
                          ) from None


def _check_loss(cfg: TrainConfig, result: TrainResult, step: int, loss: float | None) -> None:
    """A loss that is not finite is said loudly (once) or ends the run (on_nan="stop")."""
    if loss is None or math.isfinite(loss) or result.diverged_at is not None:
        return
    result.diverged_at = step
    if cfg.on_nan == "stop":
        raise DivergedError(f"the loss is {loss}: the run diverged", step=step,
                            expected="a finite loss", got=loss,
                            fix="lower the learning rate (--lr)")
    print(f"aioready train: step {step}: the loss is {loss}: the run diverged (lower --lr; "
          "--on-nan stop ends the run on it)", file=sys.stderr, flush=True)


def _grid(cfg: TrainConfig, comm: Any) -> tuple[Any, Any]:
    """(grid communicators or None, the pipeline line's communicator)."""
    if cfg.dp == 1 and cfg.tp == 1:
        return None, comm
    if comm is None:
        raise ConfigError("data and tensor parallelism run under MPI or torchrun",
                          expected="mpiexec -n pp*tp*dp (or torchrun --nproc-per-node)", got=f"tp={cfg.tp}, dp={cfg.dp} in "
                          "one process")
    from ..telemetry.torch_comm import TorchComm
    from ..tp.grid import ProcessGrid
    shape = ProcessGrid.for_world(comm.Get_size(), tp=cfg.tp, dp=cfg.dp)
    if isinstance(comm, TorchComm):  # torchrun: torch.distributed groups
        groups = shape.torch_groups()
        return groups, TorchComm(groups.pp)
    grid = shape.split(comm)
    return grid, grid.pp


def _tensor_parallel(grid: Any, modules: list[Any]) -> Callable[[Any], Any]:
    """Shard the modules' MLPs over the TP group; return the device wrapper TP needs."""
    if grid is None or grid.grid.tp_size == 1:
        return lambda device: device
    from ..tp.collectives import MPITPComm, TPDevice
    from ..tp.grid import GridGroups
    from ..tp.layers import shard_gpt_mlps
    if isinstance(grid, GridGroups):
        from ..tp.torch_collectives import TorchTPComm
        comm: Any = TorchTPComm(grid.tp)
    else:
        comm = MPITPComm(grid.tp)
    for module in modules:
        if module is not None:
            shard_gpt_mlps(module, comm)
    return lambda device: TPDevice(device, comm)


def _batch(cfg: TrainConfig, step: int, mine: tuple[int, ...], replica: int = 0,
           lengths: list[int] | None = None) -> tuple[Any, Any, list[float]]:
    """This rank's inputs and targets of a step, and every microbatch's input bytes (every
    rank knows them: the costs a microbatch order goes by, runtime/mb_order.py); `lengths`:
    each microbatch's sequence length (default `seq`)."""
    M = cfg.microbatches  # replica r takes microbatches r*M .. r*M+M-1 of the global batch
    pairs = [synthetic_microbatch(step, replica * M + m, batch=cfg.batch,
                                  seq=cfg.seq if lengths is None else lengths[m],
                                  vocab=cfg.vocab, seed=cfg.seed) for m in range(M)]
    inputs = [x for x, _ in pairs] if 0 in mine else None
    targets = [y for _, y in pairs] if cfg.stages - 1 in mine else None
    return inputs, targets, [float(x.numel() * x.element_size()) for x, _ in pairs]


async def _collect(pipe: Pipeline, comm: Any, loss: Any
                   ) -> tuple[StepReport | None, float | None]:
    """This step's merged report and loss on rank 0 (gathered under MPI); (None, None) else."""
    if comm is None:
        return pipe.last_step, (None if loss is None else float(loss))
    from ..telemetry.gather import gather_reports
    assert pipe.last_step is not None
    out = await gather_reports([pipe.last_step], comm, losses=[loss])
    return (None, None) if out is None else out[0]


@contextlib.contextmanager
def _live_metrics(cfg: TrainConfig, pipe: Pipeline, rank: int, *, board: bool
                  ) -> Iterator[Instruments]:
    """Prometheus metrics (every rank) and the dashboard (rank 0, fed the gathered steps)."""
    dashboard = None
    if cfg.dashboard is not None and board:
        from ..telemetry.dashboard import Dashboard
        dashboard = Dashboard(pipe, port=cfg.dashboard)
        print(f"rank {rank}: dashboard on {dashboard.url}", file=sys.stderr, flush=True)
    try:
        with _prometheus(cfg, pipe, rank) as instruments:
            if dashboard is not None:
                instruments.add(dashboard)
            yield instruments
    finally:
        if dashboard is not None:
            dashboard.close()


@contextlib.contextmanager
def _prometheus(cfg: TrainConfig, pipe: Pipeline, rank: int) -> Iterator[Instruments]:
    if cfg.metrics_port is None:
        yield Instruments()
        return
    from ..telemetry.prometheus import PrometheusInstrument, serve_metrics
    prom = PrometheusInstrument(split_backward=pipe.hint.split_backward)
    instruments = Instruments([prom])
    instrument_pipeline(pipe, instruments)
    server = serve_metrics(cfg.metrics_port + rank if cfg.metrics_port else 0, prom.registry)
    print(f"rank {rank}: Prometheus metrics on http://127.0.0.1:{server.server_port}/metrics",
          file=sys.stderr, flush=True)
    try:
        yield instruments
    finally:
        server.shutdown()
        server.server_close()


def _mpi_transport(comm: Any) -> Any:
    from ..telemetry.torch_comm import TorchComm
    if isinstance(comm, TorchComm):  # a torchrun job (cli/train.py job_comm)
        from ..transports.torchdist import TorchDistTransport
        return TorchDistTransport(comm.group)
    try:
        from ..transports.mpi import MPITransport  # type: ignore[import-not-found]
    except ImportError:
        raise ConfigError("running under MPI needs the MPI transport", expected="aioready."
                          "transports.mpi in this build", got="not importable",
                          fix="run without mpirun (in-process) or install a build with it"
                          ) from None
    return MPITransport(comm)


def write_outputs(result: TrainResult, cfg: TrainConfig, *, json_out: str | None = None,
                  chrome_trace: str | None = None, png: str | None = None,
                  csv_out: str | None = None, step_table: str | None = None) -> list[Path]:
    """Write the requested exports of a finished run (rank 0); return the paths written."""
    import json

    from ..telemetry.export import write_chrome_trace, write_csv
    from .record import finite
    written = []
    if json_out:
        path = Path(json_out)
        path.parent.mkdir(parents=True, exist_ok=True)
        # strict JSON: a NaN or inf (a diverged loss) is null; diverged_at says where
        path.write_text(json.dumps(finite(result.summary(cfg)), indent=1, allow_nan=False))
        written.append(path)
    if chrome_trace:
        written.append(write_chrome_trace(result.reports, chrome_trace))
    if csv_out:
        written.append(write_csv(result.reports, csv_out))
    if step_table:
        from ..telemetry.step_table import write_step_table
        written.append(write_step_table(result.reports, step_table))
    if png:
        from ..telemetry.plots import plot_timeline
        written.append(plot_timeline(result.reports[-1], png, label=f"{cfg.mode} {cfg.hint} "))
    return written

