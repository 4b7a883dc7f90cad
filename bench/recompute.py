"""Activation recomputation: peak activation memory and step time, with and without, in-process.

A GPT (the project's, 8 blocks, dim 128, sequence 128) cut by `aioready.split` into 4 stages,
8 microbatches of 4 sequences, for 1f1b, zb-h1 (split backward) and zbv (V placement, split
backward). For each hint, with `recompute=False` and `True`, taken side by side in one run:
- peak activation memory: the most bytes autograd graphs held for backward at once during a step
  (testing.memory.SavedTensorMeter; deterministic, parameters excluded), on the inline device;
- step time: the median of several steps on the cpu device (one thread per rank), after a warm-up,
  alternating the two pipelines step by step so that machine load hits both alike.
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


def pipes(base: torch.nn.Module, hint: str, split: bool, device: str
          ) -> tuple[list[aioready.Pipeline], torch.nn.Module]:
    """Two pipelines over one copy of the model: without and with recompute."""
    m = copy.deepcopy(base)
    placement = "v" if hint == "zbv" else "linear"
    stages = list(aioready.split(m, stages=4, placement=placement, **NAMES))
    return [aioready.Pipeline(stages, lm_loss, microbatches=8, hint=hint, split_backward=split,
                              recompute=rc, device=device) for rc in (False, True)], m


def measure(base: torch.nn.Module, hint: str, split: bool, steps: int, xs: list, ys: list
            ) -> tuple[list[int], list[float]]:
    """Peaks and median step times, without and with recompute; the timed steps alternate
    between the two, so a change of machine load hits both alike."""
    async def peaks() -> list[int]:
        (plain, again), m = pipes(base, hint, split, "inline")
        out = []
        for pipe in (plain, again):
            with SavedTensorMeter(m.parameters()) as meter:
                await pipe.step(xs, ys)
            pipe.close()
            out.append(meter.peak)
        return out

    async def times() -> list[float]:
        both, _ = pipes(base, hint, split, "cpu")
        samples: list[list[float]] = [[], []]
        for pipe in both:
            await pipe.step(xs, ys)  # warm-up
        for _ in range(steps):
            for i, pipe in enumerate(both):
                start = time.perf_counter()
                await pipe.step(xs, ys)
                samples[i].append(time.perf_counter() - start)
        for pipe in both:
            pipe.close()
        return [median(s) for s in samples]

    return aioready.run(peaks()), aioready.run(times())


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
        (p0, p1), (t0, t1) = measure(base, hint, split, steps, xs, ys)
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
