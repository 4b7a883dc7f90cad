"""Activation checkpointing of a whole stage: what F keeps so that B can recompute the forward.

With `recompute`, F runs the stage without building a graph and keeps only its inputs and the
random-number state it started with; B (the input-gradient piece under split backward) first
runs the forward again, with the same RNG state so dropout draws the same masks, and then
proceeds on that graph. Under split backward the graph is kept after B for W, which therefore
reuses the one recomputation instead of doing its own. Peak memory drops from every in-flight
microbatch's graph to the graphs of microbatches between their B and their W.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch

__all__ = ["Replay", "capture", "replaying"]


@dataclass(slots=True)
class Replay:
    """What a recomputation needs: the arguments, the target and the RNG states at F."""

    args: tuple[Any, ...]
    target: Any
    cpu_rng: torch.Tensor
    cuda_rng: dict[int, torch.Tensor]


def _cuda_devices(tensors: Any) -> list[int]:
    return sorted({t.device.index or 0 for t in tensors
                   if isinstance(t, torch.Tensor) and t.is_cuda})


def capture(args: tuple[Any, ...], target: Any, module: torch.nn.Module,
            flat: tuple[Any, ...]) -> Replay:
    devices = _cuda_devices([*flat, *module.parameters()]) if torch.cuda.is_available() else []
    return Replay(args, target, torch.get_rng_state(),
                  {d: torch.cuda.get_rng_state(d) for d in devices})


@contextlib.contextmanager
def replaying(replay: Replay) -> Iterator[None]:
    """Run the block with the RNG states F started with, leaving the outer states untouched."""
    with torch.random.fork_rng(devices=list(replay.cuda_rng)):
        torch.set_rng_state(replay.cpu_rng)
        for d, state in replay.cuda_rng.items():
            torch.cuda.set_rng_state(state, d)
        with torch.enable_grad():
            yield
