"""Activation memory as autograd sees it: the bytes of tensors saved for backward, live and peak.

Device allocators differ (CUDA has `max_memory_allocated`, the CPU allocator has nothing
comparable), but what activation checkpointing changes is the same everywhere: how many bytes
autograd graphs keep alive for backward. `SavedTensorMeter` counts them through
`torch.autograd.graph.saved_tensors_hooks`: each saved tensor's storage is counted once while
any graph holds it, excluding given tensors (the parameters, which exist anyway), so the peak is
deterministic and the same on any machine. Hooks are per thread: run the pipeline with
`device="inline"` (compute on the loop thread) inside the meter.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

__all__ = ["SavedTensorMeter"]


class _Held:
    """A saved tensor as autograd keeps it; dropping it releases its storage in the meter."""

    __slots__ = ("tensor", "key", "meter")

    def __init__(self, tensor: torch.Tensor, key: int, meter: "SavedTensorMeter") -> None:
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self) -> None:
        self.meter._release(self.key)


class SavedTensorMeter:
    """`with SavedTensorMeter(exclude=model.parameters()) as meter: ...`; then `meter.peak`."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._refs: dict[int, list[int]] = {}  # storage pointer -> [references, bytes]
        self.live = 0  # bytes held now
        self.peak = 0  # most bytes held at once
        self._hooks: Any = None

    def _pack(self, t: torch.Tensor) -> Any:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self._exclude:
            return t
        entry = self._refs.get(key)
        if entry is None:
            entry = self._refs[key] = [0, storage.nbytes()]
            self.live += entry[1]
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        # detached: a saved output holding its own grad_fn would make a cycle through C++
        # that keeps the graph alive (and the meter would report the leak it caused)
        return _Held(t.detach(), key, self)

    @staticmethod
    def _unpack(held: Any) -> torch.Tensor:
        return held.tensor if isinstance(held, _Held) else held

    def _release(self, key: int) -> None:
        entry = self._refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._refs[key]

    def __enter__(self) -> "SavedTensorMeter":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
