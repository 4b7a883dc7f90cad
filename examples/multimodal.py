"""Multimodal-like microbatches: some carry image tokens, so sequence lengths differ.

    python examples/multimodal.py                  # strict vs ready, same durations
    python examples/multimodal.py --png out/mm.png # and the two timelines

A microbatch with an image prepends 48 "image tokens" (ids from a reserved range, standing in for
patch embeddings) to 16 text tokens; text-only ones have just the 16. Each microbatch is its own
tensor (a list of microbatches: shapes may differ), messages carry their shapes in the header, and
the compute of an image microbatch is really longer, at every stage. Tasks are paced in proportion
to their token count, so the imbalance is visible above timer noise; the same microbatches run
in `strict` and in `ready` mode (cap 2x the 1F1B peak); the second step of each is reported.
"""

from __future__ import annotations

import argparse

import torch

import aioready
from aioready.devices.base import TaskInfo
from aioready.devices.cpu import CPUDevice
from aioready.devices.paced import PacedDevice
from aioready.telemetry.metrics import step_metrics
from aioready.telemetry.spans import StepReport
from aioready.testing.models import gpt_stages, lm_loss

TEXT, IMAGE, VOCAB = 16, 48, 96


def batch(seed: int, microbatches: int, image_share: float
          ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[bool]]:
    gen = torch.Generator().manual_seed(seed)
    xs, ys, has_image = [], [], []
    for _ in range(microbatches):
        image = bool(torch.rand((), generator=gen) < image_share)
        text = torch.randint(0, 64, (2, TEXT + 1), generator=gen)
        tokens = torch.cat([torch.randint(64, VOCAB, (2, IMAGE), generator=gen), text], 1) \
            if image else text
        xs.append(tokens[:, :-1])
        ys.append(tokens[:, 1:])
        has_image.append(image)
    return xs, ys, has_image


async def run_mode(mode: str, args: argparse.Namespace) -> tuple[StepReport, float]:
    xs, ys, _ = batch(args.seed, args.microbatches, args.image_share)
    lengths = [x.shape[1] for x in xs]

    def duration(info: TaskInfo) -> float:  # proportional to tokens: F 0.5 ms/token, B 2x
        per_token = 0.5e-3 * (1 if info.kind == 0 else 2)
        return per_token * lengths[info.microbatch]

    model = gpt_stages(args.stages, vocab=VOCAB, dim=32, heads=2, seq=IMAGE + TEXT, seed=0)
    cap = None if mode == "strict" else 2 * args.stages
    pipe = aioready.Pipeline(model, lm_loss, microbatches=args.microbatches, hint="1f1b",
                             mode=mode, cap=cap,
                             device=lambda r: PacedDevice(CPUDevice(f"mm{r}"), duration))
    try:
        await pipe.step(xs, ys)  # warm-up: torch's first calls are slow
        loss = await pipe.step(xs, ys)
    finally:
        pipe.close()
    assert pipe.last_step is not None
    return pipe.last_step, float(loss)


async def main(args: argparse.Namespace) -> None:
    _, _, has_image = batch(args.seed, args.microbatches, args.image_share)
    print("microbatches:", " ".join("img" if i else "txt" for i in has_image))
    results = {}
    for mode in ("strict", "ready"):
        report, loss = await run_mode(mode, args)
        m = step_metrics(report)
        results[mode] = report
        print(f"{mode:6}  step {m.step_time * 1e3:7.1f} ms  lower bound "
              f"{m.lower_bound * 1e3:7.1f} ms  efficiency {m.efficiency:.2f}  loss {loss:.4f}")
    print(f"speedup of ready over strict: "
          f"{results['strict'].step_time / results['ready'].step_time:.2f}x")
    if args.png:
        from aioready.telemetry.plots import plot_compare
        print("wrote", plot_compare([results["strict"], results["ready"]], args.png))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--image-share", type=float, default=0.4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--png", default=None)
    torch.set_num_threads(1)
    aioready.run(main(p.parse_args()))
