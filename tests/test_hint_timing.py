"""Every hint under the simulated device on the virtual clock (no torch compute).

strict mode: the step time equals an independent as-soon-as-possible replay of the order, and
the textbook value where one exists (formulas below, docs/hints.md "Textbook figures"); the peak
in-flight count per rank equals the hint's own. ready mode with random task durations and message
delays on interleaved and V placements: every task runs exactly once (the entry-only gate never
deadlocks).
"""

from __future__ import annotations

import asyncio
import random

import pytest

from aioready.clock import run_virtual
from aioready.devices import SimDevice
from aioready.hints import HintOrder
from aioready.placement import Placement
from aioready.runtime.pipeline import Pipeline
from aioready.runtime.rank import RankRuntime
from aioready.schedulers import HINTS, hint_names, make_hint
from aioready.schedulers.rules import bf, bfw
from aioready.tasks import Kind, Task, all_tasks
from aioready.transports.inproc import InprocWorld


def cases() -> list[tuple[str, bool, int, int]]:
    out = []
    for name in hint_names():
        need = HINTS[name].needs_split
        for split in ((need,) if need is not None else (False, True)):
            out += [(name, split, S, M) for S in (2, 4, 8) for M in (1, 4, 8, 16)]
    return out


def costs(split: bool) -> tuple[float, float, float]:
    """Per-stage costs (F, B, W): unit each split, a full backward of 2 unsplit."""
    return (1.0, 1.0, 1.0) if split else (1.0, 2.0, 0.0)


def textbook(name: str, split: bool, S: int, R: int, M: int) -> float | None:
    """The textbook step time, or None where the hint has none for this shape."""
    f, b, w = costs(split)
    v = S // R
    c = f + b + w
    chain = S * (f + b) / v + w / v  # one microbatch walks every chunk in series
    if name in ("gpipe", "1f1b", "bf"):
        # (M+S-1)(tF+tB) [GPipe, PipeDream-Flush]; split: the gradient leaves after B, the W
        # that follows stays on the rank: M(tF+tB+tW) + (S-1)(tF+tB) (our derivation)
        return (M + S - 1) * (f + b) if not split else M * c + (S - 1) * (f + b)
    if name == "interleaved-1f1b":
        if M >= R:  # Megatron VPP: bubble (R-1)(tF+tB)/v; split: W off the chain
            return M * c + (R - 1) * (f + b + (0 if split else w)) / v
        return chain if M == 1 else None
    if name == "interleaved-zb":
        return M * c + (R - 1) * (f + b - w) / v if M >= R else (chain if M == 1 else None)
    if name == "zb-h1":  # ZB paper: bubble (R-1)(tF+tB-tW)
        return M * c + (R - 1) * (f + b - w) if M >= R else (chain if M == 1 else None)
    if name == "zb-h2":  # reaches the barrier lower bound 3M + (R-1) tF (docs/hints.md)
        return M * c + (R - 1) * f if M >= 2 * R else (chain if M == 1 else None)
    if name == "zbv":  # only the start-up skew tF/v; M=1: rank 0 runs W(c1) before B(c0)
        if M >= 2 * R - 1:
            return M * c + (R - 1) * f / v
        return chain + w / v if M == 1 else None
    return None  # bfw: no textbook value; checked against the replay only


def replay(hint: HintOrder, dur: dict[Kind, float]) -> float:
    """As-soon-as-possible execution of each rank's strict order: an oracle for strict mode."""
    p = hint.placement
    S, R = p.num_stages, p.num_ranks
    done: dict[tuple[int, Kind, int], float] = {}
    pos, free = [0] * R, [0.0] * R
    orders = [hint.strict_order(r) for r in range(R)]
    progress = True
    while progress:
        progress = False
        for r in range(R):
            while pos[r] < len(orders[r]):
                t = orders[r][pos[r]]
                s = p.stage_of(r, t.chunk)
                deps = {Kind.F: [(s - 1, Kind.F)] if s else [],
                        Kind.B: [(s, Kind.F)] + ([(s + 1, Kind.B)] if s < S - 1 else []),
                        Kind.W: [(s, Kind.B)]}[t.kind]
                if any((d, k, t.microbatch) not in done for d, k in deps):
                    break
                start = max([free[r]] + [done[(d, k, t.microbatch)] for d, k in deps])
                free[r] = done[(s, t.kind, t.microbatch)] = start + dur[t.kind]
                pos[r] += 1
                progress = True
    assert all(pos[r] == len(orders[r]) for r in range(R)), "replay stalled"
    return max(free)


