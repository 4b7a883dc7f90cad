"""One in-flight rule: the arbiter's live count, the hint's peak (its default cap) and the peak the
step metrics replay from spans agree, on interleaved and V placements too (virtual clock)."""

from __future__ import annotations

import random

import pytest

from aioready.clock import run_virtual
from aioready.devices.sim import SimDevice
from aioready.errors import InternalError
from aioready.hints import HintOrder
from aioready.in_flight import InFlight, peak_in_flight, peak_of_timeline
from aioready.placement import Placement
from aioready.runtime.pipeline import Pipeline
from aioready.schedulers import make_hint
from aioready.schedulers.rules import bf, bfw
from aioready.sim.simulator import simulate
from aioready.tasks import Kind, Task
from aioready.telemetry.metrics import step_metrics
from aioready.telemetry.spans import StepReport


def _deferred_w(name: str, M: int) -> HintOrder:
    """A split-backward hint whose ranks run every W of their deeper chunk last: a microbatch's
    last piece is then on chunk 1, so a count that watches chunk 0 alone would release it early."""
    base = make_hint(name, num_stages=8, num_microbatches=M, split_backward=True)
    late = [[t for t in o if t.kind is Kind.W and t.chunk == 1] for o in base.orders]
    orders = [[t for t in o if t not in tail] + tail for o, tail in zip(base.orders, late)]
    return HintOrder.from_orders(f"{name}-late-w", base.placement, M, True, orders)


def _hints() -> list[tuple[str, HintOrder]]:
    out = []
    for M in (1, 4, 8):
        out += [
            (f"interleaved-1f1b-M{M}", make_hint("interleaved-1f1b", num_stages=8,
                                                 num_microbatches=M)),
            (f"interleaved-1f1b-split-M{M}", make_hint("interleaved-1f1b", num_stages=8,
                                                       num_microbatches=M, split_backward=True)),
            (f"interleaved-zb-M{M}", make_hint("interleaved-zb", num_stages=8,
                                               num_microbatches=M, split_backward=True)),
            (f"zbv-M{M}", make_hint("zbv", num_stages=8, num_microbatches=M,
                                    split_backward=True)),
            (f"bf-v-M{M}", bf(Placement(8, 4, "v"), M, split_backward=False)),
            (f"bfw-v-M{M}", bfw(Placement(8, 4, "v"), M, split_backward=True)),
            (f"interleaved-1f1b-v3-M{M}", make_hint("interleaved-1f1b", num_stages=6,
                                                    num_ranks=2, num_microbatches=M)),
            (f"zbv-late-w-M{M}", _deferred_w("zbv", M)),
            (f"interleaved-zb-late-w-M{M}", _deferred_w("interleaved-zb", M)),
        ]
    return out


HINTS = _hints()


def _run(hint: HintOrder, mode: str, seed: int | None) -> StepReport:
    rng = random.Random(seed)
    unit = {Kind.F: 1.0, Kind.B: 1.0 if hint.split_backward else 2.0, Kind.W: 1.0}

    def duration(info: object) -> float:
        base = unit[info.kind]  # type: ignore[attr-defined]
        return base if seed is None else base * rng.lognormvariate(0.0, 0.8)

    async def main() -> StepReport:
        pipe = Pipeline([None] * hint.placement.num_stages, None,
                        microbatches=hint.num_microbatches, hint=hint, mode=mode,
                        split_backward=hint.split_backward,
                        device=SimDevice(duration, run_compute=False))
        await pipe.step()
        assert pipe.last_step is not None
        return pipe.last_step

    return run_virtual(main())


@pytest.mark.parametrize("label,hint", HINTS, ids=[label for label, _ in HINTS])
def test_strict_peak_from_spans_equals_the_hints_peak_and_the_live_count(
        label: str, hint: HintOrder) -> None:
    report = _run(hint, "strict", seed=None)
    measured = step_metrics(report).peak_in_flight
    for rank in range(hint.num_ranks):
        assert measured[rank] == hint.peak(rank) == report.peak_in_flight[rank], rank


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("label,hint", HINTS, ids=[label for label, _ in HINTS])
def test_ready_peak_from_spans_equals_the_live_count(label: str, hint: HintOrder,
                                                     seed: int) -> None:
    report = _run(hint, "ready", seed=seed)
    measured = step_metrics(report).peak_in_flight
    assert measured == tuple(report.peak_in_flight[r] for r in range(hint.num_ranks))


@pytest.mark.parametrize("name,split", [("interleaved-1f1b", False), ("interleaved-zb", True),
                                        ("zbv", True)])
def test_simulated_strict_peak_is_the_hints_peak(name: str, split: bool) -> None:
    hint = make_hint(name, num_stages=8, num_microbatches=8, split_backward=split)
    result = simulate(stages=8, microbatches=8, hint=name, mode="strict",
                      split_backward=split, jitter="lognormal:0.5", seed=3)
    assert result.peak_in_flight == tuple(hint.peak(r) for r in range(hint.num_ranks))


def test_a_late_deeper_chunk_keeps_its_microbatch_in_flight() -> None:
    hint = _deferred_w("zbv", 8)
    assert [hint.peak(r) for r in range(4)] == [8, 8, 8, 8]
    assert step_metrics(_run(hint, "strict", seed=None)).peak_in_flight == (8, 8, 8, 8)


def test_a_microbatch_stays_until_its_last_piece_on_every_chunk() -> None:
    flight = InFlight(num_chunks=2, split_backward=True)
    flight.start(Task(Kind.F, 0, 0))
    flight.start(Task(Kind.F, 0, 1))  # deeper chunk: admits nothing
    for piece in (Task(Kind.B, 0, 1), Task(Kind.W, 0, 1), Task(Kind.B, 0, 0)):
        flight.release(piece)
        assert flight.count == 1 and flight.microbatches == [0]
    flight.release(Task(Kind.W, 0, 0))
    assert (flight.count, flight.peak, flight.microbatches) == (0, 1, [])


def test_the_live_count_refuses_a_piece_of_an_unadmitted_microbatch() -> None:
    with pytest.raises(InternalError, match="never admitted"):
        InFlight(1, False).release(Task(Kind.B, 3))
    lenient = InFlight(1, False, lenient=True)
    lenient.release(Task(Kind.B, 3))
    assert lenient.count == 0


def test_ties_follow_the_execution_order() -> None:
    f0, b0, f1, b1 = Task(Kind.F, 0), Task(Kind.B, 0), Task(Kind.F, 1), Task(Kind.B, 1)
    # B0 ends at 2 when F1 starts: the slot is freed first, as the arbiter frees it
    assert peak_of_timeline([(f0, 0, 1), (b0, 1, 2), (f1, 2, 3), (b1, 3, 4)],
                            num_chunks=1, split_backward=False) == 1
    # zero-length tasks: each F admits before its own (and its B's) end at the same instant
    assert peak_of_timeline([(f0, 0, 0), (f1, 0, 0), (b0, 0, 0), (b1, 0, 0)],
                            num_chunks=1, split_backward=False) == 2
    assert peak_in_flight([f0, f1, b0, b1], num_chunks=1, split_backward=False) == 2
    assert peak_in_flight([f0, b0, f1, b1], num_chunks=1, split_backward=False) == 1
