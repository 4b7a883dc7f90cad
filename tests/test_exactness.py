"""Loss and every gradient of an in-process pipeline equal the unsplit model's (float64)."""

from __future__ import annotations

import itertools

import pytest
import torch

import aioready
from aioready.testing.helpers import make_mlp_stages, max_grad_diff, mse_loss, reference_step

TOL = 1e-10
CASES = list(itertools.product((1, 2, 4), (1, 3, 8), ("gpipe", "1f1b"), ("ready", "strict"),
                               (False, True)))


def batch(M: int, seed: int = 1) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(3, 16, generator=gen, dtype=torch.float64) for _ in range(M)]
    ys = [torch.randn(3, 16, generator=gen, dtype=torch.float64) for _ in range(M)]
    return xs, ys


@pytest.mark.parametrize("S,M,hint,mode,split", CASES,
                         ids=[f"S{s}-M{m}-{h}-{md}-{'split' if sp else 'full'}"
                              for s, m, h, md, sp in CASES])
async def test_pipeline_matches_unsplit_model(S: int, M: int, hint: str, mode: str,
                                              split: bool) -> None:
    stages = make_mlp_stages(S, seed=S * 10 + M)
    xs, ys = batch(M)
    ref_loss, ref = reference_step(stages, mse_loss, xs, ys)
    pipe = aioready.Pipeline(stages, mse_loss, microbatches=M, hint=hint, mode=mode,
                             split_backward=split)
    try:
        loss = await pipe.step(xs, ys)
    finally:
        pipe.close()
    assert abs(float(loss) - float(ref_loss)) <= TOL
    assert max_grad_diff(stages, ref) <= TOL
    assert all(p.grad is not None for s in stages for p in s.parameters())
    assert len(pipe.last_step.spans) == S * M * (3 if split else 2)


async def test_gradients_accumulate_over_steps_like_the_reference() -> None:
    stages = make_mlp_stages(2, seed=3)
    xs, ys = batch(4, seed=5)
    _, ref = reference_step(stages, mse_loss, xs + xs, ys + ys)
    pipe = aioready.Pipeline(stages, mse_loss, microbatches=4, hint="1f1b")
    await pipe.step(xs, ys)
    await pipe.step(xs, ys)
    pipe.close()
    # reference over 8 microbatches scales each by 1/8; two steps of 4 scale by 1/4 each
    for p, q in zip((p for s in stages for p in s.parameters()),
                    (q for s in ref for q in s.parameters())):
        assert torch.allclose(p.grad, 2 * q.grad, atol=TOL, rtol=0)


async def test_split_backward_defers_weight_gradients_to_w() -> None:
    from aioready.runtime.stage import StageExecutor

    stage = make_mlp_stages(2, seed=7)[1]
    ex = StageExecutor(stage, stage=1, num_stages=2, loss_fn=mse_loss, num_microbatches=1)
    x = torch.randn(3, 16, dtype=torch.float64)
    y = torch.randn(3, 16, dtype=torch.float64)
    ex.forward(0, (x,), y)
    (dx,) = ex.backward_input(0, None)
    assert dx is not None and dx.shape == x.shape
    assert all(p.grad is None for p in stage.parameters()), "B must not touch weight gradients"
    ex.backward_weight(0)
    assert all(p.grad is not None for p in stage.parameters())
    assert ex.num_split_fallbacks == 0

    ref = make_mlp_stages(2, seed=7)[1]
    xr = x.clone().requires_grad_()
    mse_loss(ref(xr), y).backward()
    assert torch.allclose(dx, xr.grad, atol=TOL, rtol=0)
    assert max_grad_diff([stage], [ref]) <= TOL


