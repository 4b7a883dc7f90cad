"""Chrome trace, CSV and Parquet exports, PNG timelines and `aioready plot`."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from aioready.cli import main as cli_main
from aioready.clock import run_virtual
from aioready.devices.sim import SimDevice
from aioready.errors import TraceError
from aioready.runtime.pipeline import Pipeline
from aioready.tasks import Kind
from aioready.telemetry.export import (
    KIND_CNAME,
    chrome_trace,
    read_chrome_trace,
    read_csv,
    read_reports,
    write_chrome_trace,
    write_csv,
    write_parquet,
)
from aioready.telemetry.spans import StepReport

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def jittered(i) -> float:
    base = {Kind.F: 1.0, Kind.B: 2.0, Kind.W: 1.0}[i.kind]
    return base * (3.0 if (i.microbatch * 7 + i.step) % 5 == 0 else 1.0) * (1 + 0.1 * i.stage)


def reports(mode: str = "ready", *, split: bool = False, steps: int = 2) -> list[StepReport]:
    pipe = Pipeline([None] * 4, None, microbatches=6, hint="1f1b", mode=mode,
                    split_backward=split, device=SimDevice(jittered, run_compute=False))

    async def main() -> list[StepReport]:
        out = []
        for _ in range(steps):
            await pipe.step()
            assert pipe.last_step is not None
            out.append(pipe.last_step)
        return out
    return run_virtual(main())


@pytest.mark.parametrize("split", [False, True])
def test_chrome_trace_has_one_complete_event_per_task(tmp_path: Path, split: bool) -> None:
    reps = reports(split=split)
    path = write_chrome_trace(reps, tmp_path / "t.json")
    data = json.loads(path.read_text())  # valid JSON
    assert isinstance(data["traceEvents"], list)
    complete = [e for e in data["traceEvents"] if e["ph"] == "X"]
    tasks = [(r.step, s.rank, s.label) for r in reps for s in r.spans]
    assert len(complete) == len(tasks) == len(set(tasks))
    assert sorted((e["args"]["step"], e["pid"], e["name"]) for e in complete) == sorted(tasks)
    for e in complete:
        assert {"name", "cat", "ph", "ts", "dur", "pid", "tid"} <= set(e)
        assert e["cat"] in "FBW" and e["cname"] == KIND_CNAME[Kind[e["cat"]]]
        assert e["name"] == f"{e['cat']}{e['args']['microbatch']}"
        asked = jittered(SimpleNamespace(kind=Kind[e["cat"]], **{
            k: e["args"][k] for k in ("step", "stage", "microbatch")}))
        assert e["dur"] == pytest.approx(asked * 1e6, abs=1e-3)  # the virtual clock is exact
    assert min(e["ts"] for e in complete) == 0.0  # from the first step's start
    for rank in range(4):  # one device per rank: its tasks follow each other
        row = sorted((e["ts"], e["dur"]) for e in complete if e["pid"] == rank)
        assert all(t + d <= t_next + 1e-3 for (t, d), (t_next, _) in zip(row, row[1:]))
    # one named row per rank
    names = {e["pid"]: e["args"]["name"] for e in data["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {r: f"rank {r}" for r in range(4)}
    assert {e["pid"] for e in complete} == set(range(4))
    assert {e["tid"] for e in complete} == {0}


def test_chrome_trace_reads_back(tmp_path: Path) -> None:
    reps = reports()
    back = read_chrome_trace(write_chrome_trace(reps, tmp_path / "t.json"))
    assert [r.step for r in back] == [r.step for r in reps]
    for a, b in zip(reps, back):
        assert b.step_time == pytest.approx(a.step_time, abs=1e-6)
        key = lambda s: (s.rank, s.kind, s.microbatch)  # noqa: E731
        for x, y in zip(sorted(a.spans, key=key), sorted(b.spans, key=key)):
            assert (x.rank, x.stage, x.chunk, x.microbatch, x.kind) == \
                (y.rank, y.stage, y.chunk, y.microbatch, y.kind)
            assert y.end - y.start == pytest.approx(x.end - x.start, abs=1e-6)


def test_chrome_trace_of_a_clock_counting_ms() -> None:
    # the simulator's virtual clock counts ms (the trace unit): one unit = 1000 us, not 1e6
    (rep,) = reports(steps=1)
    events = [e for e in chrome_trace([rep], clock_unit_s=1e-3)["traceEvents"] if e["ph"] == "X"]
    durs = sorted(round((s.end - s.start) * 1e3, 3) for s in rep.spans)
    assert sorted(e["dur"] for e in events) == durs


@pytest.mark.parametrize("split", [False, True])
def test_csv_round_trips_exactly(tmp_path: Path, split: bool) -> None:
    reps = reports(split=split, steps=3)
    back = read_csv(write_csv(reps, tmp_path / "spans.csv"))
    assert [r.step for r in back] == [0, 1, 2]
    for a, b in zip(reps, back):
        assert b.spans == a.spans  # same floats, bit for bit
    header = (tmp_path / "spans.csv").read_text().splitlines()[0]
    assert header == "step,rank,stage,chunk,microbatch,kind,ready_s,start_s,end_s"


def test_bad_trace_files_say_what_is_wrong(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("step,rank\n1,2\n")
    with pytest.raises(TraceError, match="bad.csv"):
        read_csv(bad)
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"traceEvents": []}))
    with pytest.raises(TraceError, match="no task events"):
        read_chrome_trace(empty)


@pytest.mark.skipif(importlib.util.find_spec("pyarrow") is None, reason="pyarrow not installed")
def test_parquet_has_the_csv_columns(tmp_path: Path) -> None:
    import pyarrow.parquet as pq
    reps = reports()
    table = pq.read_table(write_parquet(reps, tmp_path / "s.parquet"))
    assert table.num_rows == sum(len(r.spans) for r in reps)
    assert table.column_names[:6] == ["step", "rank", "stage", "chunk", "microbatch", "kind"]


def test_timeline_and_compare_pngs(tmp_path: Path) -> None:
    from aioready.telemetry.plots import plot_compare, plot_timeline
    (strict,) = reports("strict", steps=1)
    (ready,) = reports("ready", steps=1)
    one = plot_timeline(ready, tmp_path / "one.png")
    two = plot_compare([strict, ready], tmp_path / "two.png")
    for p in (one, two):
        data = p.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000


def test_plot_command_from_json_and_csv(tmp_path: Path) -> None:
    reps = reports(steps=2)
    write_chrome_trace(reps, tmp_path / "t.json")
    write_csv(reps, tmp_path / "t.csv")
    assert cli_main(["plot", str(tmp_path / "t.json"), "-o", str(tmp_path / "a.png")]) == 0
    assert cli_main(["plot", str(tmp_path / "t.csv"), "-o", str(tmp_path / "b.png"),
                     "--step", "0"]) == 0
    for name in ("a.png", "b.png"):
        assert (tmp_path / name).read_bytes().startswith(PNG_MAGIC)
    assert cli_main(["plot", str(tmp_path / "t.csv"), "-o", str(tmp_path / "c.png"),
                     "--step", "9"]) == 1  # a clear error, not a traceback


def test_read_reports_picks_the_reader_by_suffix(tmp_path: Path) -> None:
    reps = reports(steps=1)
    spans = sorted((s.rank, s.label) for s in reps[0].spans)
    for path in (write_chrome_trace(reps, tmp_path / "t.json"), write_csv(reps, tmp_path / "t.csv"),
                 write_parquet(reps, tmp_path / "t.parquet")):
        back = read_reports(path)
        assert [r.step for r in back] == [reps[0].step]
        assert sorted((s.rank, s.label) for s in back[0].spans) == spans
    assert read_reports(tmp_path / "t.parquet")[0].spans == read_csv(tmp_path / "t.csv")[0].spans
    with pytest.raises(TraceError, match="unknown trace file type"):
        read_reports(tmp_path / "t.txt")
