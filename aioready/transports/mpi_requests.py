"""PendingRequests: MPI requests in flight, each with the callback to run once it completed.

The MPI transport (its sends and payload receives) and the data-parallel collectives
(dp/requests.py) poll the same way: one `Testsome` over the whole array per poll, a few more while
a large transfer is pending (it moves one pipeline chunk per MPI call), then the array compacted
in one pass. This is that bookkeeping, once; the callers run the callbacks it hands back, each
with its own error handling.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["PendingRequests"]


class PendingRequests:
    """Requests, their callbacks and whether each is large, kept as parallel lists."""

    __slots__ = ("reqs", "_done", "_big", "num_big", "_testsome")

    def __init__(self, testsome: Callable[[list[Any]], list[int]]) -> None:
        self._testsome = testsome
        self.reqs: list[Any] = []
        self._done: list[Any] = []
        self._big: list[bool] = []
        self.num_big = 0  # large requests pending: the caller's poll wants extra tests

    def add(self, req: Any, done: Any, big: bool) -> None:
        self.reqs.append(req)
        self._done.append(done)
        self._big.append(big)
        self.num_big += big

    def clear(self) -> None:
        self.reqs, self._done, self._big, self.num_big = [], [], [], 0

    def __len__(self) -> int:
        return len(self.reqs)

    def completed(self, burst: int) -> list[Any]:
        """The callbacks of the requests that completed (removed from the set), testing up to
        `burst` more times while none has and a large request is pending. MPI errors raise."""
        testsome = self._testsome
        idx = testsome(self.reqs)
        burst = burst if self.num_big else 0
        while not idx and burst:
            idx = testsome(self.reqs)
            burst -= 1
        if not idx:
            return []
        finished = set(idx)
        done = [self._done[i] for i in idx]
        keep = [i for i in range(len(self.reqs)) if i not in finished]
        self.num_big -= sum(self._big[i] for i in idx)
        self.reqs = [self.reqs[i] for i in keep]
        self._done = [self._done[i] for i in keep]
        self._big = [self._big[i] for i in keep]
        return done
