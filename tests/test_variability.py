"""Jitter specs, seeded order-free durations, and duration traces (read, write, validate)."""

from __future__ import annotations

import io
import random

import numpy as np
import pytest

from aioready.errors import TraceError
from aioready.placement import Placement
from aioready.sim.traces import Trace, read_trace, write_trace
from aioready.sim.variability import BaseDurations, JitterModel, parse_jitter
from aioready.tasks import Kind
from aioready.transports.base import Message, MessageKind


def model(spec: str, seed: int = 0, S: int = 4, M: int = 8, split: bool = False,
          **kw: object) -> JitterModel:
    return JitterModel(spec, seed=seed, placement=Placement.linear(S), num_microbatches=M,
                       split_backward=split, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("spec, text", [
    ("none", "none"), ("lognormal:0.5", "lognormal:0.5"), ("multimodal:0.3:3", "multimodal:0.3:3"),
    ("Multimodal:0.3:3:0.2 + comm:0.1", "multimodal:0.3:3:0.2+comm:0.1"),
    ("straggler:2:1.5", "straggler:2:1.5"), ("comm:0.1:0.5", "comm:0.1:0.5"),
    ("none+lognormal:0.2", "lognormal:0.2"),
])
def test_specs_parse_and_print(spec: str, text: str) -> None:
    assert str(parse_jitter(spec)) == text


@pytest.mark.parametrize("spec, words", [
    ("", "empty"), ("gauss:1", "unknown term 'gauss'"), ("lognormal", "wrong number"),
    ("lognormal:a", "SIGMA is not a number"), ("lognormal:-1", "out of range"),
    ("multimodal:1.5:3", "out of range"), ("multimodal:0.3", "wrong number"),
    ("straggler:1.5:2", "out of range"), ("comm:-1", "out of range"),
    ("lognormal:0.5+", "unknown term ''"), ("lognormal:inf", "finite"),
])
def test_bad_specs_are_named(spec: str, words: str) -> None:
    with pytest.raises(TraceError, match="expected") as info:
        parse_jitter(spec)
    assert words in str(info.value)


def test_straggler_rank_must_exist() -> None:
    with pytest.raises(TraceError, match="no such rank"):
        model("straggler:4:2", S=4)


def test_base_durations() -> None:
    assert model("none").table(0)[:, :, Kind.F].tolist() == [[1.0] * 8] * 4
    assert set(model("none").table(0)[:, :, Kind.B].ravel()) == {2.0}
    split = model("none", split=True).table(0)
    assert set(split[:, :, Kind.B].ravel()) == {1.0} and set(split[:, :, Kind.W].ravel()) == {1.0}
    custom = model("none", base=BaseDurations(f=5.0, b=10.0)).table(0)
    assert set(custom[:, :, Kind.F].ravel()) == {5.0} and set(custom[:, :, Kind.B].ravel()) == {10.0}
    with pytest.raises(TraceError, match=">= 0"):
        BaseDurations(f=-1.0)


def test_same_seed_same_durations_in_any_order() -> None:
    a, b = model("multimodal:0.3:3+lognormal:0.2", seed=7), model(
        "multimodal:0.3:3+lognormal:0.2", seed=7)
    keys = [(step, s, m, k) for step in range(3) for s in range(4) for m in range(8)
            for k in (Kind.F, Kind.B)]
    forward = {key: a.ms(*key) for key in keys}
    random.Random(1).shuffle(keys)  # another "rank" asks in another order, steps out of order
    assert {key: b.ms(*key) for key in keys} == forward
    assert not np.array_equal(a.table(0), a.table(1))  # steps differ
    assert not np.array_equal(a.table(0), model("multimodal:0.3:3+lognormal:0.2", seed=8).table(0))


def test_lognormal_is_mean_preserving() -> None:
    table = model("lognormal:0.5", S=64, M=256).table(0)
    factors = table[:, :, Kind.F].ravel()  # base F = 1
    assert abs(factors.mean() - 1.0) < 0.02
    assert abs(np.median(factors) - np.exp(-0.125)) < 0.03
    assert abs(np.log(factors).std() - 0.5) < 0.02


def test_multimodal_heavy_microbatches_are_heavy_everywhere() -> None:
    table = model("multimodal:0.3:3:0", S=6, M=2000).table(0)
    heavy = table[0, :, Kind.F] == 3.0
    assert abs(heavy.mean() - 0.3) < 0.04
    for kind, base in ((Kind.F, 1.0), (Kind.B, 2.0)):
        expect = np.where(heavy, 3.0 * base, base)
        assert np.array_equal(table[:, :, kind], np.broadcast_to(expect, (6, 2000)))
    noisy = model("multimodal:0.3:3", S=6, M=2000).table(0)
    assert not np.array_equal(noisy, table)  # per-task noise on top
    assert np.all(noisy[:, heavy, Kind.F].mean(axis=0) > 2.0)


def test_straggler_slows_one_rank() -> None:
    table = model("straggler:2:1.5").table(0)
    assert set(table[2, :, Kind.F].ravel()) == {1.5}
    assert set(np.delete(table, 2, axis=0)[:, :, Kind.F].ravel()) == {1.0}


def test_comm_delays() -> None:
    assert model("lognormal:0.5").delay() is None
    delay = model("comm:0.5").delay()
    assert delay is not None
    msg = Message(0, MessageKind.ACTIVATION, 1, 3, ())
    assert delay(0, 1, msg) == pytest.approx(0.5e-3)
    jittered = model("comm:0.5:0.5", M=512)
    assert 0.45 < jittered.comm_table(0).mean() < 0.55
    assert model("comm:0.5:0.5", M=512).comm_ms(0, 2, 7, True) == jittered.comm_ms(0, 2, 7, True)


def test_trace_round_trip_is_exact(tmp_path: object) -> None:
    source = model("lognormal:0.7+multimodal:0.2:4", split=True)
    buf = io.StringIO()
    write_trace(buf, source, steps=2)
    lines = buf.getvalue().splitlines()
    assert lines[0] == "step,stage,chunk,microbatch,kind,ms"
    assert len(lines) == 1 + 2 * 4 * 8 * 3
    trace = read_trace(io.StringIO(buf.getvalue()))
    assert trace.num_steps == 2 and trace.split_backward and trace.num_microbatches == 8
    for step in range(2):
        assert np.array_equal(trace.table(step), source.table(step))
    with pytest.raises(TraceError, match="no durations for this step"):
        trace.ms(2, 0, 0, Kind.F)


def test_trace_infers_interleaved_placement() -> None:
    place = Placement(4, 2, "interleaved")
    source = JitterModel("lognormal:0.1", seed=0, placement=place, num_microbatches=2)
    buf = io.StringIO()
    write_trace(buf, source)
    trace = read_trace(io.StringIO(buf.getvalue()))
    assert trace.placement == place


GOOD = "step,stage,chunk,microbatch,kind,ms\n" + "".join(
    f"0,{s},0,0,{k},1.5\n" for s in range(2) for k in "FB")


@pytest.mark.parametrize("text, words", [
    ("", "line 1: empty trace"),
    ("step,stage,microbatch,kind,ms\n0,0,0,F,1\n", "line 1: missing column 'chunk'"),
    (GOOD.replace("0,1,0,0,B,1.5", "0,1,0,0,B,-2"), "line 5: negative duration"),
    (GOOD.replace("0,1,0,0,F,1.5", "0,1,0,0,X,1.5"), "line 4: unknown kind"),
    (GOOD.replace("0,1,0,0,F,1.5", "0,1,0,0,F,fast"), "line 4: ms is not a number"),
    (GOOD.replace("0,1,0,0,F,1.5", "0,one,0,0,F,1.5"), "line 4: stage is not an integer"),
    (GOOD.replace("0,1,0,0,F,1.5", "0,1,0,0,F"), "line 4: wrong number of fields"),
    (GOOD.replace("0,1,0,0,F,1.5", "0,0,0,0,F,1.5"), "line 4: duplicate task"),
    (GOOD.replace("0,1,0,0,B,1.5\n", ""), "a task is missing for rank 1"),
    (GOOD.replace("0,1,0,0,F,1.5", "0,1,0,0,F,nan"), "line 4: duration is not finite"),
    ("step,stage,chunk,microbatch,kind,ms\n", "no rows"),
])
def test_bad_traces_name_the_line(text: str, words: str) -> None:
    with pytest.raises(TraceError) as info:
        read_trace(io.StringIO(text))
    assert words in str(info.value)


def test_missing_task_names_rank_step_and_task() -> None:
    text = GOOD.replace("0,1,0,0,B,1.5\n", "")
    with pytest.raises(TraceError) as info:
        read_trace(io.StringIO(text))
    err = info.value
    assert (err.rank, err.step, str(err.task)) == (1, 0, "B0")
    assert "no row for it among lines 2-4" in str(err)


def test_trace_must_fit_the_placement(tmp_path: object) -> None:
    with pytest.raises(TraceError, match="line 4: row does not fit the placement"):
        read_trace(io.StringIO(GOOD), placement=Placement(2, 1, "v"))
    with pytest.raises(TraceError, match="line 3: stage 0 has two chunk numbers"):
        read_trace(io.StringIO(GOOD.replace("0,0,0,0,B", "0,0,1,0,B")))
    trace = read_trace(io.StringIO(GOOD))
    with pytest.raises(TraceError, match="another pipeline shape"):
        trace.check(Placement.linear(3), 1, False, 1)
    with pytest.raises(TraceError, match="too few steps"):
        trace.check(Placement.linear(2), 1, False, 2)


def test_unreadable_trace_file(tmp_path: object) -> None:
    with pytest.raises(TraceError, match="cannot read trace"):
        read_trace(f"{tmp_path}/nope.csv")


def test_trace_object_replays_its_table() -> None:
    tables = np.arange(2 * 3 * 3, dtype=float).reshape(1, 2, 3, 3) + 1
    trace = Trace(tables, placement=Placement.linear(2), split_backward=True)
    assert trace.ms(0, 1, 2, Kind.W) == tables[0, 1, 2, 2]
