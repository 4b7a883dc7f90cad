"""Property: under random task durations `ready` mode completes every step, runs each task once,
never exceeds the cap and never breaks a dependency (docs/architecture.md "The arbiter",
docs/hints.md "Why ready mode cannot deadlock")."""

from __future__ import annotations

import asyncio
import random
from typing import Sequence

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aioready
from aioready.clock import run_virtual
from aioready.devices.base import TaskInfo
from aioready.devices.sim import SimDevice
from aioready.hints import HintOrder
from aioready.memory import Budget
from aioready.placement import Placement
from aioready.runtime.rank import POLICIES, RankRuntime, reservation_holds
from aioready.schedulers import make_hint
from aioready.schedulers.rules import bf
from aioready.tasks import Kind
from aioready.telemetry.spans import Span
from aioready.transports.inproc import InprocWorld

LINEAR_HINTS = ["gpipe", "1f1b", "zb-h1", "bf", "bfw"]
NEEDS_SPLIT = {"zb-h1", "bfw"}
# Interleaved and V placements (two chunks per rank), where gating more than the entry F would
# deadlock: (hint, split backward); bf-v is the BF rule on a V placement, unsplit too.
MULTI_CHUNK = [("interleaved-1f1b", False), ("interleaved-1f1b", True),
               ("interleaved-zb", True), ("zbv", True), ("bf-v", False), ("bf-v", True)]


def random_durations(seed: int):
    cache: dict[tuple[int, int, int], float] = {}
    rng = random.Random(seed)

    def duration(info: TaskInfo) -> float:
        key = (info.stage, info.microbatch, int(info.kind))
        if key not in cache:
            cache[key] = rng.choice([0.0, 0.25, 0.5, 1.0, 1.0, 2.0, 3.0, 7.5])
        return cache[key]
    return duration


def check_invariants(spans: Sequence[Span], peaks: dict[int, int], *, R: int, S: int, M: int,
                     split: bool, caps: list[int]) -> None:
    """Each task of S stages x M microbatches ran once, after its inputs, one at a time per
    rank, and no rank of the R held more microbatches than its cap (admitted at the start of
    its chunk-0 F, released at the end of its last backward piece over every chunk)."""
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
    for rank in range(R):
        mine = sorted((s for s in spans if s.rank == rank), key=lambda s: (s.start, s.end))
        for a, b in zip(mine, mine[1:]):
            assert b.start >= a.end, f"rank {rank} ran {a.label} and {b.label} at once"
        leaves: dict[int, float] = {}
        for s in mine:
            if s.kind is last:
                leaves[s.microbatch] = max(leaves.get(s.microbatch, s.end), s.end)
        events = [(s.start, 1) for s in mine if s.kind is Kind.F and s.chunk == 0] + \
                 [(end, -1) for end in leaves.values()]
        now = 0
        for _, delta in sorted(events):
            now += delta
            assert now <= caps[rank], f"rank {rank} in flight {now} > cap {caps[rank]}"
        assert peaks[rank] <= caps[rank]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(S=st.integers(2, 8), M=st.integers(1, 32), hint=st.sampled_from(LINEAR_HINTS),
       split=st.booleans(), cap_kind=st.sampled_from(["one", "hint", "above", "random"]),
       policy=st.sampled_from(POLICIES), seed=st.integers(0, 2**32 - 1))
def test_ready_mode_never_deadlocks(S: int, M: int, hint: str, split: bool, cap_kind: str,
                                    policy: str, seed: int) -> None:
    split = split or hint in NEEDS_SPLIT
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
                                 split_backward=split, cap=caps_arg, policy=policy,
                                 device=SimDevice(random_durations(seed), run_compute=False))
        for _ in range(3):  # later steps reuse the runtimes (state resets; estimates persist)
            await pipe.step()
        return pipe, [rt.cap for rt in pipe.runtimes]

    pipe, caps = run_virtual(main())
    reserving = policy == "reserve" and reservation_holds(pipe.hint, caps)
    # the reservation and `drain` need the forecast and its notices; `light` the cost factors
    assert all((rt.forecast is not None) == (reserving or policy in ("light", "drain"))
               and (rt._notices is not None) == (reserving or policy == "drain") for rt in pipe.runtimes)
    step = pipe.last_step
    check_invariants(step.spans, step.peak_in_flight, R=S, S=S, M=M, split=split, caps=caps)


def multi_chunk_hint(name: str, R: int, M: int, split: bool) -> HintOrder:
    if name == "bf-v":
        return bf(Placement(2 * R, R, "v"), M, split_backward=split)
    return make_hint(name, num_stages=2 * R, num_microbatches=M, split_backward=split)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(R=st.integers(2, 4), M=st.integers(1, 12), case=st.sampled_from(MULTI_CHUNK),
       cap_kind=st.sampled_from(["one", "hint", "above", "random"]), delays=st.booleans(),
       policy=st.sampled_from(POLICIES), seed=st.integers(0, 2**32 - 1))
