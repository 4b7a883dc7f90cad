"""In-process gloo worlds: N gloo process groups in one process, one per rank, for tests.

A gloo group needs only a store and a rank, so N of them built on N threads over one HashStore
form a real N-rank world (TCP over loopback) inside a single process: the transport contract
tests then drive every rank of TorchDistTransport from one event loop, with no launcher.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

__all__ = ["gloo_world"]

_WORLDS = 0


def gloo_world(n: int, *, timeout_s: float = 60.0) -> list[Any]:
    """`n` ProcessGroupGloo objects, rank i at index i, connected to each other."""
    import torch.distributed as dist
    global _WORLDS
    _WORLDS += 1
    store = dist.PrefixStore(f"aioready-gloo-world-{_WORLDS}", dist.HashStore())
    groups: list[Any] = [None] * n
    errors: list[BaseException] = []

    def connect(rank: int) -> None:
        try:
            groups[rank] = dist.ProcessGroupGloo(store, rank, n, timedelta(seconds=timeout_s))
        except BaseException as exc:  # re-raised on the caller's thread below
            errors.append(exc)
    threads = [threading.Thread(target=connect, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return groups
