"""Spans gathered to rank 0 as numbers over MPI (mpiexec -n 2), no pickle."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import requires_mpi, run_mpi

pytestmark = [pytest.mark.mpi, requires_mpi]


@pytest.mark.timeout(90)
def test_gather_reports_under_mpiexec() -> None:
    out = run_mpi(2, [str(Path(__file__).parent / "mpi_scripts" / "gather_reports.py")],
                  timeout=80)
    assert out.returncode == 0, out.stderr
    steps = json.loads(out.stdout)
    assert [s["step"] for s in steps] == [0, 1, 2]
    for s in steps:
        step = s["step"]
        assert s["num_ranks"] == 2
        assert s["loss"] == (step + 0.5 if step < 2 else "nan")  # from the last rank
        assert s["peaks"] == {"0": 3, "1": 2}
        # rank 1 started first, but a step starts where stage 0 (rank 0) starts it; max end
        assert s["start"] == step + 0.001 and s["end"] == step + 1.001
        spans = s["spans"]
        assert len(spans) == 2 * 3 * 2
        assert {(sp[0], sp[3], sp[4]) for sp in spans} == \
            {(r, m, k) for r in range(2) for m in range(3) for k in range(2)}
        for rank, stage, chunk, mb, kind, ready, start, end in spans:
            assert stage == rank and chunk == 0
            assert start == step + 0.1 * mb + 0.01 * rank and end == step + 0.1 * mb + 0.05


@pytest.mark.heavy  # two interpreters importing torch: ~20 s idle, ~95 s on a loaded 2-core box
@pytest.mark.timeout(180)
def test_train_under_mpiexec_matches_in_process(tmp_path: Path) -> None:
    args = ["train", "--stages", "2", "--microbatches", "3", "--steps", "2", "--task-ms", "2",
            "--dim", "16", "--seq", "8", "--mode", "strict", "--no-progress"]
    out = run_mpi(2, ["-m", "aioready", *args, "--json", str(tmp_path / "mpi.json"),
                      "--chrome-trace", str(tmp_path / "mpi.trace.json")], timeout=170)
    assert out.returncode == 0, out.stdout + out.stderr
    mpi = json.loads((tmp_path / "mpi.json").read_text())
    assert mpi["transport"] == "mpi" and mpi["ranks"] == 2
    from aioready.cli import main
    assert main([*args, "--json", str(tmp_path / "inproc.json")]) == 0
    inproc = json.loads((tmp_path / "inproc.json").read_text())
    assert inproc["transport"] == "inproc"
    assert mpi["loss"] == pytest.approx(inproc["loss"], rel=1e-6)  # same model, data, order
    assert all(0 < e <= 1 + 1e-9 for e in mpi["efficiency"])
    events = json.loads((tmp_path / "mpi.trace.json").read_text())["traceEvents"]
    assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 1}  # both ranks' spans arrived
    assert len([e for e in events if e["ph"] == "X"]) == 2 * 2 * 3 * 2
