"""Sleep injection inside a stage module, so that any pipeline runtime replays the same durations.

A device-level pace (devices/paced.py) only works for aioready. To compare against another
runtime (torch.distributed.pipelining) with the very same per-task durations, the durations must
live in the model itself, where every runtime calls them:

- forward sleeps F(stage, mb) before the stage's compute;
- a custom autograd Function at the stage output sleeps B(stage, mb) when the output's gradient
  arrives (the start of the input-gradient backward);
- a dummy zero parameter is added to the output through another Function that sleeps W(stage, mb)
  when its gradient is computed: it hangs off the input-gradient path, so split backward runs it
  with the weight gradients (W) and full backward runs it as part of B.

Runtimes do not tell a stage which microbatch it runs, so the microbatch id travels with the data:
every stage takes and returns `(x, tag)` where `tag` is a small int64 tensor whose first element
is the microbatch id (the last stage returns only its output, for the loss). The model's math is
unchanged: the output is `y + 0` with an exact zero, and the tag carries no gradient.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..tasks import Kind

__all__ = ["SleepInjector", "InjectedStage", "Chain", "wrap_stages", "make_tags"]

SecondsFn = Callable[[int, int, int, Kind], float]  # (step, stage, microbatch, kind) -> seconds


class SleepInjector:
    """Sleeps each task's duration (seconds) and keeps what it slept, per kind, for checks.

    `step` is set by the driver before each step (runtimes do not pass it to the model).
    """

    def __init__(self, duration: SecondsFn) -> None:
        self.duration = duration
        self.step = 0
        self._lock = threading.Lock()
        self.slept = [0.0, 0.0, 0.0]  # planned seconds per Kind, all steps
        self.count = [0, 0, 0]

    def sleep(self, stage: int, microbatch: int, kind: Kind) -> None:
        seconds = self.duration(self.step, stage, microbatch, kind)
        if seconds > 0:
            time.sleep(seconds)
        with self._lock:  # counted once slept: a sleep that did not happen is not in the totals
            self.slept[kind] += seconds
            self.count[kind] += 1

    def reset(self) -> None:
        with self._lock:
            self.slept = [0.0, 0.0, 0.0]
            self.count = [0, 0, 0]


class _SleepOnGrad(torch.autograd.Function):
    """Identity forward; backward sleeps one task's duration (once), then passes the gradient on."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, injector: SleepInjector, stage: int,
                microbatch: int, kind: int) -> torch.Tensor:
        ctx.info = (injector, stage, microbatch, Kind(kind))
        ctx.slept = False
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        injector, stage, microbatch, kind = ctx.info
        if not ctx.slept:  # split backward may run this node again on its way to the weights
            ctx.slept = True
            injector.sleep(stage, microbatch, kind)
        if kind is Kind.W:  # the dummy parameter never learns: its gradient is an exact zero
            grad = torch.zeros_like(grad)
        return grad, None, None, None, None


class InjectedStage(nn.Module):
    """`inner` with its task durations injected; takes and returns `(x, tag)` (see module doc)."""

    def __init__(self, inner: nn.Module, *, stage: int, last: bool,
                 injector: SleepInjector) -> None:
        super().__init__()
        self.inner = inner
        self.stage = stage
        self.last = last
        self.injector = injector
        dtype = next((p.dtype for p in inner.parameters() if p.is_floating_point()),
                     torch.get_default_dtype())
        self.zero = nn.Parameter(torch.zeros((), dtype=dtype))  # W's hook: gradient only

    def forward(self, x: torch.Tensor, tag: torch.Tensor) -> Any:
        mb = int(tag.reshape(-1)[0])
        self.injector.sleep(self.stage, mb, Kind.F)
        y = self.inner(x)
        if torch.is_grad_enabled():
            y = _SleepOnGrad.apply(y, self.injector, self.stage, mb, int(Kind.B))
            y = y + _SleepOnGrad.apply(self.zero, self.injector, self.stage, mb, int(Kind.W))
        return y if self.last else (y, tag)


class Chain(nn.Module):
    """Modules applied in turn (a stage made of several layer groups)."""

    def __init__(self, parts: Sequence[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: Any) -> Any:
        for part in self.parts:
            x = part(x)
        return x


def wrap_stages(stages: Sequence[nn.Module], indices: Sequence[int], num_stages: int,
                injector: SleepInjector) -> list[InjectedStage]:
    """Wrap `stages` (global stage numbers `indices`) with one shared injector."""
    if len(stages) != len(indices):
        raise ValueError(f"one stage index per module: {len(stages)} modules, "
                         f"{len(indices)} indices")
    return [InjectedStage(m, stage=s, last=s == num_stages - 1, injector=injector)
            for m, s in zip(stages, indices)]


def make_tags(num_microbatches: int, microbatch_size: int) -> torch.Tensor:
    """Tags of a whole batch: each sample carries its microbatch id (split along dim 0)."""
    return torch.arange(num_microbatches, dtype=torch.int64).repeat_interleave(microbatch_size)
