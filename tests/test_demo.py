"""`make demo`'s command (`python -m aioready.cli.demo`) at reduced size."""

from __future__ import annotations

from pathlib import Path

import pytest

from aioready.cli.demo import main, mpi_launcher

ARGS = ["--ranks", "2", "--microbatches", "3", "--steps", "1", "--task-ms", "5",
        "--timeout", "150"]


def check_outputs(text: str, out: Path) -> None:
    assert "strict" in text and "ready" in text and "speedup" in text
    assert "virtual clock, same durations" in text
    for name in ("strict.png", "ready.png", "compare.png", "strict.json", "ready.json",
                 "strict.trace.json", "ready.trace.json"):
        assert (out / name).stat().st_size > 0, name


@pytest.mark.timeout(120)
def test_demo_falls_back_to_in_process_when_mpiexec_fails(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    import aioready.cli.demo as demo
    monkeypatch.setattr(demo, "mpi_launcher", lambda: ("/bin/false", "MPI via false"))
    assert main([*ARGS, "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "the MPI run failed (mpiexec exited with 1" in text
    assert "falling back to in-process for both modes" in text
    check_outputs(text, tmp_path)
    for mode in ("strict", "ready"):
        assert '"transport": "inproc"' in (tmp_path / f"{mode}.json").read_text()


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
