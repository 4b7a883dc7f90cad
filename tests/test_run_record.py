"""`aioready train --run-record F`: JSON lines a person or a BI tool can read -- a start line
(configuration, versions, git revision, layout), then an end line, or an error line when the
run failed; strict JSON (no bare NaN)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from aioready.cli import main as cli_main

pytestmark = pytest.mark.timeout(60)
ARGS = ["train", "--stages", "2", "--microbatches", "2", "--task-ms", "0", "--batch", "1",
        "--seq", "4", "--dim", "8", "--no-progress", "--steps", "2"]


def _lines(path: Path) -> list[dict]:
    def refuse(name: str) -> None:
        raise AssertionError(f"bare {name}")
    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def test_a_run_writes_start_and_end(tmp_path: Path) -> None:
    path = tmp_path / "runs" / "record.jsonl"
    assert cli_main([*ARGS, "--run-record", str(path)]) == 0
    start, end = _lines(path)
    assert start["event"] == "start" and end["event"] == "end"
    assert start["config"]["stages"] == 2 and start["config"]["hint"] == "auto"  # the default
    assert start["packages"]["torch"] and start["packages"]["aioready"]
    assert start["layout"] == {"0": [0], "1": [1]} and start["sealed"] is None
    assert start["rank"] == 0 and start["world_size"] == 1
    assert start["git"] is None or re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", start["git"])
    assert end["steps"] == 2 and len(end["losses"]) == 2 and end["diverged_at"] is None
    assert start["time"] <= end["time"]
    assert cli_main([*ARGS, "--run-record", str(path)]) == 0  # appended, not overwritten
    assert [r["event"] for r in _lines(path)] == ["start", "end", "start", "end"]


def test_a_failed_run_writes_its_error(tmp_path: Path) -> None:
    path = tmp_path / "record.jsonl"
    assert cli_main([*ARGS, "--steps", "3", "--lr", "1e30", "--on-nan", "stop",
                     "--run-record", str(path)]) != 0
    start, error = _lines(path)
    assert start["event"] == "start" and start["config"]["lr"] == 1e30
    assert error["event"] == "error" and error["error"] == "DivergedError"
    assert "the run diverged" in error["message"]


def test_torchrun_style_launch_is_refused(monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """torchrun starts N processes with WORLD_SIZE=N; aioready train would have trained N
    independent copies. It says so instead."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert cli_main(ARGS) != 0
    err = capsys.readouterr().err
    assert "WORLD_SIZE=4" in err and "mpiexec -n 4" in err, err
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert cli_main(ARGS) == 0