def test_ready_mode_never_deadlocks_on_interleaved_and_v_placements(
        R: int, M: int, case: tuple[str, bool], cap_kind: str, delays: bool, policy: str,
        seed: int) -> None:
    name, split = case
    if name.startswith("interleaved"):
        M = R * -(-M // R)  # interleaved rounds hold R microbatches each
    hint = multi_chunk_hint(name, R, M, split)
    S = hint.placement.num_stages
    rng = random.Random(seed)
    caps_arg = {"one": [1] * R, "hint": [None] * R, "above": [M + 3] * R,
                "random": [rng.randint(1, M + 1) for _ in range(R)]}[cap_kind]
    world = InprocWorld(R, delay=(lambda src, dst, msg: rng.choice([0.0, 0.0, 0.1, 0.5, 2.0]))
                        if delays else None)
    device = SimDevice(random_durations(seed), run_compute=False)
    resolved = [hint.default_caps[r] if c is None else c for r, c in enumerate(caps_arg)]
    runtimes = [RankRuntime(rank=r, hint=hint, mode="ready", cap=caps_arg[r], executors=None,
                            device=device, transport=world.endpoints[r], policy=policy,
                            caps=resolved) for r in range(R)]

    async def main() -> None:
        async with asyncio.timeout(1e6):  # virtual seconds: a stall raises, never hangs
            for step in range(3):  # later steps reuse the runtimes: state must reset
                await asyncio.gather(*(rt.run_step(step) for rt in runtimes))

    run_virtual(main())
    caps = [rt.cap for rt in runtimes]
    reserving = policy == "reserve" and reservation_holds(hint, caps)
    # the reservation and `drain` need the forecast and its notices; `light` the cost factors
    assert all((rt.forecast is not None) == (reserving or policy in ("light", "drain"))
               and (rt._notices is not None) == (reserving or policy == "drain") for rt in runtimes)
    for step in range(3):
        reports = [rt.reports[step] for rt in runtimes]
        peaks = {r: p for rep in reports for r, p in rep.peak_in_flight.items()}
        check_invariants([s for rep in reports for s in rep.spans], peaks, R=R, S=S, M=M,
                         split=split, caps=caps)


BYTE_CASES = [(h, h in NEEDS_SPLIT or split) for h in LINEAR_HINTS for split in (False, True)
              ] + MULTI_CHUNK
BUDGETS = {"tiny": 1, "small": 50, "mid": 500, "huge": 10**12}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(R=st.integers(2, 4), M=st.integers(1, 12), case=st.sampled_from(BYTE_CASES),
       budget=st.sampled_from([*BUDGETS, "0.5x", "1x", "2x", "per-rank"]),
       delays=st.booleans(), policy=st.sampled_from(POLICIES), seed=st.integers(0, 2**32 - 1),
       counted=st.booleans())
def test_ready_mode_never_deadlocks_under_byte_budgets(
        R: int, M: int, case: tuple[str, bool], budget: str, delays: bool, policy: str,
        seed: int, counted: bool) -> None:
    """ready_set Note [byte gate]: random bytes per microbatch (the same on every stage, so
    the gate's prediction from a microbatch's input is exact), budgets from one byte (every
    microbatch alone) to unbounded, fixed or a multiple of the hint's peak, every placement;
    `counted`: each rank's budget also caps the microbatches in flight (memory.Budget count,
    a count-capped choice with the bytes as backstop)."""
    name, split = case
    if name in LINEAR_HINTS:
        hint = make_hint(name, num_stages=R, num_microbatches=M, split_backward=split)
    else:
        if name.startswith("interleaved"):
            M = R * -(-M // R)
        hint = multi_chunk_hint(name, R, M, split)
    S, chunks = hint.placement.num_stages, hint.placement.num_chunks
    rng = random.Random(seed)
    sizes = [float(rng.choice([1, 10, 30, 100, 300])) for _ in range(M)]
    budgets = {**BUDGETS, "per-rank": None}
    if budget == "per-rank":
        memory = [Budget(bytes=rng.choice(list(BUDGETS.values()))) for _ in range(R)]
    elif budget.endswith("x"):
        memory = [Budget(factor=float(budget[:-1]))] * R
    else:
        memory = [Budget(bytes=budgets[budget])] * R
    if counted:
        memory = [Budget(b.bytes, b.factor, rng.randint(1, M)) for b in memory]
    world = InprocWorld(R, delay=(lambda src, dst, msg: rng.choice([0.0, 0.0, 0.1, 0.5, 2.0]))
                        if delays else None)
    device = SimDevice(random_durations(seed), run_compute=False)
    runtimes = [RankRuntime(rank=r, hint=hint, mode="ready", cap=M, executors=None,
                            device=device, transport=world.endpoints[r], policy=policy,
                            caps=[M] * R, memory=memory[r],
                            bytes_model=lambda step, stage, m: (sizes[m], sizes[m]))
                for r in range(R)]

    async def main() -> None:
        async with asyncio.timeout(1e6):  # virtual seconds: a stall raises, never hangs
            for step in range(3):
                await asyncio.gather(*(rt.run_step(step) for rt in runtimes))

    run_virtual(main())
    reserving = policy == "reserve" and reservation_holds(hint, [M] * R)
    # the reservation and `drain` need the forecast and its notices; `light` the cost factors
    assert all((rt.forecast is not None) == (reserving or policy in ("light", "drain"))
               and (rt._notices is not None) == (reserving or policy == "drain") for rt in runtimes)
    for step in range(3):
        reports = [rt.reports[step] for rt in runtimes]
        peaks = {r: p for rep in reports for r, p in rep.peak_in_flight.items()}
        check_invariants([s for rep in reports for s in rep.spans], peaks, R=R, S=S, M=M,
                         split=split, caps=[M] * R)
        for r, peak in peaks.items():  # the count binds; under the reservation the order's
            count = memory[r].count  # own forwards pass, and an empty rank admits one ahead
            if count is not None:
                bound = max(count, hint.peak(r) + 1) if policy == "reserve" else count
                assert peak <= bound, (r, peak, count)
        if policy != "reserve":  # the gate binds (the reservation admits its order regardless)
            for rep in reports:
                for r, held in rep.peak_activation_bytes.items():
                    if memory[r].bytes is not None:
                        assert held <= max(memory[r].bytes, max(sizes) * chunks), (r, held)


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
                step = pipe.last_step
                check_invariants(step.spans, step.peak_in_flight, R=4, S=4, M=8, split=False,
                                 caps=caps)
