"""Pipeline x data parallel (x tensor parallel) over MPI vs one unsplit model on the whole batch.

Usage: mpiexec -n R python tests/mpi_scripts/dp.py TP DP CASE [CASE ...]
   or: torchrun --nproc-per-node R tests/mpi_scripts/dp.py TP DP CASE [CASE ...] (the grid is
       then split into torch.distributed groups, gloo; every case but zero runs there too)
CASE = hint:mode:split[:feature,...], features: clip (clip_grad_norm_ every step), weight
(token-weighted loss, microbatches of different sizes), tied (a weight shared by the first and
the last stage), scaler (a GradScaler; an inf injected on the last world rank at step 1 must make
every rank skip that step), zero (AdamW through dp.zero.ZeroOptimizer, state sharded over the
replicas, against AdamW on the unsplit model). PP = R / (TP * DP). Every rank builds the same full model from a
fixed seed; replica d takes microbatches d*M .. d*M+M-1 of a batch of DP*M; each case trains 3
steps with SGD, and the reference (the unsplit model, every microbatch, one process) does the
same. Every task is followed by a random delay drawn per world rank, so replicas finish their
stages in different orders. World rank 0 prints `RESULT case loss_diff= grad_diff= norm_diff=
loss_seen= reductions= overlapped= skipped_min= skipped_max=`: the most buckets a rank reduced,
the fewest chunk reductions a rank started while it still had a task of the step to start
(interleaved placements: one per step at least), and the fewest and most skipped steps a rank
saw, the smallest unclipped norm (above the clip: clipping changed the gradients), and with
zero the largest share of AdamW's state a rank holds (about 1/DP).
CASE = grid_errors: a grid that does not fit the world is refused on every rank.
CASE = ckpt (4 ranks, directory in $DP_CKPT_DIR): PP=2 x DP=2 trains 2 steps writing checkpoints
(replica 0 writes), a fresh pipeline on the same grid resumes from them on every replica, and a
PP=4 pipeline is refused with an error naming both grids.
"""

import copy
import random
import sys

import numpy as np
import torch
from torch import nn

from aioready.devices.cpu import CPUDevice
from aioready.devices.delayed import DelayedDevice
from aioready.dp.cross_stage import GradScaler
from aioready.errors import ConfigError
from aioready.launch import launcher, run, say
from aioready.runtime.pipeline import Pipeline
from aioready.schedulers import HINTS, make_hint
from aioready.testing.helpers import make_mlp_stages, mse_loss
from aioready.tp.grid import ProcessGrid

WIDTH, STEPS, LR, CLIP, SCALE = 16, 3, 0.05, 0.05, 2.0 ** 10
TORCH = launcher() == "torchrun"


class TorchWorld:
    """The three calls of COMM_WORLD this script makes, over the torch.distributed world."""

    def __init__(self) -> None:
        import torch.distributed as dist
        dist.init_process_group("gloo")
        self.dist = dist

    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's names
        return self.dist.get_rank()

    def Get_size(self) -> int:  # noqa: N802
        return self.dist.get_world_size()

    def Barrier(self) -> None:  # noqa: N802
        self.dist.barrier()


if TORCH:
    WORLD = TorchWorld()
else:
    from mpi4py import MPI
    WORLD = MPI.COMM_WORLD


def batch(n: int, step: int, varlen: bool) -> tuple[list, list]:
    gen = torch.Generator().manual_seed(1000 + step)
    rows = [1 + (3 * m + step) % 4 if varlen else 2 for m in range(n)]
    xs = [torch.randn(r, 3, WIDTH, generator=gen, dtype=torch.float64) for r in rows]
    ys = [torch.randn(r, 3, WIDTH, generator=gen, dtype=torch.float64) for r in rows]
    return xs, ys


