"""The simulator: textbook step times, determinism, lower bound, trace replay vs real sleeps."""

from __future__ import annotations

import asyncio
import io
import json
import selectors
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aioready
from aioready.caps import resolve_caps
from aioready.cli import main
from aioready.devices.sim import SimDevice
from aioready.errors import ConfigError, TraceError
from aioready.placement import Placement
from aioready.sim.durations import device_duration, step_duration
from aioready.sim.simulator import simulate
from aioready.sim.traces import Trace, read_trace, trace_from_reports, write_trace
from aioready.sim.variability import BaseDurations, JitterModel
from aioready.tasks import Kind
from aioready.telemetry.bounds import lower_bound, lower_bound_table


@pytest.mark.parametrize("hint", ["1f1b", "gpipe"])
@pytest.mark.parametrize("S, M", [(1, 1), (2, 5), (4, 8), (8, 3), (6, 24)])
def test_strict_equals_textbook(hint: str, S: int, M: int) -> None:
    r = simulate(stages=S, microbatches=M, hint=hint, mode="strict")
    assert r.step_time == (M + S - 1) * (1 + 2)  # exact: the virtual clock adds no error
    assert r.lower_bound == r.step_time and r.efficiency == 1.0
    split = simulate(stages=S, microbatches=M, hint=hint, mode="strict", split_backward=True)
    assert split.step_time == M * (1 + 1 + 1) + (S - 1) * (1 + 1)  # W right after its B
    assert split.lower_bound == max(M * 3 + S - 1, 2 * S + 1)  # busy+head, or the chain


def test_textbook_with_other_base_durations() -> None:
    base = BaseDurations(f=1.5, b=2.25)
    r = simulate(stages=5, microbatches=7, mode="strict", base=base)
    assert r.step_time == (7 + 5 - 1) * (1.5 + 2.25)


def test_aioready_simulate_is_exported() -> None:
    assert aioready.simulate is simulate


def test_same_seed_gives_byte_identical_json() -> None:
    kw = dict(stages=6, microbatches=12, jitter="multimodal:0.3:3+comm:0.1:0.5", seed=3,
              cap="2x", split_backward=True, steps=2)
    first, second = simulate(**kw).to_json(), simulate(**kw).to_json()  # type: ignore[arg-type]
    assert first == second
    other = simulate(**{**kw, "seed": 4}).to_json()  # type: ignore[arg-type]
    assert other != first
    data = json.loads(first)
    assert len(data["step_time"]) == 2 and data["step_time"][0] != data["step_time"][1]
    assert data["time_unit"] == "ms" and data["cap"] == [12, 10, 8, 6, 4, 2]


def test_result_fields_are_consistent() -> None:
    r = simulate(stages=4, microbatches=16, jitter="lognormal:0.5", seed=1, cap=6)
    d = r.as_dict()
    assert d["step_time"] == r.step_time and d["efficiency"] == r.lower_bound / r.step_time
    assert r.num_tasks == 2 * 4 * 16 and r.num_messages == 2 * 3 * 16
    assert 0 < r.num_notices <= r.num_messages  # at most one per data message, sent at its start
    assert all(0 < b <= 1 for b in r.busy_fraction)
    assert r.bubble_fraction == pytest.approx(1 - sum(r.busy_fraction) / 4)
    assert max(r.peak_in_flight) <= 6 and r.cap == (6, 6, 6, 6)


def test_comm_delay_lengthens_the_step_not_the_bound() -> None:
    plain = simulate(stages=4, microbatches=8, mode="strict")
    slow = simulate(stages=4, microbatches=8, mode="strict", jitter="comm:0.5")
    assert slow.lower_bound == plain.lower_bound and slow.step_time > plain.step_time


def test_caps() -> None:
    hint = aioready.make_hint("1f1b", num_stages=4, num_microbatches=8)
    assert resolve_caps(None, hint) == [4, 3, 2, 1]
    assert resolve_caps("2x", hint) == [8, 6, 4, 2]
    assert resolve_caps("1.5x", hint) == [6, 5, 3, 2]
    assert resolve_caps("3", hint) == [3] * 4 and resolve_caps([1, 2, 3, 4], hint) == [1, 2, 3, 4]
    for bad in ("x", "0x", "two", 0, [1, 2]):
        with pytest.raises(ConfigError):
            resolve_caps(bad, hint)  # type: ignore[arg-type]