@pytest.mark.parametrize("name,split,S,M", cases())
def test_strict_step_time_and_peak(name: str, split: bool, S: int, M: int) -> None:
    hint = make_hint(name, num_stages=S, num_microbatches=M, split_backward=split)
    v = hint.placement.num_chunks
    f, b, w = costs(split)
    dur = {Kind.F: f / v, Kind.B: b / v, Kind.W: w / v}

    async def main() -> Pipeline:
        pipe = Pipeline([None] * S, None, microbatches=M, hint=hint, mode="strict",
                        split_backward=split,
                        device=SimDevice(lambda i: dur[i.kind], run_compute=False))
        await pipe.step()
        return pipe

    pipe = run_virtual(main())
    report = pipe.last_step
    assert report is not None
    assert report.step_time == replay(hint, dur)
    want = textbook(name, split, S, hint.num_ranks, M)
    if want is not None:
        assert report.step_time == want
    for r in range(hint.num_ranks):
        assert hint.peak(r) <= (hint.default_caps or ())[r] <= M
        assert report.peak_in_flight[r] == hint.peak(r)
        assert report.order(r) == [str(t) for t in hint.strict_order(r)]


def test_documented_values_r4_m8() -> None:
    """docs/hints.md "Textbook figures": makespans for R=4, M=8 with unit costs (chunk tasks 1/2 at
    v=2)."""
    assert textbook("1f1b", False, 4, 4, 8) == 33.0
    assert textbook("gpipe", False, 4, 4, 8) == 33.0
    assert textbook("zb-h1", True, 4, 4, 8) == 27.0
    assert textbook("zb-h2", True, 4, 4, 8) == 27.0
    assert textbook("interleaved-1f1b", False, 8, 4, 8) == 28.5
    assert textbook("interleaved-zb", True, 8, 4, 8) == 25.5
    assert textbook("zbv", True, 8, 4, 8) == 25.5


def _ready_hints() -> list[tuple[str, HintOrder]]:
    out = []
    for M in (4, 8):
        out.append(("interleaved-1f1b", make_hint("interleaved-1f1b", num_stages=8,
                                                  num_microbatches=M)))
        out.append(("interleaved-zb", make_hint("interleaved-zb", num_stages=8,
                                                num_microbatches=M, split_backward=True)))
        out.append(("zbv", make_hint("zbv", num_stages=8, num_microbatches=M,
                                     split_backward=True)))
        out.append(("bf-v", bf(Placement(8, 4, "v"), M, split_backward=False)))
        out.append(("bfw-interleaved", bfw(Placement(8, 4, "interleaved"), M,
                                           split_backward=True)))
    out.append(("interleaved-1f1b-v3", make_hint("interleaved-1f1b", num_stages=6,
                                                 num_ranks=2, num_microbatches=4)))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("label,hint", _ready_hints(), ids=lambda x: x if isinstance(x, str)
                         else f"M{x.num_microbatches}")
@pytest.mark.timeout(60)
def test_ready_mode_multi_chunk_random_delays_exactly_once(label: str, hint: HintOrder,
                                                           seed: int) -> None:
    rng = random.Random(seed)
    R = hint.num_ranks
    world = InprocWorld(R, delay=lambda src, dst, msg: rng.uniform(0.0, 0.7))
    device = SimDevice(lambda info: rng.lognormvariate(0.0, 0.8), run_compute=False)
    runtimes = [RankRuntime(rank=r, hint=hint, mode="ready", cap=None, executors=None,
                            device=device, transport=world.endpoints[r]) for r in range(R)]

    async def main() -> None:
        async with asyncio.timeout(1e6):  # virtual seconds: a stall raises, never hangs
            await asyncio.gather(*(rt.run_step(0) for rt in runtimes))

    run_virtual(main())
    expected = set(all_tasks(hint.placement.num_chunks, hint.num_microbatches,
                             hint.split_backward))
    for rt in runtimes:
        report = rt.reports[-1]
        ran = [Task(s.kind, s.microbatch, s.chunk) for s in report.spans]
        assert len(ran) == len(expected) and set(ran) == expected
        assert report.peak_in_flight[rt.rank] <= rt.cap
