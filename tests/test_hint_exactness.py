"""Every hint trains exactly (float64, 1e-10 against the unsplit model), in-process, in both
modes.

The grid (every hint x S in {2, 4, 8} x M in {1, 4, 8, 16} x both modes) runs with real torch
compute on tiny stages (width 8, one block per stage) under the simulated device on the virtual
clock: strict mode with unit durations, ready mode with seeded random durations so that tasks run
out of hint order. The M=16 column is marked heavy (about half the compute; run by make bench);
test_hint_timing.py covers M=16 without compute. A few cases also run on the real CPU device
(threads, wall clock).
"""

from __future__ import annotations

import random

import pytest
import torch

from aioready.clock import run_virtual
from aioready.devices import SimDevice
from aioready.runtime.pipeline import Pipeline
from aioready.schedulers import HINTS, hint_names, make_hint
from aioready.testing.helpers import make_mlp_stages, max_grad_diff, mse_loss, reference_step

TOL = 1e-10
torch.set_num_threads(1)  # tiny tensors: intra-op threads only contend on a shared machine


def cases() -> list[tuple[str, bool]]:
    out = []
    for name in hint_names():
        need = HINTS[name].needs_split
        out += [(name, s) for s in ((need,) if need is not None else (False, True))]
    return out


def batch(M: int, seed: int = 1) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(2, 8, generator=gen, dtype=torch.float64) for _ in range(M)]
    ys = [torch.randn(2, 8, generator=gen, dtype=torch.float64) for _ in range(M)]
    return xs, ys


def check(name: str, split: bool, S: int, M: int, mode: str, device: object) -> None:
    stages = make_mlp_stages(S, width=8, hidden=8, blocks_per_stage=1)
    xs, ys = batch(M)
    ref_loss, ref = reference_step(stages, mse_loss, xs, ys)
    hint = make_hint(name, num_stages=S, num_microbatches=M, split_backward=split)

    async def main() -> torch.Tensor:
        pipe = Pipeline(stages, mse_loss, microbatches=M, hint=hint, mode=mode,
                        split_backward=split, device=device)
        try:
            return await pipe.step(xs, ys)  # type: ignore[no-any-return]
        finally:
            pipe.close()

    loss = run_virtual(main()) if isinstance(device, SimDevice) else __import__(
        "aioready").run(main())
    assert abs(float(loss) - float(ref_loss)) <= TOL
    assert max_grad_diff(stages, ref) <= TOL


GRID = [pytest.param(S, M, marks=[pytest.mark.heavy] if M == 16 else [], id=f"S{S}-M{M}")
        for S in (2, 4, 8) for M in (1, 4, 8, 16)]


@pytest.mark.parametrize("mode", ["strict", "ready"])
@pytest.mark.parametrize("S,M", GRID)
@pytest.mark.parametrize("name,split", cases())
def test_exact_sim_grid(name: str, split: bool, S: int, M: int, mode: str) -> None:
    rng = random.Random(S * 100 + M)
    if mode == "strict":
        device = SimDevice(lambda info: 1.0, run_compute=True)
    else:
        device = SimDevice(lambda info: rng.lognormvariate(0.0, 0.7), run_compute=True)
    check(name, split, S, M, mode, device)


@pytest.mark.parametrize("mode", ["strict", "ready"])
@pytest.mark.parametrize("name,split", [("interleaved-1f1b", False), ("zbv", True),
                                        ("bfw", True)])
def test_exact_cpu_device(name: str, split: bool, mode: str) -> None:
    check(name, split, 4, 4, mode, "cpu")


def test_1f1b_with_fewer_microbatches_than_stages_is_valid() -> None:
    """M < S is not refused: 1F1B's warm-up is min(R-1-r, M) forwards, so a rank whose warm-up
    and first forward cover every microbatch (R-r >= M) runs GPipe's order (all F, then all B)
    and the others a short 1F1B. Every order holds each task once; the gradients are exact
    (here M=3, S=4; the grid above has M=1)."""
    S = 4
    for M in (1, 2, 3):
        one_f, gpipe = (make_hint(h, num_stages=S, num_microbatches=M) for h in ("1f1b", "gpipe"))
        for r in range(S):
            assert one_f.peak(r) == min(M, S - r)
            assert (one_f.strict_order(r) == gpipe.strict_order(r)) == (S - r >= M)
    check("1f1b", False, S, 3, "strict", SimDevice(lambda info: 1.0, run_compute=True))
