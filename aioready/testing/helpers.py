"""Public test helpers: small real models, the unsplit reference, and parity checks.

Correctness of a pipeline is measured against the same layers run unsplit in one module
(docs/contributing.md "Tests"): same loss, same gradient for every parameter.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Sequence

import torch
from torch import nn

__all__ = ["Block", "make_mlp_stages", "reference_step", "max_grad_diff", "grads_of",
           "mse_loss"]


class Block(nn.Module):
    """A pre-norm residual MLP block: LayerNorm, Linear, GELU, Linear, plus the input."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def make_mlp_stages(num_stages: int, *, width: int = 16, hidden: int = 32,
                    blocks_per_stage: int = 2, seed: int = 0,
                    dtype: torch.dtype = torch.float64) -> list[nn.Module]:
    """`num_stages` stages of residual MLP blocks; the last one ends in a projection."""
    gen = torch.Generator().manual_seed(seed)
    stages: list[nn.Module] = []
    for s in range(num_stages):
        layers: list[nn.Module] = [Block(width, hidden) for _ in range(blocks_per_stage)]
        if s == num_stages - 1:
            layers.append(nn.Linear(width, width))
        stage = nn.Sequential(*layers).to(dtype)
        with torch.no_grad():
            for p in stage.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=dtype) * 0.2)
        stages.append(stage)
    return stages


def mse_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, target)


def reference_step(stages: Sequence[nn.Module], loss_fn: Callable[[Any, Any], torch.Tensor],
                   inputs: Sequence[Any], targets: Sequence[Any]
                   ) -> tuple[torch.Tensor, list[nn.Module]]:
    """Run copies of `stages` unsplit over the microbatches; return the loss and the copies."""
    model = [copy.deepcopy(s) for s in stages]
    for s in model:
        s.zero_grad(set_to_none=True)
    whole = nn.Sequential(*model)
    M = len(inputs)
    total = None
    for x, y in zip(inputs, targets):
        out = whole(*(x if isinstance(x, tuple) else (x,)))
        loss = loss_fn(out, y) / M
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total, model  # type: ignore[return-value]


def grads_of(stages: Sequence[nn.Module]) -> list[torch.Tensor]:
    return [p.grad if p.grad is not None else torch.zeros_like(p)
            for s in stages for p in s.parameters()]


def max_grad_diff(a: Sequence[nn.Module], b: Sequence[nn.Module]) -> float:
    """Largest absolute difference between matching parameter gradients of two stage lists."""
    ga, gb = grads_of(a), grads_of(b)
    if len(ga) != len(gb):
        raise ValueError(f"different parameter counts: {len(ga)} vs {len(gb)}")
    return max((float((x - y).abs().max()) for x, y in zip(ga, gb)), default=0.0)
