"""What a rank of `python -m bench.e2e --scale` adds: a thin model, and microbatches in flight
counted where both runtimes run them.

At S=8 and S=16 ranks on a 2-core machine, a real model's compute would be most of every step
and mostly contention; the deep-pipeline mode keeps the injected sleeps (the same on both sides)
and makes the model thin (one small linear map per layer group), so what is left on top of the
sleeps is each runtime's own cost. Peak activations cannot be read from a runtime's own
bookkeeping (torch.distributed.pipelining keeps none), so the injector counts them: a stage's
microbatch is in flight from the start of its forward to the end of its last backward task (B and
W both done), weighted by the share of the model the stage holds (a stage of an interleaved or V
placement holds half of what a linear stage holds), and the peak of that sum per rank is the
figure the table shows, in linear-stage microbatches.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn

from aioready.tasks import Kind
from aioready.testing.inject import SecondsFn, SleepInjector

__all__ = ["ThinGroup", "thin_groups", "TrackingInjector"]


class ThinGroup(nn.Module):
    """One layer group: embedding (first), a dim x dim linear map, vocab projection (last)."""

    def __init__(self, *, first: bool, last: bool, vocab: int, dim: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim) if first else None
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        h = self.mix(h)
        return self.head(h) if self.head is not None else h


def thin_groups(groups: int, *, vocab: int, dim: int, seed: int,
                dtype: torch.dtype = torch.float32) -> list[nn.Module]:
    """The thin model's layer groups; the same seed gives the same weights in every process."""
    torch.manual_seed(seed)
    return [ThinGroup(first=g == 0, last=g == groups - 1, vocab=vocab, dim=dim).to(dtype)
            for g in range(groups)]


class TrackingInjector(SleepInjector):
    """A SleepInjector that also keeps the peak of (stage, microbatch) pairs in flight."""

    def __init__(self, duration: SecondsFn, weight: float) -> None:
        super().__init__(duration)
        self.weight = weight  # a stage's share of a linear stage's activations
        self._track = threading.Lock()
        self._backward: dict[tuple[int, int], int] = {}
        self.in_flight = 0
        self.peak = 0

    def sleep(self, stage: int, microbatch: int, kind: Kind) -> None:
        if kind is Kind.F:
            with self._track:
                self.in_flight += 1
                self.peak = max(self.peak, self.in_flight)
        super().sleep(stage, microbatch, kind)
        if kind is not Kind.F:  # B and W both end the pair, whatever order autograd ran them
            with self._track:
                key = (stage, microbatch)
                done = self._backward.get(key, 0) + 1
                if done == 2:
                    del self._backward[key]
                    self.in_flight -= 1
                else:
                    self._backward[key] = done

    def peak_activations(self) -> float:
        """The peak in linear-stage microbatches."""
        return self.peak * self.weight

    def reset(self) -> None:
        super().reset()
        with self._track:
            self.peak = self.in_flight


def peak_field(injector: Any) -> float | None:
    """The injector's peak, or None for one that does not track."""
    return injector.peak_activations() if isinstance(injector, TrackingInjector) else None
