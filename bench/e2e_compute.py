"""The model compute of one bench.e2e process, measured alike on both sides: the thread CPU
spent inside the stage modules' forward, `torch.autograd.backward` and `torch.autograd.grad`,
and the loss. Both runtimes call these same functions for the same model (bench/e2e_worker.py
builds it for both), so a rank's CPU less this is the CPU its runtime spends beyond the model
(the per-task table of bench/e2e.py; docs/hot_path_measurements.md "The quiet path's
doorbells, and the measure checked"). Its own cost is two thread-clock reads per call, a few
calls per task, the same on both sides.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

__all__ = ["ComputeMeter", "METER"]


class ComputeMeter:
    """Seconds of thread CPU inside the wrapped functions, summed over threads; a call made
    inside another wrapped call is counted once, by the outer one."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._lock = threading.Lock()
        self._inside = threading.local()
        self._installed = False

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        inside = self._inside

        def timed(*args: Any, **kwargs: Any) -> Any:
            if getattr(inside, "on", False):
                return fn(*args, **kwargs)
            inside.on = True
            c0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.thread_time() - c0
                inside.on = False
                with self._lock:
                    self.seconds += spent
        return timed

    def install(self) -> None:
        """Wrap autograd's two entry points and the injected stage's forward, once a process
        (the loss is wrapped where each side passes it: `wrap(lm_loss)`)."""
        if self._installed:
            return
        import torch

        from aioready.testing.inject import InjectedStage
        torch.autograd.backward = self.wrap(torch.autograd.backward)
        torch.autograd.grad = self.wrap(torch.autograd.grad)
        InjectedStage.forward = self.wrap(InjectedStage.forward)  # type: ignore[method-assign]
        self._installed = True


METER = ComputeMeter()
