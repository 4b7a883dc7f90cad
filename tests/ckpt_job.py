"""A small training run for the checkpoint tests: prints `step loss.hex()` per step, checkpoints
after each step, and can SIGKILL itself after a given step or resume from the latest checkpoint.

Data come from the global torch and python RNGs, so a resumed run only matches an uninterrupted
one if the checkpoint restored them too.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal

import torch

from aioready.runtime import checkpoint
from aioready.runtime.pipeline import Pipeline
from aioready.testing.helpers import make_mlp_stages, mse_loss


def build(width: int = 16) -> tuple[Pipeline, list[torch.optim.Optimizer]]:
    stages = make_mlp_stages(4, width=width, seed=1)
    opts = [torch.optim.Adam(s.parameters(), lr=1e-2) for s in stages]
    return Pipeline(stages, mse_loss, microbatches=4, hint="1f1b", mode="strict"), opts


async def main(args: argparse.Namespace) -> None:
    torch.manual_seed(1234)
    random.seed(99)
    pipe, opts = build(args.width)
    start = checkpoint.resume(args.dir, pipe, opts) if args.resume else 0
    for step in range(start, args.steps):
        x = torch.randn(8, args.width, dtype=torch.float64)
        y = torch.randn(8, args.width, dtype=torch.float64) + random.random()
        for o in opts:
            o.zero_grad()
        loss = await pipe.step(x, y)
        for o in opts:
            o.step()
        print(step, float(loss).hex(), flush=True)
        if args.dir:
            checkpoint.save_checkpoint(args.dir, pipe, opts)
        if step + 1 == args.kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
    pipe.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--dir", default=None)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--kill-after", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--width", type=int, default=16)
    asyncio.run(main(p.parse_args()))
