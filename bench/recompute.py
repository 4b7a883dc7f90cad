"""Activation recomputation: peak activation memory and step time, with and without, in-process.

A GPT (the project's, 8 blocks, dim 128, sequence 128) cut by `aioready.split` into 4 stages,
8 microbatches of 4 sequences, for 1f1b, zb-h1 (split backward) and zbv (V placement, split
backward). For each hint, with `recompute=False` and `True`, taken side by side in one run:
- peak activation memory: the most bytes autograd graphs held for backward at once during a step
  (testing.memory.SavedTensorMeter; deterministic, parameters excluded), on the inline device;
- step time: the median of several steps on the cpu device (one thread per rank), after a warm-up.
The ratios (recompute / none) are the figures; recompute should cut memory and cost roughly one
more forward per microbatch (up to ~1/3 more compute).

Run: python -m bench.recompute [--quick]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

import aioready
from aioready.testing.memory import SavedTensorMeter
from aioready.testing.models import gpt_stages, lm_loss

from .common import median, write_result

TIMEOUT_S = 900
HINTS = [("1f1b", False), ("zb-h1", True), ("zbv", True)]
NAMES = dict(layers="blocks", before=["tok", "pos"], after=["ln_f", "head"])


def model(dim: int, seq: int) -> torch.nn.Module:
    return gpt_stages(1, layers_per_stage=8, vocab=256, dim=dim, heads=4, seq=seq)[0]


def data(M: int, seq: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randint(0, 256, (4, seq), generator=gen) for _ in range(M)]
    ys = [torch.randint(0, 256, (4, seq), generator=gen) for _ in range(M)]
    return xs, ys


def measure(base: torch.nn.Module, hint: str, split: bool, recompute: bool, steps: int,
            xs: list, ys: list) -> tuple[int, float]:
    m = copy.deepcopy(base)
    placement = "v" if hint == "zbv" else "linear"
    stages = list(aioready.split(m, stages=4, placement=placement, **NAMES))

    async def peak() -> int:
        pipe = aioready.Pipeline(stages, lm_loss, microbatches=len(xs), hint=hint,
                                 split_backward=split, recompute=recompute, device="inline")
        try:
            with SavedTensorMeter(m.parameters()) as meter:
                await pipe.step(xs, ys)
            return meter.peak
        finally:
            pipe.close()

    async def timed() -> float:
        pipe = aioready.Pipeline(stages, lm_loss, microbatches=len(xs), hint=hint,
                                 split_backward=split, recompute=recompute)
        try:
            await pipe.step(xs, ys)  # warm-up
            out = []
            for _ in range(steps):
                start = time.perf_counter()
                await pipe.step(xs, ys)
                out.append(time.perf_counter() - start)
            return median(out)
        finally:
            pipe.close()

    return aioready.run(peak()), aioready.run(timed())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dim, seq, steps = (64, 64, 2) if args.quick else (128, 128, 5)
    base = model(dim, seq)
    xs, ys = data(8, seq)
    lines = ["| hint | peak activations, none (MiB) | with recompute (MiB) | memory ratio | "
             "step, none (ms) | with recompute (ms) | time ratio |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for hint, split in HINTS:
        p0, t0 = measure(base, hint, split, False, steps, xs, ys)
        p1, t1 = measure(base, hint, split, True, steps, xs, ys)
        lines.append(f"| {hint} | {p0 / 2**20:.1f} | {p1 / 2**20:.1f} | {p1 / p0:.2f} | "
                     f"{t0 * 1e3:.0f} | {t1 * 1e3:.0f} | {t1 / t0:.2f} |")
        print(lines[-1], flush=True)
    body = (f"GPT split into 4 stages by `aioready.split`: 8 blocks, dim {dim}, sequence {seq}, "
            f"8 microbatches of 4 sequences, float32, in-process. Peak activations: the most "
            f"bytes saved for backward at once during a step; step time: median of {steps} "
            f"steps on the cpu device.\n\n" + "\n".join(lines) + "\n")
    write_result("recompute", body, "python -m bench.recompute" + (" --quick" if args.quick
                                                                    else ""))


if __name__ == "__main__":
    main()