@pytest.mark.parametrize("kw, error, words", [
    (dict(mode="fast"), ConfigError, "mode"),
    (dict(stages=0), ConfigError, "stages must be an integer >= 1"),
    (dict(steps=0), ConfigError, "steps"),
    (dict(jitter="lognormal"), TraceError, "wrong number of parameters"),
    (dict(hint="nope"), aioready.HintError, "unknown hint"),
    (dict(mode="strict", cap=1), ConfigError, "strict mode cannot run"),
])
def test_bad_arguments(kw: dict[str, object], error: type, words: str) -> None:
    args: dict[str, object] = dict(stages=4, microbatches=8)
    with pytest.raises(error, match=words):
        simulate(**{**args, **kw})  # type: ignore[arg-type]


def test_trace_replay_and_its_errors(tmp_path: Path) -> None:
    place = Placement.linear(4)
    source = JitterModel("lognormal:0.5", seed=2, placement=place, num_microbatches=8)
    path = tmp_path / "t.csv"
    write_trace(path, source, steps=2)
    a = simulate(stages=4, microbatches=8, jitter="lognormal:0.5", seed=2, steps=2)
    b = simulate(stages=4, microbatches=8, trace=path, steps=2)
    assert [s.step_time for s in a.per_step] == [s.step_time for s in b.per_step]
    with pytest.raises(ConfigError, match="may only add comm"):
        simulate(stages=4, microbatches=8, trace=path, jitter="lognormal:0.1")
    with pytest.raises(TraceError, match="too few steps"):
        simulate(stages=4, microbatches=8, trace=path, steps=3)
    with pytest.raises(TraceError, match="does not fit the placement"):
        simulate(stages=3, microbatches=8, trace=path)
    with pytest.raises(TraceError, match="another pipeline shape"):
        simulate(stages=4, microbatches=4, trace=path)
    c = simulate(stages=4, microbatches=8, trace=path, jitter="comm:0.2")
    assert c.step_time > b.per_step[0].step_time


def test_lower_bound_function_matches_table() -> None:
    source = JitterModel("lognormal:0.8", seed=5, placement=Placement(4, 2, "v"),
                         num_microbatches=6, split_backward=False)
    table = source.table(0)
    assert lower_bound(source.placement, 6, False, step_duration(source, 0)) == \
        pytest.approx(_bound_by_hand(source.placement, table, False), rel=1e-12)


def test_lower_bound_by_hand() -> None:
    # 2 stages, 2 microbatches, unsplit: F and B per (stage, microbatch)
    F = [[1.0, 3.0], [2.0, 1.0]]
    B = [[2.0, 1.0], [4.0, 2.0]]
    chain = max(F[0][m] + F[1][m] + B[1][m] + B[0][m] for m in range(2))  # 9
    rank1 = min(F[0]) + sum(F[1]) + sum(B[1]) + min(B[0])  # 1 + 3 + 6 + 1 = 11
    table = np.zeros((2, 2, 3))
    table[:, :, Kind.F], table[:, :, Kind.B] = F, B
    assert lower_bound_table(Placement.linear(2), table, False) == max(chain, rank1) == 11


def _bound_by_hand(placement: Placement, table: np.ndarray, split: bool) -> float:
    """The lower bound as telemetry/bounds.py's docstring states it, written out task by task:
    the longest chain of one microbatch, and per rank the least head, its busy time and
    (unsplit) the least tail. Plain loops, so a slip in the cumulative sums cannot hide in both."""
    S, M, _ = table.shape
    F, B, W = (lambda s, m, k=k: float(table[s, m, k]) for k in (Kind.F, Kind.B, Kind.W))
    chain = max(sum(F(x, m) for x in range(S)) + sum(B(x, m) for x in range(s, S))
                + (W(s, m) if split else 0.0) for m in range(M) for s in range(S))
    best = chain
    for rank in range(placement.num_ranks):
        stages = placement.stages_of(rank)
        first = min(stages)
        head = min(sum(F(x, m) for x in range(first)) for m in range(M))
        tail = 0.0 if split else min(sum(B(x, m) for x in range(first)) for m in range(M))
        busy = sum(F(x, m) + B(x, m) + (W(x, m) if split else 0.0)
                   for x in stages for m in range(M))
        best = max(best, head + busy + tail)
    return best


