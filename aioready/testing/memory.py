"""Activation memory as autograd sees it: the bytes of tensors saved for backward, live and peak.

Device allocators differ (CUDA has `max_memory_allocated`, the CPU allocator has nothing
comparable), but what activation checkpointing changes is the same everywhere: how many bytes
autograd graphs keep alive for backward. `SavedTensorMeter` counts them through
`torch.autograd.graph.saved_tensors_hooks`: each saved tensor's storage is counted once while
any graph holds it, excluding given tensors (the parameters, which exist anyway), so the peak is
deterministic and the same on any machine. Hooks are per thread: run the pipeline with
`device="inline"` (compute on the loop thread) inside the meter.

Meters nest: one opened inside another (or inside any saved-tensor hooks, such as
`torch.autograd.graph.save_on_cpu`) counts and then hands each tensor on to the hooks it found,
so the outer ones still see everything. The runtime opens one around every stage forward
(runtime/stage.py, the bytes a microbatch holds), so this is what keeps a caller's hooks working.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

__all__ = ["SavedTensorMeter"]


class _Held:
    """A saved tensor as autograd keeps it; dropping it releases its storage in the meter."""

    __slots__ = ("tensor", "key", "meter")

    def __init__(self, tensor: Any, key: int | None, meter: "SavedTensorMeter") -> None:
        self.tensor, self.key, self.meter = tensor, key, meter  # tensor: or the outer hook's

    def __del__(self) -> None:
        if self.key is not None:
            self.meter._release(self.key)


def _outer_hooks() -> Any:
    """The saved-tensor hooks active on this thread before ours (None: none), to chain to."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    try:
        return None if top is None else top(False)
    except (RuntimeError, TypeError):
        return None


class SavedTensorMeter:
    """`with SavedTensorMeter(exclude=model.parameters()) as meter: ...`; then `meter.peak`."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._refs: dict[int, list[int]] = {}  # storage pointer -> [references, bytes]
        self.live = 0  # bytes held now
        self.peak = 0  # most bytes held at once
        self._hooks: Any = None
        self._outer: Any = None

    def _pack(self, t: torch.Tensor) -> Any:
        outer = self._outer
        # detached: a saved output holding its own grad_fn would make a cycle through C++
        # that keeps the graph alive (and the meter would report the leak it caused)
        payload = t.detach() if outer is None else outer[0](t)
        try:
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # no plain storage (sparse, nested, ...)
            key, nbytes = -id(t), t.numel() * t.element_size()
        if key in self._exclude:  # a parameter: it exists anyway
            return t if outer is None else _Held(payload, None, self)
        entry = self._refs.get(key)
        if entry is None:
            entry = self._refs[key] = [0, nbytes]
            self.live += entry[1]
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        return _Held(payload, key, self)

    def _unpack(self, held: Any) -> torch.Tensor:
        payload = held.tensor if isinstance(held, _Held) else held
        return payload if self._outer is None else self._outer[1](payload)

    def _release(self, key: int) -> None:
        entry = self._refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._refs[key]

    def __enter__(self) -> "SavedTensorMeter":
        self._outer = _outer_hooks()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
