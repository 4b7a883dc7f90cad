"""Step metrics, the lower bound, span arrays and instrument hooks (virtual clock, no torch)."""

from __future__ import annotations

import logging
import random
import subprocess
import sys

import pytest

from aioready.clock import run_virtual
from aioready.devices.base import TaskInfo
from aioready.devices.sim import SimDevice
from aioready.placement import Placement
from aioready.runtime.pipeline import Pipeline
from aioready.tasks import Kind
from aioready.telemetry.bounds import lower_bound
from aioready.telemetry.instruments import InstrumentedDevice, Instruments, instrument_pipeline
from aioready.telemetry.metrics import peak_in_flight, step_metrics
from aioready.telemetry.spans import StepReport, spans_from_array, spans_to_array
from aioready.transports.base import MessageKind


def run_steps(hint: str, mode: str, duration, *, split: bool = False, steps: int = 1,
              cap: int | None = None, instruments: Instruments | None = None,
              stages: int = 4, mb: int = 8) -> list[StepReport]:
    pipe = Pipeline([None] * stages, None, microbatches=mb, hint=hint, mode=mode,
                    split_backward=split, cap=cap, device=SimDevice(duration, run_compute=False))
    if instruments is not None:
        instrument_pipeline(pipe, instruments)

    async def main() -> list[StepReport]:
        out = []
        for _ in range(steps):
            await pipe.step()
            assert pipe.last_step is not None
            out.append(pipe.last_step)
        return out
    return run_virtual(main())


def fixed(f: float, b: float, w: float = 0.0):
    return lambda i: {Kind.F: f, Kind.B: b, Kind.W: w}[i.kind]


@pytest.mark.parametrize("hint", ["1f1b", "gpipe"])
@pytest.mark.parametrize("mode", ["strict", "ready"])
def test_no_jitter_1f1b_and_gpipe_are_exactly_efficient(hint: str, mode: str) -> None:
    (rep,) = run_steps(hint, mode, fixed(1.0, 2.0))
    m = step_metrics(rep)
    assert m.step_time == 33.0
    assert m.lower_bound == 33.0
    assert m.efficiency == 1.0
    assert m.num_tasks == 64
    assert m.busy_fraction == pytest.approx((24 / 33,) * 4)
    assert m.bubble_fraction == pytest.approx(9 / 33)


def test_lower_bound_textbook_values() -> None:
    place = Placement.linear(4)
    # unsplit: rank 3 waits 3 F (head) and leaves 3 B (tail) around its 24 busy units
    assert lower_bound(place, 8, False, lambda s, m, k: 1.0 if k is Kind.F else 2.0) == 33.0
    # split: no tail; rank 3's head 3 + busy 24
    assert lower_bound(place, 8, True, lambda s, m, k: 1.0) == 27.0
    # one microbatch: the dependency chain F0..F3 B3..B0 dominates
    assert lower_bound(place, 1, False, lambda s, m, k: 1.0) == 8.0
    # interleaved placement: rank r's first stage is r
    inter = Placement(8, 4, "interleaved")
    assert lower_bound(inter, 4, False, lambda s, m, k: 1.0) == 3 + 16 + 3


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("mode", ["strict", "ready"])
def test_lower_bound_never_exceeds_the_step(seed: int, mode: str) -> None:
    def dur(i: TaskInfo) -> float:
        return random.Random(f"{seed}:{i.stage}:{i.microbatch}:{int(i.kind)}").uniform(0.2, 3.0)
    for split in (False, True):
        (rep,) = run_steps("1f1b", mode, dur, split=split)
        m = step_metrics(rep)
        assert 0 < m.lower_bound <= m.step_time + 1e-9
        assert 0 < m.efficiency <= 1.0 + 1e-12


def test_peak_in_flight_from_spans_matches_the_1f1b_peak() -> None:
    (rep,) = run_steps("1f1b", "strict", fixed(1.0, 2.0))
    assert [peak_in_flight(rep.spans, r) for r in range(4)] == [4, 3, 2, 1]
    assert step_metrics(rep).peak_in_flight == (4, 3, 2, 1)
    (rep,) = run_steps("gpipe", "strict", fixed(1.0, 2.0))
    assert step_metrics(rep).peak_in_flight == (8, 8, 8, 8)


def test_span_array_round_trips() -> None:
    (rep,) = run_steps("1f1b", "ready", fixed(1.5, 2.25))
    rep.step = 7
    arr = spans_to_array(rep)
    assert arr.shape == (64, 9)
    back = spans_from_array(arr)
    assert [s for _, s in back] == rep.spans
    assert {step for step, _ in back} == {7}


def test_metrics_refuse_an_empty_step() -> None:
    with pytest.raises(ValueError, match="no spans"):
        step_metrics(StepReport(3))


class Recorder:
    def __init__(self) -> None:
        self.before = 0
        self.after: list[tuple[TaskInfo, float, float]] = []
        self.sent = 0
        self.notices = 0

    def before_task(self, info: TaskInfo) -> None:
        self.before += 1

    def after_task(self, info: TaskInfo, start: float, end: float) -> None:
        self.after.append((info, start, end))

    def message_sent(self, rank: int, dest: int, msg, nbytes: int) -> None:
        if msg.kind is MessageKind.NOTICE:
            self.notices += 1
        else:
            self.sent += 1


class Broken:
    def after_task(self, info: TaskInfo, start: float, end: float) -> None:
        raise RuntimeError("instrument bug")


def test_instruments_see_every_task_and_message(caplog: pytest.LogCaptureFixture) -> None:
    rec, broken = Recorder(), Broken()
    inst = Instruments([rec, broken])
    with caplog.at_level(logging.ERROR, logger="aioready.telemetry.instruments"):
        (rep,) = run_steps("1f1b", "ready", fixed(1.0, 2.0), instruments=inst)
    assert rec.before == len(rec.after) == len(rep.spans) == 64
    assert rec.sent == 2 * 8 * 3  # activations and gradients across 3 boundaries
    assert 0 < rec.notices <= rec.sent  # the reservation's notices: at most one per message
    # the broken instrument was removed after its first failure, and logged once
    assert [r for r in caplog.records if "instrument bug" in (r.exc_text or "")]
    assert len([r for r in caplog.records if r.levelno == logging.ERROR]) == 1
    assert not any(i is broken for i, _ in inst._hooks["after_task"])
    # telemetry of the run is unaffected by the instruments: the same step time
    assert step_metrics(rep).step_time == 33.0


def test_no_instrument_means_no_wrapping() -> None:
    pipe = Pipeline([None] * 2, None, microbatches=2, device=SimDevice(lambda i: 0.0,
                                                                       run_compute=False))
    instrument_pipeline(pipe, Instruments())
    assert not any(isinstance(rt.device, InstrumentedDevice) for rt in pipe.runtimes)
    assert not Instruments()


def test_telemetry_modules_load_without_torch_or_mpi() -> None:
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('torch', 'mpi4py'):\n"
            "            raise ImportError('blocked ' + name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "import aioready.telemetry, aioready.telemetry.export, aioready.telemetry.instruments\n"
            "import aioready.telemetry.gather, aioready.sim.durations, aioready.telemetry.plots, aioready.telemetry.prometheus\n"
            "import aioready.devices.paced\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
