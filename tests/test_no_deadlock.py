"""Property: under random task durations `ready` mode completes every step, runs each task once,
never exceeds the cap and never breaks a dependency (docs/architecture.md "The arbiter",
docs/hints.md "Why ready mode cannot deadlock")."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aioready
from aioready.clock import run_virtual
from aioready.devices.base import TaskInfo
from aioready.devices.sim import SimDevice
from aioready.tasks import Kind
from aioready.telemetry.spans import Span

LINEAR_HINTS = ["gpipe", "1f1b"]


def random_durations(seed: int):
    cache: dict[tuple[int, int, int], float] = {}
    rng = random.Random(seed)

    def duration(info: TaskInfo) -> float:
        key = (info.stage, info.microbatch, int(info.kind))
        if key not in cache:
            cache[key] = rng.choice([0.0, 0.25, 0.5, 1.0, 1.0, 2.0, 3.0, 7.5])
        return cache[key]
    return duration


def check_invariants(pipe: aioready.Pipeline, S: int, M: int, split: bool,
                     caps: list[int]) -> None:
    spans = pipe.last_step.spans
    kinds = (Kind.F, Kind.B, Kind.W) if split else (Kind.F, Kind.B)
    by_key: dict[tuple[int, int, Kind], Span] = {}
    for s in spans:
        key = (s.stage, s.microbatch, s.kind)
        assert key not in by_key, f"{key} ran twice"
        by_key[key] = s
    assert len(by_key) == S * M * len(kinds), "some task never ran"
    for (stage, m, kind), s in by_key.items():
        if kind is Kind.F and stage > 0:
            assert s.start >= by_key[(stage - 1, m, Kind.F)].end
        if kind is Kind.B:
            assert s.start >= by_key[(stage, m, Kind.F)].end
            if stage < S - 1:
                assert s.start >= by_key[(stage + 1, m, Kind.B)].end
        if kind is Kind.W:
            assert s.start >= by_key[(stage, m, Kind.B)].end
    last = Kind.W if split else Kind.B
    for rank in range(S):
        mine = sorted((s for s in spans if s.rank == rank), key=lambda s: (s.start, s.end))
        for a, b in zip(mine, mine[1:]):
            assert b.start >= a.end, f"rank {rank} ran {a.label} and {b.label} at once"
        events = [(s.start, 1) for s in mine if s.kind is Kind.F] + \
                 [(s.end, -1) for s in mine if s.kind is last]
        now = 0
        for _, delta in sorted(events):
            now += delta
            assert now <= caps[rank], f"rank {rank} in flight {now} > cap {caps[rank]}"
        assert pipe.last_step.peak_in_flight[rank] <= caps[rank]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(S=st.integers(2, 8), M=st.integers(1, 32), hint=st.sampled_from(LINEAR_HINTS),
       split=st.booleans(), cap_kind=st.sampled_from(["one", "hint", "above", "random"]),
       seed=st.integers(0, 2**32 - 1))
def test_ready_mode_never_deadlocks(S: int, M: int, hint: str, split: bool, cap_kind: str,
                                    seed: int) -> None:
    async def main() -> tuple[aioready.Pipeline, list[int]]:
        caps_arg: int | list[int] | None
        if cap_kind == "one":
            caps_arg = 1
        elif cap_kind == "hint":
            caps_arg = None
        elif cap_kind == "above":
            caps_arg = M + 3
        else:
            caps_arg = [random.Random(seed + r).randint(1, M + 1) for r in range(S)]
        pipe = aioready.Pipeline([None] * S, None, microbatches=M, hint=hint, mode="ready",
                                 split_backward=split, cap=caps_arg,
                                 device=SimDevice(random_durations(seed), run_compute=False))
        await pipe.step()
        await pipe.step()  # a second step reuses the runtimes: state must reset cleanly
        return pipe, [rt.cap for rt in pipe.runtimes]

    pipe, caps = run_virtual(main())
    check_invariants(pipe, S, M, split, caps)


def _real_loop_run(loop_name: str, cap: int | None, seed: int) -> aioready.Pipeline:
    import asyncio

    rng = random.Random(seed)

    def duration(info: TaskInfo) -> float:
        return rng.choice([0.0, 0.0005, 0.001, 0.002])

    async def main() -> aioready.Pipeline:
        pipe = aioready.Pipeline([None] * 4, None, microbatches=8, hint="1f1b", mode="ready",
                                 cap=cap, device=SimDevice(duration, run_compute=False))
        await asyncio.wait_for(pipe.step(), timeout=30)
        return pipe

    if loop_name == "uvloop":
        import uvloop
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(main())
    return asyncio.run(main())


def test_ready_mode_completes_on_real_loops() -> None:
    for loop_name in ("asyncio", "uvloop"):
        for cap in (1, None, 9):
            for seed in range(3):
                pipe = _real_loop_run(loop_name, cap, seed)
                caps = [rt.cap for rt in pipe.runtimes]
                check_invariants(pipe, 4, 8, False, caps)
