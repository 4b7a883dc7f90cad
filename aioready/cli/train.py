"""`aioready train`: train the tiny GPT-style model, in-process or as one rank under mpirun."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ..schedulers import hint_names
from ..schedulers.order import ORDERS

__all__ = ["add_parser", "run", "mpi_comm", "config_from_args", "refuse_unserved_launch"]

EXAMPLES = """examples:
  aioready train --stages 4 --microbatches 8 --steps 5 --mode ready
  aioready train --jitter multimodal:0.3:3 --seed 1 --mode strict --json out/strict.json
  aioready train --hint 1f1b --cap 8 --png out/ready.png --chrome-trace out/ready.json
  aioready train --cap 2x --jitter lognormal:0.5
  aioready train --memory 2x --jitter multimodal:0.3:3 --json out/memory.json
  aioready train --hint auto --cap 2x --split-backward --jitter multimodal:0.3:3 --steps 4
  aioready train --hint zb-h1 --split-backward --microbatch-order ascending --steps 4
  aioready train --split-backward --csv out/spans.csv --metrics-port 9100 --steps 50
  aioready train --dashboard 8050 --steps 200   # then open http://127.0.0.1:8050/
  aioready train --trace trace.csv --sleep-only --json out/replay.json
  mpiexec -n 4 python -m aioready train --stages 4 --microbatches 8 --steps 5
  mpiexec -n 4 python -m aioready train --stages 8 --jitter multimodal:0.3:3  # auto: V or
      # interleaved, split backward or not, chosen before step 0; the schedule after step 1
  mpiexec -n 4 python -m aioready train --stages 2 --dp 2 --steps 5   # PP=2 x DP=2
  mpiexec -n 8 python -m aioready train --stages 2 --tp 2 --dp 2       # PP=2 x TP=2 x DP=2
  torchrun --nproc-per-node 4 -m aioready train --stages 2 --dp 2    # the same over gloo
  aioready train --steps 50 --checkpoint-dir ckpt --resume   # rerun it after a crash
