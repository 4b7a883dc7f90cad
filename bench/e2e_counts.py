"""Per-task counters of one aioready rank in bench.e2e (`AIOREADY_E2E_COUNTS=DIR`).

CPU figures move with the host's load; these counts mostly do not: engine polls and parks,
doorbell rings answered and datagrams sent, messages sent and received, and the loop thread's
voluntary and involuntary context switches, over the measured steps only. Each rank writes
DIR/<config>-rank<N>.json; `python -m bench.e2e_counts DIR` prints them per task
(docs/hot_path_measurements.md "Ready against strict"). Off (None) unless the variable is set.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["Counts"]

_ENGINE = ("num_hot_passes", "num_parks", "num_idle_waits", "num_doorbell_parks", "num_rings",
           "num_ring_polls", "num_missed_rings", "num_inline_hushes")


def _switches() -> tuple[int, int]:
    """The calling thread's voluntary and involuntary context switches."""
    text = Path("/proc/thread-self/status").read_text()
    vol = int(text.split("\nvoluntary_ctxt_switches:")[1].split()[0])
    invol = int(text.split("\nnonvoluntary_ctxt_switches:")[1].split()[0])
    return vol, invol


class Counts:
    """Counters summed over a rank's measured steps; `begin`/`end` around each step."""

    def __init__(self, directory: str) -> None:
        self.dir = Path(directory)
        self.total: dict[str, float] = {}
        self._start: dict[str, float] = {}
        self._polls = 0
        self._engine: Any = None

    def _count_polls(self, engine: Any) -> None:
        """Count the engine's polls: an instance attribute over its `poll` (ring() and the
        engine's own passes call `self.poll`)."""
        if self._engine is engine:
            return
        self._engine = engine
        poll = type(engine).poll

        def counted(only: Any = None) -> int:
            self._polls += 1
            return poll(engine, only)
        engine.poll = counted

    def _snapshot(self, transport: Any) -> dict[str, float]:
        from aioready.progress import ProgressEngine
        engine = ProgressEngine.existing()
        out: dict[str, float] = {}
        if engine is not None:
            self._count_polls(engine)
            for name in _ENGINE:
                out[name] = getattr(engine, name)
        out["polls"] = self._polls
        bell = getattr(transport, "_bell", None)
        out["datagrams_sent"] = 0 if bell is None else bell.num_rung
        out["sent"] = transport.num_sent
        out["received"] = transport.num_received
        out["voluntary"], out["involuntary"] = _switches()
        out["loop_cpu_us"] = time.thread_time() * 1e6
        return out

    def begin(self, transport: Any) -> None:
        self._start = self._snapshot(transport)

    def end(self, transport: Any, tasks: int) -> None:
        now = self._snapshot(transport)
        for key, value in now.items():
            self.total[key] = self.total.get(key, 0) + value - self._start.get(key, 0)
        self.total["tasks"] = self.total.get("tasks", 0) + tasks

    def write(self, config: str, rank: int) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"{config.replace('/', '-')}-rank{rank}.json"
        path.write_text(json.dumps(self.total))


def main(argv: list[str] | None = None) -> None:
    """Print each file's counters per task: one row per config and rank."""
    directory = Path((argv or sys.argv[1:])[0])
    rows = sorted(directory.glob("*.json"))
    keys: list[str] = []
    data = []
    for path in rows:
        total = json.loads(path.read_text())
        keys = keys or [k for k in total if k != "tasks"]
        data.append((path.stem, {k: v / total["tasks"] for k, v in total.items()}))
    print("file | " + " | ".join(keys))
    for name, per in data:
        print(name + " | " + " | ".join(f"{per.get(k, 0):.2f}" for k in keys))


if __name__ == "__main__":
    main()
