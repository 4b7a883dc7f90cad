"""`make demo`'s command (`python -m aioready.demo`) at reduced size."""

from __future__ import annotations

from pathlib import Path

import pytest

from aioready.demo import main, mpi_launcher

ARGS = ["--ranks", "2", "--microbatches", "3", "--steps", "1", "--task-ms", "5",
        "--timeout", "150"]


def check_outputs(text: str, out: Path) -> None:
    assert "strict" in text and "ready" in text and "speedup" in text
    assert "virtual clock, same durations" in text
    for name in ("strict.png", "ready.png", "compare.png", "strict.json", "ready.json",
                 "strict.trace.json", "ready.trace.json"):
        assert (out / name).stat().st_size > 0, name


@pytest.mark.timeout(120)
def test_demo_runs_in_process_at_reduced_size(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*ARGS, "--in-process", "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "transport: in-process (--in-process given)" in text
    check_outputs(text, tmp_path)


@pytest.mark.mpi
@pytest.mark.heavy  # two mpiexec jobs importing torch per rank: minutes on a loaded 2-core box
@pytest.mark.timeout(400)
def test_demo_runs_over_mpi_at_reduced_size(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    exe, why = mpi_launcher()
    if exe is None:
        pytest.skip(why)
    assert main([*ARGS, "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "transport: MPI via" in text
    check_outputs(text, tmp_path)
    assert '"transport": "mpi"' in (tmp_path / "ready.json").read_text()