def _strict_step_time(hint: aioready.HintOrder, table: np.ndarray) -> float:
    """The step time of running each rank's strict sequence with `table`'s durations and no
    communication delay: every task starts when its rank is free and its inputs have ended (a
    longest path over the dependencies plus each rank's sequence), computed without the runtime."""
    place = hint.placement
    S = place.num_stages
    end: dict[tuple[int, int, Kind], float] = {}
    seqs = [list(hint.strict_order(r)) for r in range(place.num_ranks)]
    free = [0.0] * place.num_ranks
    while any(seqs):
        moved = False
        for rank, seq in enumerate(seqs):
            while seq:
                task = seq[0]
                s, m = place.stages_of(rank)[task.chunk], task.microbatch
                deps = {Kind.F: [(s - 1, m, Kind.F)] if s > 0 else [],
                        Kind.B: [(s, m, Kind.F)] + ([(s + 1, m, Kind.B)] if s < S - 1 else []),
                        Kind.W: [(s, m, Kind.B)]}[task.kind]
                if any(d not in end for d in deps):
                    break
                start = max([free[rank], *(end[d] for d in deps)])
                end[(s, m, task.kind)] = free[rank] = start + float(table[s, m, task.kind])
                seq.pop(0)
                moved = True
        assert moved, f"strict sequences of {hint.name} wait on each other: {seqs}"
    return max(end.values())


def _random_trace(data: st.DataObject, S: int, M: int, split: bool) -> Trace:
    values = data.draw(st.lists(st.floats(0.05, 10.0), min_size=S * M * 3, max_size=S * M * 3))
    tables = np.array(values).reshape(1, S, M, 3)
    if not split:
        tables[..., Kind.W] = 0.0
    return Trace(tables, placement=Placement.linear(S), split_backward=split)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), S=st.integers(1, 5), M=st.integers(1, 6), split=st.booleans(),
       hint=st.sampled_from(["1f1b", "gpipe"]), mode=st.sampled_from(["ready", "strict"]),
       comm=st.sampled_from(["none", "comm:0.3"]))
def test_lower_bound_never_above_step_time(data: st.DataObject, S: int, M: int, split: bool,
                                           hint: str, mode: str, comm: str) -> None:
    trace = _random_trace(data, S, M, split)
    r = simulate(stages=S, microbatches=M, hint=hint, mode=mode, trace=trace, jitter=comm,
                 split_backward=split)
    assert r.lower_bound <= r.step_time * (1 + 1e-12)
    assert r.lower_bound == pytest.approx(_bound_by_hand(trace.placement, trace.table(0), split),
                                          rel=1e-12)
    if mode == "strict" and comm == "none":
        made = aioready.make_hint(hint, num_stages=S, num_microbatches=M, split_backward=split)
        assert r.step_time == pytest.approx(_strict_step_time(made, trace.table(0)), rel=1e-12)


def test_scale_32_stages_128_microbatches() -> None:
    r = simulate(stages=32, microbatches=128, jitter="lognormal:0.5", seed=0)
    assert r.num_tasks == 2 * 32 * 128 and r.lower_bound <= r.step_time
    assert list(r.peak_in_flight) == [min(128, 32 - k) for k in range(32)]


@pytest.mark.heavy
@pytest.mark.timeout(900)  # about 15 s of CPU each; a loaded 2-core machine stretches the wall
@pytest.mark.parametrize("mode", ["strict", "ready"])
def test_scale_128_stages_512_microbatches(mode: str) -> None:
    r = simulate(stages=128, microbatches=512, mode=mode, jitter="lognormal:0.5", seed=0)
    assert r.num_tasks == 2 * 128 * 512 and r.lower_bound <= r.step_time


def test_cli_simulate_json_and_compare(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                       ) -> None:
    out = tmp_path / "r.json"
    args = ["simulate", "--stages", "4", "--microbatches", "8", "--jitter", "lognormal:0.5",
            "--seed", "1", "--mode", "ready", "--cap", "2x", "--json", str(out)]
    assert main(args) == 0
    assert json.loads(out.read_text()) == json.loads(simulate(
        stages=4, microbatches=8, jitter="lognormal:0.5", seed=1, cap="2x").to_json())
    assert main([*args[:-2], "--compare", "--write-trace", str(tmp_path / "t.csv")]) == 0
    text = capsys.readouterr().out
    assert "1f1b strict: step time" in text and "speedup of ready over strict:" in text
    assert read_trace(tmp_path / "t.csv").num_microbatches == 8
    assert main(["simulate", "--stages", "4", "--microbatches", "8", "--jitter", "bad:1"]) == 1
    assert "unknown term 'bad'" in capsys.readouterr().err
    bad = tmp_path / "bad.csv"
    bad.write_text("step,stage,chunk,microbatch,kind,ms\n0,0,0,0,F,-1\n")
    assert main(["simulate", "--stages", "1", "--microbatches", "1", "--trace", str(bad)]) == 1
    assert "line 2: negative duration" in capsys.readouterr().err