def weighted_mse(out: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
    return mse_loss(out, target), out.shape[0]


def all_max(comm, value: float) -> float:
    if TORCH:
        t = torch.tensor([float(value)], dtype=torch.float64)
        comm.dist.all_reduce(t, op=comm.dist.ReduceOp.MAX)
        return float(t[0])
    out = np.zeros(1)
    comm.Allreduce(np.array([float(value)]), out, op=MPI.MAX)
    return float(out[0])


def full_model(S: int, seed: int, tied: bool) -> list[nn.Module]:
    """The stages; with `tied`, stage 0 starts with a Linear sharing the last Linear's weight."""
    stages = make_mlp_stages(S, width=WIDTH, seed=seed)
    if tied:
        stages[0].insert(0, nn.Linear(WIDTH, WIDTH, bias=False).double())
        stages[0][0].weight = stages[-1][-1].weight
    return stages


def build(comms, tp: int, S: int, seed: int, tied: bool):
    """(this rank's modules by stage, the reference stages, grad-diff function, device)."""
    world_rank = WORLD.Get_rank()
    rng = random.Random(f"{seed}/{world_rank}")
    inner = CPUDevice(f"rank{world_rank}")
    device = DelayedDevice(inner, lambda info: rng.uniform(0.0, 2e-3))
    if tp == 1:
        ref = full_model(S, seed, tied)
        mine = [copy.deepcopy(s) for s in ref]  # one copy per stage: ties broken, as on ranks

        def diff(stages):
            return max(float((p.grad - q.grad).abs().max()) for s in stages
                       for p, q in zip(mine[s].parameters(), ref[s].parameters()))
        return mine, ref, diff, device
    from aioready.tp.collectives import MPITPComm, TPDevice
    from aioready.tp.layers import make_tp_mlp_stages, max_tp_grad_diff
    if TORCH:
        from aioready.tp.torch_collectives import TorchTPComm
        tpcomm = TorchTPComm(comms.tp, timeout=20.0)
    else:
        tpcomm = MPITPComm(comms.tp, timeout=20.0)
    ref, shards = make_tp_mlp_stages(S, tpcomm, width=WIDTH, seed=seed)

    def diff(stages):
        return max_tp_grad_diff([ref[s] for s in stages], [shards[s] for s in stages], tpcomm)
    return shards, ref, diff, TPDevice(device, tpcomm)


def reference(model: nn.Sequential, xs, ys, weighted: bool) -> float:
    """Gradients of the whole model on the whole batch, in place; returns the loss."""
    model.zero_grad(set_to_none=True)
    norm = sum(x.shape[0] for x in xs) if weighted else len(xs)
    total = 0.0
    for x, y in zip(xs, ys):
        loss = mse_loss(model(x), y) * (x.shape[0] if weighted else 1) / norm
        loss.backward()
        total += float(loss.detach())
    return total


async def one_case(tp: int, dp: int, case: str, seed: int) -> None:
    hint, mode, split, *rest = case.split(":")
    features = set(rest[0].split(",")) if rest else set()
    split_b, weighted = split == "1", "weight" in features
    world = WORLD
    grid = ProcessGrid.for_world(world.Get_size(), tp=tp, dp=dp)
    comms = grid.torch_groups() if TORCH else grid.split()
    c = comms.coords
    S = grid.pp_size * HINTS[hint].chunks
    M = 2 * grid.pp_size
    modules, ref, diff, device = build(comms, tp, S, seed, "tied" in features)
    order = make_hint(hint, num_stages=S, num_ranks=grid.pp_size, num_microbatches=M,
                      split_backward=split_b)
    mine = list(order.placement.stages_of(c.pp_rank))
    scaler = GradScaler(SCALE) if "scaler" in features else None
    pipe = Pipeline([modules[s] for s in mine], weighted_mse if weighted else mse_loss,
                    microbatches=M, hint=hint, mode=mode, split_backward=split_b, device=device,
                    grid=comms if tp > 1 else ProcessGrid(pp_size=grid.pp_size, dp_size=dp),
                    normalize="weight" if weighted else "microbatches", scaler=scaler,
                    tied={"proj": {0: "0.weight", S - 1: f"{len(ref[-1]) - 1}.weight"}}
                    if "tied" in features else None)
    model = nn.Sequential(*ref)
    if "zero" in features:
        from aioready.dp.zero import ZeroOptimizer
        zero = ZeroOptimizer(pipe, torch.optim.AdamW, lr=LR, bucket_bytes=4096)
        ref_opt = torch.optim.AdamW(model.parameters(), lr=LR)
    else:
        zero = None
        opt = torch.optim.SGD([p for s in mine for p in modules[s].parameters()], lr=LR)
        ref_opt = torch.optim.SGD(model.parameters(), lr=LR)
    gdiff = ldiff = ndiff = 0.0
    norm_min = float("inf")
    seen = early = skipped = 0
    for step in range(STEPS):
        xs, ys = batch(dp * M, step, weighted)
        part = slice(c.dp * M, (c.dp + 1) * M)
        inject = scaler is not None and step == 1 and world.Get_rank() == world.Get_size() - 1
        hook = (next(modules[mine[0]].parameters()).register_hook(lambda g: g * float("inf"))
                if inject else None)
        loss = await pipe.step(xs[part] if 0 in mine else None,
                               ys[part] if S - 1 in mine else None)
        if hook is not None:
            hook.remove()
        report = pipe.last_step
        last_start = max(span.start for span in report.spans)
        if pipe.grad_reducer is not None:
            early += sum(1 for _, start, _ in pipe.grad_reducer.spans
                         if report.start <= start < last_start)
        ref_loss = reference(model, xs, ys, weighted)
        if "clip" in features:
            norm = await pipe.clip_grad_norm_(CLIP)
            want = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            ndiff = max(ndiff, abs(float(norm) - float(want)))
            norm_min = min(norm_min, float(want))
        if scaler is not None and scaler.found_inf:
            skipped += 1
            before = [p.detach().clone() for s in mine for p in modules[s].parameters()]
            scaler.step(opt)
            scaler.update()
            after = [p for s in mine for p in modules[s].parameters()]
            ldiff = max([ldiff] + [float((a - b.detach()).abs().max()) for a, b in zip(before, after)])
        else:
            gdiff = max(gdiff, diff(mine))
            if loss is not None:
                seen += 1
                ldiff = max(ldiff, abs(float(loss) - ref_loss))
            if zero is not None:
                await zero.step()
            elif scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            ref_opt.step()
        if zero is not None:
            zero.zero_grad()
            pdiff = max(float((p.detach() - q.detach()).abs().max()) for s in mine
                        for p, q in zip(modules[s].parameters(), ref[s].parameters()))
            gdiff = max(gdiff, pdiff)  # the parameters after the sharded step, too
        else:
            opt.zero_grad(set_to_none=True)
    reductions = pipe.grad_reducer.num_buckets if pipe.grad_reducer is not None else 0
    local = sum(p.numel() for s in mine for p in modules[s].parameters())
    state = -1.0 if zero is None else zero.state_numel() / (2 * local)  # AdamW: 2 moments
    if zero is not None:
        zero.close()
    await pipe.grid.close()
    pipe.close()
    out = [all_max(world, v) for v in (gdiff, ldiff, ndiff, seen, reductions, -early,
                                       -skipped, skipped, -norm_min, state)]
    if world.Get_rank() == 0:
        say(f"RESULT {case} grad_diff={out[0]:.3e} loss_diff={out[1]:.3e} "
            f"norm_diff={out[2]:.3e} loss_seen={int(out[3])} reductions={int(out[4])} "
            f"overlapped={int(-out[5])} skipped_min={int(-out[6])} skipped_max={int(out[7])} "
            f"norm_min={-out[8]:.3e} zero_state={out[9]:.3f}")


def grid_errors() -> None:
    world = WORLD
    texts = []
    for make in (lambda: Pipeline([torch.nn.Linear(2, 2)], mse_loss, microbatches=2,
                                  grid=ProcessGrid(pp_size=3, dp_size=2)),
                 lambda: ProcessGrid.for_world(world.Get_size(), dp=3)):
        try:
            make()
            texts.append("accepted")
        except ConfigError as exc:
            texts.append(str(exc).replace(" ", "_").replace("\n", "_"))
    if world.Get_rank() == 0:
        say("RESULT grid_errors " + " ".join(f"error{i}={t}" for i, t in enumerate(texts)))


async def checkpoints() -> None:
    import os
    from pathlib import Path

    from aioready.errors import CheckpointError
    from aioready.runtime.checkpoint import load_checkpoint, save_checkpoint
    world = WORLD
    root = Path(os.environ["DP_CKPT_DIR"])
    grid = ProcessGrid(pp_size=2, dp_size=2)
    stages = make_mlp_stages(2, width=WIDTH, seed=1)
    pipe = Pipeline([stages[world.Get_rank() % 2]], mse_loss, microbatches=4, grid=grid)
    c = pipe.grid.comms.coords
    module = stages[c.pp_rank]
    opt = torch.optim.SGD(module.parameters(), lr=LR, momentum=0.9)
    for step in range(2):
        xs, ys = batch(8, step, False)
        part = slice(c.dp * 4, c.dp * 4 + 4)
        await pipe.step(xs[part] if c.pp_rank == 0 else None, ys[part] if c.pp_rank else None)
        opt.step()
        opt.zero_grad(set_to_none=True)
        save_checkpoint(root, pipe, opt)
    await pipe.grid.close()
    pipe.close()
    world.Barrier()
    files = sorted(p.name for p in (root / "step-00000002").iterdir())
    fresh = make_mlp_stages(2, width=WIDTH, seed=2)[c.pp_rank]
    again = Pipeline([fresh], mse_loss, microbatches=4, grid=grid)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=LR, momentum=0.9)
    step = load_checkpoint(root, again, fresh_opt)
    same = all(torch.equal(a, b) for a, b in zip(module.state_dict().values(),
                                                 fresh.state_dict().values()))
    await again.grid.close()
    again.close()
    other = Pipeline([make_mlp_stages(4, width=WIDTH)[world.Get_rank()]], mse_loss,
                     microbatches=4, grid=ProcessGrid(pp_size=4))
    try:
        load_checkpoint(root, other)
        refused = "accepted"
    except CheckpointError as exc:
        refused = str(exc).replace(" ", "_")
    await other.grid.close()
    other.close()
    ok = all_max(world, 0.0 if same and step == 2 else 1.0) == 0.0
    if world.Get_rank() == 0:
        say(f"RESULT ckpt files={','.join(files)} resumed={int(ok)} refused={refused}")


async def main() -> None:
    tp, dp = int(sys.argv[1]), int(sys.argv[2])
    for i, case in enumerate(sys.argv[3:]):
        if case == "grid_errors":
            grid_errors()
        elif case == "ckpt":
            await checkpoints()
        else:
            await one_case(tp, dp, case, seed=100 + i)
        WORLD.Barrier()


if __name__ == "__main__":
    run(main())
