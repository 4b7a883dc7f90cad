"""Train a small `transformers` Llama decoder split over MPI ranks, and compare with one process.

    mpiexec -n 4 python examples/hf_pipeline.py --steps 20 --compare

The model is built from a small random config (nothing is downloaded) on every rank from one
seed, cut by `aioready.split` into 2 stages per rank on the V placement, and trained with the
ZBV hint (split backward), activation recomputation on every stage and AdamW. The data is a
synthetic next-token task generated from the seed (a fixed random successor for each token,
with some noise), so every rank agrees on each batch without sending it and the loss can fall.
With --compare, rank 0 also trains an unsplit copy of the model in this process on the same
batches with the same optimizer and prints both loss curves; in float64 they agree to ~1e-12,
and the run fails if they differ by more than --tolerance. Needs `pip install 'aioready[mpi,examples]'`.
"""

from __future__ import annotations

import argparse
import copy
import os
import time

import numpy as np
import torch
from mpi4py import MPI

import aioready
from aioready.launch import run, say
from aioready.testing.models import lm_loss
from aioready.transports.mpi import MPITransport

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a config, not a checkpoint: never download


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-recompute", action="store_true")
    p.add_argument("--compare", action="store_true", help="also train unsplit on rank 0")
    p.add_argument("--tolerance", type=float, default=1e-8)
    return p.parse_args()


def build(args: argparse.Namespace, num_layers: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                      num_hidden_layers=num_layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=args.vocab,
                      max_position_embeddings=args.seq, use_cache=False)
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(cfg).double()


def make_batch(step: int, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """Token sequences that mostly follow a fixed random successor table."""
    successor = torch.randperm(args.vocab, generator=torch.Generator().manual_seed(args.seed))
    gen = torch.Generator().manual_seed(args.seed * 100_003 + step + 1)
    tokens = torch.empty(args.batch, args.seq + 1, dtype=torch.int64)
    tokens[:, 0] = torch.randint(0, args.vocab, (args.batch,), generator=gen)
    for i in range(args.seq):
        noise = torch.rand(args.batch, generator=gen) < 0.1
        rand = torch.randint(0, args.vocab, (args.batch,), generator=gen)
        tokens[:, i + 1] = torch.where(noise, rand, successor[tokens[:, i]])
    return tokens[:, :-1], tokens[:, 1:]


def unsplit_curve(model: torch.nn.Module, args: argparse.Namespace) -> list[float]:
    """The same training in one process: microbatch losses / M summed, AdamW."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    M, curve = args.microbatches, []
    for step in range(args.steps):
        x, y = make_batch(step, args)
        total = 0.0
        for xm, ym in zip(x.chunk(M), y.chunk(M)):
            loss = lm_loss(model(xm).logits, ym) / M
            loss.backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        curve.append(total)
    return curve


async def main(args: argparse.Namespace) -> None:
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    num_stages = 2 * size  # V placement: rank r holds stages r and 2R-1-r
    model = build(args, num_layers=num_stages)
    reference = copy.deepcopy(model) if args.compare and rank == 0 else None
    stages = aioready.split(model, stages=num_stages, layers="model.layers",
                            before=["model.embed_tokens", "model.rotary_emb"],
                            after=["model.norm", "lm_head"], placement="v")
    mine = stages.of_rank(rank)
    transport = MPITransport(comm)
    pipe = aioready.Pipeline(mine, lm_loss, microbatches=args.microbatches, hint="zbv",
                             split_backward=True, transport=transport,
                             recompute=not args.no_recompute)
    opt = torch.optim.AdamW(stages.parameters_of(rank), lr=args.lr)
    curve = np.zeros(args.steps)
    for step in range(args.steps):
        x, y = make_batch(step, args)
        start = time.perf_counter()
        loss = await pipe.step(x, y)
        took = time.perf_counter() - start
        opt.step()
        opt.zero_grad(set_to_none=True)
        if loss is not None:  # the rank holding the last stage (rank 0 on the V placement)
            curve[step] = float(loss)
            say(f"step {step:3d}  loss {float(loss):.6f}  {took * 1e3:7.1f} ms")
    await transport.close()
    pipe.close()
    comm.Allreduce(MPI.IN_PLACE, curve, op=MPI.SUM)  # only one rank has a nonzero curve
    if reference is not None:
        compare(curve, unsplit_curve(reference, args), args.tolerance)


def compare(curve: np.ndarray, ref: list[float], tolerance: float) -> None:
    worst = float(np.max(np.abs(curve - np.array(ref))))
    for step, (a, b) in enumerate(zip(curve, ref)):
        say(f"curve step {step:3d}  pipeline {a:.12f}  one-process {b:.12f}")
    say(f"max |loss difference| {worst:.3e} ({'ok' if worst <= tolerance else 'FAILED'})")
    if worst > tolerance:
        raise RuntimeError(f"the pipeline's loss curve differs from one-process training by "
                           f"{worst:.3e} > {tolerance}")


if __name__ == "__main__":
    run(main(parse()))