async def test_batch_split_into_equal_microbatches_matches_list_input() -> None:
    stages = make_mlp_stages(2, seed=11)
    xs, ys = batch(4, seed=2)
    _, ref = reference_step(stages, mse_loss, xs, ys)
    pipe = aioready.Pipeline(stages, mse_loss, microbatches=4, hint="gpipe")
    loss = await pipe.step(torch.cat(xs), torch.cat(ys))
    pipe.close()
    assert loss is not None
    assert max_grad_diff(stages, ref) <= TOL


class _Tied(torch.nn.Module):
    """A shared Linear used twice and a parameter that reaches the output off the input path."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = torch.nn.Linear(16, 16)
        self.scale = torch.nn.Parameter(torch.randn(16, dtype=torch.float64))
        self.gate = torch.nn.Parameter(torch.randn(4, 16, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.shared(x))
        a, b = h.chunk(2, dim=-1)  # a multi-output node on the input path
        h = torch.cat([b, a], dim=-1) * self.scale
        off_path = torch.ones(4, dtype=torch.float64) @ self.gate  # needs no input
        return self.shared(h) + off_path


@pytest.mark.parametrize("mode", ["ready", "strict"])
async def test_split_backward_with_shared_and_off_path_parameters(mode: str) -> None:
    torch.manual_seed(0)
    stages = [_Tied().double(), _Tied().double(), make_mlp_stages(1)[0]]
    xs, ys = batch(3, seed=9)
    ref_loss, ref = reference_step(stages, mse_loss, xs, ys)
    pipe = aioready.Pipeline(stages, mse_loss, microbatches=3, hint="1f1b", mode=mode,
                             split_backward=True)
    loss = await pipe.step(xs, ys)
    pipe.close()
    assert abs(float(loss) - float(ref_loss)) <= TOL
    assert max_grad_diff(stages, ref) <= TOL


@pytest.mark.parametrize("mode", ["ready", "strict"])
async def test_inline_device_matches_unsplit_model(mode: str) -> None:
    """device='inline' computes on the loop thread: same results as the worker-thread device."""
    stages = make_mlp_stages(3, seed=21)
    xs, ys = batch(4, seed=4)
    ref_loss, ref = reference_step(stages, mse_loss, xs, ys)
    pipe = aioready.Pipeline(stages, mse_loss, microbatches=4, hint="1f1b", mode=mode,
                             split_backward=True, device="inline")
    loss = await pipe.step(xs, ys)
    pipe.close()
    assert type(pipe.runtimes[0].device).__name__ == "InlineDevice"
    assert abs(float(loss) - float(ref_loss)) <= TOL
    assert max_grad_diff(stages, ref) <= TOL


@pytest.mark.parametrize("inline_below_s", [0.0, 10.0], ids=["thread-only", "tiny-inline"])
@pytest.mark.parametrize("mode", ["ready", "strict"])
async def test_cpu_device_tiny_task_fast_path_matches_unsplit_model(
        mode: str, inline_below_s: float) -> None:
    """CPUDevice's fast path (a task whose last run was short runs on the loop thread), on and
    off: the same loss and gradients; on, every repeat of a stage's kind ran inline."""
    from aioready.devices.cpu import CPUDevice

    stages = make_mlp_stages(3, seed=22)
    xs, ys = batch(4, seed=6)
    ref_loss, ref = reference_step(stages, mse_loss, xs, ys)
    pipe = aioready.Pipeline(stages, mse_loss, microbatches=4, hint="1f1b", mode=mode,
                             split_backward=True, device=lambda r: CPUDevice(
                                 f"fast{r}", inline_below_s=inline_below_s))
    try:
        loss = await pipe.step(xs, ys)
    finally:
        pipe.close()
    inline = [rt.device.num_inline for rt in pipe.runtimes]
    # 3 kinds x 4 microbatches per rank; the first of each kind goes to the thread
    assert inline == ([9, 9, 9] if inline_below_s else [0, 0, 0])
    assert abs(float(loss) - float(ref_loss)) <= TOL
    assert max_grad_diff(stages, ref) <= TOL
