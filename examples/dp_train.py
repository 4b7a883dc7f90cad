"""Train a residual MLP with pipeline x data parallelism under MPI (copy this to start).

    mpiexec -n 4 python examples/dp_train.py --dp 2 --steps 20            # PP=2 x DP=2
    mpiexec -n 8 python examples/dp_train.py --dp 2 --hint interleaved-1f1b --split-backward
    mpiexec -n 4 python examples/dp_train.py --dp 2 --checkpoint-dir ckpt   # rerun it to resume

The world splits into DP replicas of a PP-stage pipeline (`ProcessGrid.for_world`: TP rank
fastest, then pipeline rank, then replica). Every rank builds the same model from a seed and
keeps its stages; replica d trains on microbatches d*M .. d*M+M-1 of each global batch. Each
stage's gradients are averaged over the replicas while the step runs (from the moment the
stage's last backward piece ends), the global gradient norm is clipped over every stage and
replica, and the optimizer steps on every rank. World rank 0 prints the loss, which is the mean
over the whole global batch. With --check, step 0 is compared against the unsplit model.
"""

from __future__ import annotations

import argparse
import time

import torch
from mpi4py import MPI

from aioready.launch import run
from aioready.runtime.checkpoint import resume, save_checkpoint
from aioready.runtime.pipeline import Pipeline
from aioready.schedulers import HINTS, make_hint
from aioready.testing.helpers import make_mlp_stages, mse_loss, reference_step
from aioready.tp.grid import ProcessGrid


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dp", type=int, default=2, help="data-parallel replicas")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--microbatches", type=int, default=8, help="per replica")
    p.add_argument("--rows", type=int, default=8, help="samples per microbatch")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--hint", default="1f1b", choices=sorted(HINTS))
    p.add_argument("--mode", default="ready", choices=["ready", "strict"])
    p.add_argument("--split-backward", action="store_true")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip", type=float, default=1.0, help="max global gradient norm")
    p.add_argument("--checkpoint-dir", default=None, help="save each step; resume if present")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="compare step 0 with the unsplit model")
    return p.parse_args()


def global_batch(step: int, args: argparse.Namespace) -> tuple[list, list]:
    """All replicas' microbatches (every rank derives them from the seed, nothing is sent)."""
    gen = torch.Generator().manual_seed(args.seed * 100_003 + step)
    n = args.dp * args.microbatches
    xs = [torch.randn(args.rows, args.width, generator=gen, dtype=torch.float64)
          for _ in range(n)]
    return xs, [torch.sin(x).roll(1, dims=1) for x in xs]


async def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    grid = ProcessGrid.for_world(world.Get_size(), dp=args.dp)
    comms = grid.split()
    c = comms.coords
    num_stages = grid.pp_size * HINTS[args.hint].chunks
    hint = make_hint(args.hint, num_stages=num_stages, num_ranks=grid.pp_size,
                     num_microbatches=args.microbatches, split_backward=args.split_backward)
    stage_ids = hint.placement.stages_of(c.pp_rank)
    full = make_mlp_stages(num_stages, width=args.width, hidden=2 * args.width, seed=args.seed)
    mine = [full[s] for s in stage_ids]
    pipe = Pipeline(mine, mse_loss, microbatches=args.microbatches, hint=hint, mode=args.mode,
                    split_backward=args.split_backward, grid=comms)
    opt = torch.optim.AdamW([p for m in mine for p in m.parameters()], lr=args.lr)
    start = resume(args.checkpoint_dir, pipe, opt) if args.checkpoint_dir else 0
    first, last = 0 in stage_ids, num_stages - 1 in stage_ids
    part = slice(c.dp * args.microbatches, (c.dp + 1) * args.microbatches)
    for step in range(start, args.steps):
        xs, ys = global_batch(step, args)
        t0 = time.perf_counter()
        loss = await pipe.step(xs[part] if first else None, ys[part] if last else None)
        if args.check and step == start:
            check(args, full, stage_ids, xs, ys, loss, world)
        norm = await pipe.clip_grad_norm_(args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if args.checkpoint_dir:
            save_checkpoint(args.checkpoint_dir, pipe, opt)  # replica 0 writes
        if last and c.dp == 0 and c.tp_rank == 0:
            print(f"step {step}: loss {float(loss):.5f}  grad norm {float(norm):.3f}  "
                  f"{(time.perf_counter() - t0) * 1e3:.1f} ms", flush=True)
    await pipe.grid.close()
    pipe.close()


def check(args: argparse.Namespace, full: list, stage_ids: tuple, xs: list, ys: list,
          loss: object, world: object) -> None:
    """Gradients (after the DP mean) and loss against the unsplit model on the global batch."""
    model = make_mlp_stages(len(full), width=args.width, hidden=2 * args.width, seed=args.seed)
    ref_loss, ref = reference_step(model, mse_loss, xs, ys)
    diff = max(float((p.grad - q.grad).abs().max()) for s in stage_ids
               for p, q in zip(full[s].parameters(), ref[s].parameters()))
    if loss is not None:
        diff = max(diff, abs(float(loss) - float(ref_loss)))
    worst = world.allreduce(diff, op=MPI.MAX)  # type: ignore[attr-defined]
    if world.Get_rank() == 0:  # type: ignore[attr-defined]
        print(f"check: max |pipeline - unsplit| = {worst:.2e} (gradients and loss)", flush=True)
    if worst > 1e-10:
        raise SystemExit(f"mismatch {worst:.2e}")


if __name__ == "__main__":
    run(main(parse()))
