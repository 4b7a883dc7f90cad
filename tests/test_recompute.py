"""Activation checkpointing per stage (`Pipeline(..., recompute=)`): same gradients as without
it, the forward recomputed exactly once before B (W reuses that graph), dropout replayed with the
same masks, and a lower peak of bytes saved for backward (measured by SavedTensorMeter)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import aioready
from aioready.errors import ConfigError
from aioready.testing.helpers import make_mlp_stages, max_grad_diff, mse_loss, reference_step
from aioready.testing.memory import SavedTensorMeter
from aioready.testing.models import gpt_stages, lm_loss

TOL = 1e-10
torch.set_num_threads(1)


def batch(M: int, seed: int = 1) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(3, 16, generator=gen, dtype=torch.float64) for _ in range(M)]
    ys = [torch.randn(3, 16, generator=gen, dtype=torch.float64) for _ in range(M)]
    return xs, ys


def step(stages: list, xs: list, ys: list, loss_fn: object = mse_loss, **kw: object) -> object:
    async def main() -> object:
        pipe = aioready.Pipeline(stages, loss_fn, microbatches=len(xs), **kw)
        try:
            return await pipe.step(xs, ys)
        finally:
            pipe.close()
    return aioready.run(main())


@pytest.mark.parametrize("hint, split, recompute", [
    ("1f1b", False, True), ("zb-h1", True, True), ("gpipe", False, [True, False, True]),
    ("zb-h2", True, [False, True, True])])
def test_recompute_gives_the_unsplit_gradients(hint: str, split: bool, recompute: object
                                               ) -> None:
    stages = make_mlp_stages(3, seed=4)
    xs, ys = batch(6)
    ref_loss, ref = reference_step(stages, mse_loss, xs, ys)
    loss = step(stages, xs, ys, hint=hint, split_backward=split, recompute=recompute)
    assert abs(float(loss) - float(ref_loss)) <= TOL
    assert max_grad_diff(stages, ref) <= TOL


class Counted(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.inner(x)


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("recompute", [False, True])
def test_forward_runs_once_more_per_microbatch_and_w_reuses_it(split: bool,
                                                              recompute: bool) -> None:
    stages = [Counted(s) for s in make_mlp_stages(2, seed=6)]
    xs, ys = batch(4)
    step(stages, xs, ys, hint="zb-h1" if split else "1f1b", split_backward=split,
         recompute=recompute)
    assert [s.calls for s in stages] == [4 * (2 if recompute else 1)] * 2


def dropout_stages() -> list[nn.Module]:
    torch.manual_seed(3)
    return [nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.5), nn.Linear(32, 16)).double()
            for _ in range(2)]


def test_dropout_draws_the_same_masks_when_recomputed() -> None:
    xs, ys = batch(4)
    plain, again = dropout_stages(), dropout_stages()
    torch.manual_seed(11)
    step(plain, xs, ys, hint="zb-h1", split_backward=True, mode="strict", device="inline")
    torch.manual_seed(11)
    step(again, xs, ys, hint="zb-h1", split_backward=True, mode="strict", device="inline",
         recompute=True)
    assert max_grad_diff(plain, again) <= TOL
    torch.manual_seed(12)  # and the masks do matter: another seed gives other gradients
    other = dropout_stages()
    step(other, xs, ys, hint="zb-h1", split_backward=True, mode="strict", device="inline")
    assert max_grad_diff(plain, other) > 1e-3


@pytest.mark.parametrize("hint, split", [("gpipe", False), ("1f1b", False), ("zb-h1", True)])
def test_recompute_lowers_the_peak_of_saved_activations(hint: str, split: bool) -> None:
    model = gpt_stages(1, layers_per_stage=4, vocab=64, dim=32, heads=2, seq=32)[0]
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randint(0, 64, (4, 32), generator=gen) for _ in range(8)]
    ys = [torch.randint(0, 64, (4, 32), generator=gen) for _ in range(8)]
    peaks, losses = [], []
    for recompute in (False, True):
        m = copy.deepcopy(model)
        stages = aioready.split(m, stages=2, layers="blocks", before=["tok", "pos"],
                                after=["ln_f", "head"])
        with SavedTensorMeter(m.parameters()) as meter:
            losses.append(float(step(list(stages), xs, ys, lm_loss, hint=hint,
                                     split_backward=split, recompute=recompute,
                                     device="inline")))
        assert meter.live == 0  # every graph was freed by the end of the step
        peaks.append(meter.peak)
    assert losses[0] == pytest.approx(losses[1], abs=1e-6)
    assert peaks[1] < 0.7 * peaks[0], peaks


def test_recompute_flags_are_checked() -> None:
    with pytest.raises(ConfigError, match="one per stage"):
        aioready.Pipeline(make_mlp_stages(2), mse_loss, recompute=[True])


def test_stage_memory_prices_a_microbatch_in_flight() -> None:
    """Per stage, a microbatch in flight holds its graph without recompute and only its inputs
    with it; one microbatch through all stages holds the sum of the graphs at its peak."""
    from aioready.modeling.memory import stage_memory
    model = gpt_stages(1, layers_per_stage=4, vocab=64, dim=32, heads=2, seq=32)[0]
    stages = aioready.split(model, stages=2, layers="blocks", before=["tok", "pos"],
                            after=["ln_f", "head"])
    x = torch.randint(0, 64, (4, 32))
    prices = stage_memory(stages, x)
    assert [p.stage for p in prices] == [0, 1]
    assert all(p.held(True) < p.held(False) / 4 for p in prices), prices
    assert prices[0].input_bytes == x.nbytes
    with SavedTensorMeter(model.parameters()) as meter:
        step(list(stages), [x], [x], lm_loss, hint="gpipe", device="inline")
    graphs = sum(p.graph_bytes for p in prices)
    # the step also holds the loss's graph (log-softmax of the logits: ~3 % here)
    assert graphs <= meter.peak <= graphs * 1.1, (graphs, meter.peak)