# -- the simulator against a real in-process run with real sleeps -------------------------------
def _real_trace() -> JitterModel:
    """Durations of 15-30 ms (F ~15, B ~27 with mild jitter): long enough that a timer waking
    0.1-0.3 ms late on this VM (docs/async.md "Spin, park, back off") stays ~1% of a task."""
    return JitterModel("lognormal:0.15", seed=11, placement=Placement.linear(4),
                       num_microbatches=8, base=BaseDurations(f=15.0, b=27.0))


async def _real_step(durations: object, mode: str) -> tuple[float, object]:
    pipe = aioready.Pipeline([None] * 4, None, microbatches=8, hint="1f1b", mode=mode,
                             device=SimDevice(device_duration(durations, 1e-3),  # type: ignore
                                              run_compute=False))
    await pipe.step()
    assert pipe.last_step is not None
    return pipe.last_step.step_time * 1e3, pipe.last_step


def _precise_loop() -> asyncio.AbstractEventLoop:
    """A plain asyncio loop on select(2): its timeouts are in microseconds, where epoll rounds
    every sleep up to the next millisecond (a 7% error on 7 ms tasks)."""
    return asyncio.SelectorEventLoop(selectors.SelectSelector())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["strict", "ready"])
def test_simulator_bounds_a_real_run_with_real_sleeps(mode: str) -> None:
    """One real run (real sleeps) against the simulator, by what holds on any machine load: a
    real sleep only ends late, so every task ran at least its asked duration; no run of the
    recorded durations beats their lower bound; and in strict order (a fixed sequence, so the
    step time only grows with the durations) asked <= replayed <= real, the real run adding
    only overhead. How close real comes to simulated measures the machine: bench material."""
    source = _real_trace()
    buf = io.StringIO()
    write_trace(buf, source)
    trace = read_trace(io.StringIO(buf.getvalue()))
    simulated = simulate(stages=4, microbatches=8, mode=mode, trace=trace).step_time
    with asyncio.Runner(loop_factory=_precise_loop) as runner:
        real, report = runner.run(_real_step(trace, mode))
    recorded = trace_from_reports([report], placement=trace.placement,  # type: ignore
                                  num_microbatches=8, split_backward=False)
    ran, asked = recorded.tables[..., :2], trace.tables[..., :2]
    assert (ran >= asked - 1e-6).all(), float((asked - ran).max())
    replayed = simulate(stages=4, microbatches=8, mode=mode, trace=recorded)
    bound = lower_bound_table(trace.placement, recorded.table(0), False)
    assert bound <= real * (1 + 1e-9) and bound <= replayed.step_time * (1 + 1e-12)
    if mode == "strict":
        assert simulated <= replayed.step_time * (1 + 1e-9), (simulated, replayed.step_time)
        assert replayed.step_time <= real * (1 + 1e-9), (replayed.step_time, real)
        hint = aioready.make_hint("1f1b", num_stages=4, num_microbatches=8)
        for rank in range(4):
            ran_order = [(s.kind, s.microbatch) for s in sorted(
                (s for s in report.spans if s.rank == rank), key=lambda s: s.start)]
            assert ran_order == [(t.kind, t.microbatch) for t in hint.strict_order(rank)]


def test_strict_checks_each_ranks_own_sequence() -> None:
    from aioready.hints import HintOrder
    from aioready.tasks import Task
    good = aioready.make_hint("1f1b", num_stages=2, num_microbatches=2)
    bad_rank1 = (Task(Kind.B, 0), Task(Kind.F, 0), Task(Kind.F, 1), Task(Kind.B, 1))
    hint = HintOrder("bad", good.placement, 2, False, (good.orders[0], bad_rank1))
    hint.check_sequence(only_rank=0)
    with pytest.raises(aioready.HintError, match="rank 1.*task B0"):
        hint.check_sequence(only_rank=1)
    with pytest.raises(aioready.HintError, match="rank 1.*task B0"):
        simulate(stages=2, microbatches=2, hint=hint, mode="strict")
    assert simulate(stages=2, microbatches=2, hint=hint, mode="ready").step_time > 0
