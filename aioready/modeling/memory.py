"""What one microbatch in flight costs each stage in activation memory, with and without recompute.

A memory budget that counts microbatches in flight needs a per-stage price: without
recomputation a stage holds its whole autograd graph from F until its last backward piece; with
it, only its inputs (and, for the one microbatch being recomputed, the graph again, briefly).
`stage_memory` measures both on a sample microbatch by running the stages in order, each on
detached inputs like the executor's, under `testing.memory.SavedTensorMeter`: bytes saved for
backward, parameters excluded, each storage once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..testing.memory import SavedTensorMeter
from ..transports.structure import flatten, is_schema, unflatten

__all__ = ["StageMemory", "stage_memory", "tensor_bytes"]


@dataclass(frozen=True, slots=True)
class StageMemory:
    """Bytes one microbatch in flight holds on a stage."""

    stage: int
    graph_bytes: int  # without recompute: saved for backward from F to the last backward piece
    input_bytes: int  # with recompute: the inputs F keeps for the recomputation

    def held(self, recompute: bool) -> int:
        return self.input_bytes if recompute else self.graph_bytes


def tensor_bytes(flat: Sequence[Any]) -> int:
    """Bytes of the tensors among `flat` (what recompute's F keeps: its inputs)."""
    return sum(t.nbytes for t in flat if isinstance(t, torch.Tensor))


def stage_memory(stages: Sequence[torch.nn.Module], sample: Any) -> list[StageMemory]:
    """Measure every stage on `sample` (stage 0's inputs: a tensor or a tuple)."""
    flat: tuple[Any, ...] = sample if isinstance(sample, tuple) else (sample,)
    params = [p for s in stages for p in s.parameters()]
    out: list[StageMemory] = []
    for index, stage in enumerate(stages):
        if flat and is_schema(flat[0]):
            args, kept = unflatten(flat, stage=index, detach=index > 0)
        else:
            kept = args = tuple(
                x.detach().requires_grad_(x.is_floating_point())
                if index > 0 and isinstance(x, torch.Tensor) else x for x in flat)
        with SavedTensorMeter(params) as meter:
            result = stage(*args)
            graph = meter.live
        out.append(StageMemory(index, graph, tensor_bytes(kept)))
        flat = flatten(result, stage=index)
        del result
    return out