"""


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "train", help="train a tiny GPT-style model with a paced pipeline",
        description="Train a small GPT-style model split into pipeline stages. In-process by "
        "default; under mpirun (more than one rank) each rank runs its own stages over the MPI "
        "transport. Every task takes at least its duration from --jitter or --trace (real "
        "compute plus a sleep for the rest), so strict and ready runs with the same --seed see "
        "the same durations.", epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, default=4, help="pipeline stages S (default 4)")
    p.add_argument("--microbatches", type=int, default=8, help="microbatches per step M")
    p.add_argument("--hint", default=None, help=f"{' | '.join(hint_names())}, a hint file, or "
                   "auto (measure the first step, then run the fastest schedule within --cap). "
                   "Default: auto, choosing before step 0 also the placement (--stages = 2 x "
                   "ranks: interleaved or V) and, unless given, --split-backward; 1f1b with "
                   "--mode strict, --memory, --dp or --tp")
    p.add_argument("--mode", choices=("ready", "strict"), default="ready")
    p.add_argument("--microbatch-order", default=None, choices=ORDERS,
                   help="run each step's microbatches as given or in a cost order of their "
                   "sizes (docs/policy.md \"The microbatch order\"); default: given, or with "
                   "--hint auto the order its chooser simulates fastest")
    p.add_argument("--sized-microbatches", action="store_true",
                   help="each microbatch's sequence length follows its size in the --jitter "
                   "model (multimodal: heavy ones FACTOR times longer, the longest --seq), so "
                   "its input bytes tell a microbatch order what its durations will be")
    p.add_argument("--policy", default="reserve",
                   choices=("reserve", "greedy", "light", "drain", "auto"),
                   help="ready mode's rule: reserve (default: keep the hint's next task's place, "
                   "backfill what ends in time), greedy (best-ranked ready task at once), light "
                   "(greedy, but a clearly lighter microbatch's forward goes first), drain "
                   "(greedy, but once all are admitted a W waits for announced gradients) or auto "
                   "(reserve, then whichever the first step says is faster)")
    p.add_argument("--cap", default=None,
                   help="in-flight microbatches per rank: N, N0,N1,... or Nx (N times the "
                   "hint's peak); default: the hint's peak")
    p.add_argument("--memory", default=None,
                   help="activation bytes per rank instead of --cap: 24GiB, 512MiB, 1.5GB, a "
                   "byte count, one per rank (8GiB,6GiB) or Nx (N times what the hint's own "
                   "order holds at its peak, measured)")
    p.add_argument("--jitter", default=None,
                   help="duration jitter spec, e.g. lognormal:0.5 or multimodal:0.3:3")
    p.add_argument("--seed", type=int, default=0, help="seed of model, data and jitter")
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="replay task durations from a trace CSV (step,stage,chunk,microbatch,"
                   "kind,ms)")
    p.add_argument("--trace-mode", choices=("floor", "add"), default="floor",
                   help="floor (default): a task takes at least its traced duration, its compute "
                   "inside; add: the compute, then a sleep of the whole duration (as a sleep "
                   "injected into the model does in another runtime's harness)")
    p.add_argument("--sleep-only", action="store_true",
                   help="tasks only sleep their --trace/--jitter durations: no model compute")
    p.add_argument("--steps", type=int, default=3, help="training steps")
    p.add_argument("--split-backward", action=argparse.BooleanOptionalAction, default=None,
                   help="separate B and W tasks (zero-bubble schedules need it); default: "
                   "chosen by hint auto, else off")
    p.add_argument("--task-ms", type=float, default=20.0,
                   help="base F duration in ms (B = 2F unsplit; 0: compute time only)")
    p.add_argument("--batch", type=int, default=2, help="sequences per microbatch")
    p.add_argument("--seq", type=int, default=32, help="sequence length")
    p.add_argument("--dim", type=int, default=32, help="model width")
    p.add_argument("--layers-per-stage", type=int, default=1, help="transformer blocks per stage")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--json", dest="json_out", metavar="OUT",
                   help="write a summary (step_time, lower_bound, efficiency lists in ms)")
    p.add_argument("--chrome-trace", metavar="OUT", help="write a Chrome/Perfetto trace JSON")
    p.add_argument("--png", metavar="OUT", help="write the last step's timeline PNG")
    p.add_argument("--csv", dest="csv_out", metavar="OUT", help="write every span as CSV")
    p.add_argument("--step-table", metavar="OUT", default=None,
                   help="write one row per step and rank (.csv or .parquet; docs/telemetry.md)")
    p.add_argument("--metrics-port", type=int, default=None, metavar="N",
                   help="serve Prometheus metrics on port N (+ rank under mpirun)")
    p.add_argument("--dashboard", type=int, default=None, metavar="PORT",
                   help="serve a live dashboard on http://127.0.0.1:PORT/ (rank 0; 0: any "
                   "free port)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--checkpoint-dir", metavar="D", default=None,
                   help="write a checkpoint of every rank's stages and optimizer to D after "
                   "each step (atomic; D/step-N/rank-R-of-W.pt)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest complete checkpoint in --checkpoint-dir")
    p.add_argument("--no-check-config", dest="check_config", action="store_false",
                   help="with --resume: accept a checkpoint of another hint, microbatch count "
                   "or split (the model and stages must still match)")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="with --resume: load a checkpoint written before SHA-256 checksums "
                   "(unverified)")
    p.add_argument("--key-file", metavar="F", default=None,
                   help="under mpirun or torchrun, seal every message between ranks "
                   "(AES-256-GCM) with the key in F (mode 600); default: $AIOREADY_KEY_FILE, "
                   "else plain")
    p.add_argument("--run-record", metavar="F", default=None,
                   help="append this run's record to F as JSON lines: configuration, package "
                   "versions, git revision, world layout, key fingerprint, start, end or error")
    p.add_argument("--on-nan", choices=("warn", "stop"), default="warn",
                   help="a loss that is not finite: warn (default) or stop the run")
    p.add_argument("--dp", type=int, default=1,
                   help="data-parallel replicas under mpiexec or torchrun (pipeline ranks = world / dp); "
                   "gradients are averaged over replicas while the step runs")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel size under mpiexec or torchrun: each block's MLP is split over tp "
                   "ranks (pipeline ranks = world / (tp * dp))")
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> Any:
    from ..runtime.autotune import parse_auto
    from .auto_start import default_auto
    from .trainer import TrainConfig
    hint = args.hint or ("auto" if default_auto(mode=args.mode, memory=args.memory, dp=args.dp,
                                                tp=args.tp) else "1f1b")
    split = args.split_backward
    if split is None and parse_auto(hint) != "":
        split = False  # only a plain "auto" chooses it
    return TrainConfig(
        stages=args.stages, microbatches=args.microbatches, hint=hint, mode=args.mode,
        cap=args.cap, memory=args.memory, jitter=args.jitter, seed=args.seed, trace=args.trace,
        trace_mode=args.trace_mode, steps=args.steps,
        split_backward=split, task_ms=args.task_ms, batch=args.batch,
        seq=args.seq, dim=args.dim, lr=args.lr, metrics_port=args.metrics_port,
        sleep_only=args.sleep_only, checkpoint_dir=args.checkpoint_dir, resume=args.resume,
        policy=args.policy, on_nan=args.on_nan, check_config=args.check_config,
        verify=args.verify,
        key_file=args.key_file,
        dp=args.dp, tp=args.tp, dashboard=args.dashboard,
        layers_per_stage=args.layers_per_stage, microbatch_order=args.microbatch_order,
        sized_microbatches=args.sized_microbatches)


def mpi_comm() -> Any:
    """COMM_WORLD when launched by mpirun/mpiexec with more than one rank, else None."""
    launched = any(k in os.environ for k in ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE",
                                             "PMIX_RANK"))
    if not launched:
        return None
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    comm = MPI.COMM_WORLD
    return comm if comm.Get_size() > 1 else None


def refuse_unserved_launch() -> None:
    """Several processes that aioready cannot connect (WORLD_SIZE > 1, but neither torchrun's
    full set of variables nor an MPI launcher's): each would silently train its own
    single-process pipeline. Say so and stop."""
    size = os.environ.get("WORLD_SIZE", "1").strip()
    if size.isdigit() and int(size) > 1:
        from ..errors import ConfigError
        raise ConfigError(f"launched as one of {size} processes (WORLD_SIZE={size}) without the "
                          "variables aioready connects by (torchrun's RANK, WORLD_SIZE, "
                          "LOCAL_RANK, MASTER_ADDR, or an MPI launcher's): each would train its "
                          "own copy", expected="mpiexec/mpirun, torchrun, or one process",
                          got=f"WORLD_SIZE={size} alone",
                          fix=f"mpiexec -n {size} python -m aioready train ... (or torchrun "
                          f"--nproc-per-node {size} -m aioready train ...)")


def job_comm() -> Any:
    """The job's communicator: a torch.distributed one (telemetry/torch_comm.py) under torchrun,
    else `mpi_comm()`. Without it torchrun started N independent single-process pipelines."""
    from ..launch import launcher
    if launcher() != "torchrun" or int(os.environ["WORLD_SIZE"]) <= 1:
        return mpi_comm()
    from ..telemetry.torch_comm import TorchComm
    from ..transports.torch_groups import resolve_group
    resolve_group()  # initialise the world group from torchrun's variables
    return TorchComm()


def run(args: argparse.Namespace) -> int:
    from ..launch import run as run_loop  # under mpirun: any error aborts every rank
    from .trainer import train, write_outputs
    cfg = config_from_args(args)
    comm = job_comm()
    if comm is None:
        refuse_unserved_launch()
    import torch
    torch.set_num_threads(1)  # a tiny model: one thread per rank's worker, no oversubscription
    rank = comm.Get_rank() if comm is not None else 0
    record = _record(args, cfg, rank, comm)
    with _Progress(cfg.steps if rank == 0 and not args.no_progress and cfg.steps > 1 else 0
                   ) as on_step:
        result = run_loop(_recorded(record, train(cfg, comm=comm, on_step=on_step)))
    if rank != 0:
        return 0
    for path in write_outputs(result, cfg, json_out=args.json_out,
                              chrome_trace=args.chrome_trace, png=args.png,
                              csv_out=args.csv_out, step_table=args.step_table):
        print(f"wrote {path}", file=sys.stderr)
    _print_summary(result, cfg)
    return 0


def _record(args: argparse.Namespace, cfg: Any, rank: int, comm: Any) -> Any:
    if not args.run_record:
        return None
    from .record import RunRecord
    world = comm.Get_size() if comm is not None else 1
    record = RunRecord(args.run_record, rank=rank, world_size=world)
    placement = _placement(cfg, world)
    key_file = cfg.key_file or os.environ.get("AIOREADY_KEY_FILE")
    fingerprint = None
    if key_file and world > 1:
        from ..transports.secure import key_fingerprint, load_key
        fingerprint = key_fingerprint(load_key(key_file))
    record.start(cfg, layout=None if placement is None else {
        r: list(placement.stages_of(r)) for r in range(placement.num_ranks)},
                 key_fingerprint=fingerprint)
    return record


def _placement(cfg: Any, world: int) -> Any:
    """The run's placement before it starts; None where a plain "auto" chooses it (several
    stages per rank: cli/auto_start.py)."""
    from ..runtime.autotune import parse_auto, start_hint
    from ..schedulers import make_hint
    auto = parse_auto(cfg.hint)
    if auto == "" and world > 1 and cfg.stages != world:
        return None
    split = bool(cfg.split_backward)
    return make_hint(cfg.hint if auto is None else auto or start_hint("linear", split),
                     num_stages=cfg.stages, num_microbatches=cfg.microbatches,
                     num_ranks=world if world > 1 else None, split_backward=split).placement


async def _recorded(record: Any, main: Any) -> Any:
    """`main`, with its end or its error appended to the run record (before any MPI_Abort)."""
    if record is None:
        return await main
    try:
        result = await main
    except BaseException as exc:
        record.error(exc)
        raise
    record.end(result)
    return result


def _print_summary(result: Any, cfg: Any) -> None:
    from ..memory import format_bytes
    where = (f"{result.world_size} {'torch.distributed' if result.transport else 'MPI'} ranks"
             if result.world_size > 1 else "in-process")
    if result.key_fingerprint:
        where += f", sealed with key {result.key_fingerprint}"
    greedy = cfg.mode == "ready" and cfg.policy != "reserve"
    how = f"{cfg.mode}/{cfg.policy}" if greedy else cfg.mode
    print(f"{how} {cfg.hint}, S={cfg.stages} M={cfg.microbatches}, {where}, "
          f"{result.durations}")
    if result.start is not None:
        print(f"hint=auto: started from {result.start.label}, budget {result.start.budget} "
              f"in flight per rank" + (f"\n{result.start.table}" if result.start.table else ""))
    for step, choice in result.choices:
        order = "" if choice.order == "given" else f"+{choice.order}"
        print(f"hint=auto: {choice.label}{order} {choice.how} from step {step}, caps "
              f"{list(choice.cap)}\n{choice.table}")
    for m, loss in zip(result.metrics, result.losses):
        lv = "-" if loss is None else f"{loss:.4f}"
        held = [b for b in m.peak_activation_bytes if b is not None]
        print(f"step {m.step}: loss {lv}  step {m.step_time * 1e3:8.1f} ms  lower bound "
              f"{m.lower_bound * 1e3:8.1f} ms  efficiency {m.efficiency:.3f}"
              + (f"  peak activations {format_bytes(max(held))}" if held else ""))


class _Progress:
    """A rich progress bar (step, loss, step time, efficiency) when `total` > 0."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.bar: Any = None

    def __enter__(self) -> Any:
        if not self.total:
            return None
        try:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
        except ImportError:
            return None
        self.bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[info]}"))
        self.task = self.bar.add_task("train", total=self.total, info="")
        self.bar.start()
        return self.update

    def update(self, step: int, metrics: Any, loss: float | None) -> None:
        lv = "-" if loss is None else f"{loss:.3f}"
        self.bar.update(self.task, advance=1, info=f"step {step} loss {lv} "
                        f"{metrics.step_time * 1e3:.0f} ms eff {metrics.efficiency:.2f}")

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.stop()
