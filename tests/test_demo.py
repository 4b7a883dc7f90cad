"""`make demo`'s command (`python -m aioready.demo`) at reduced size."""

from __future__ import annotations

from pathlib import Path

import pytest

from aioready.demo import main


@pytest.mark.timeout(240)
def test_demo_runs_at_reduced_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the same entry point as `make demo`; MPI when the build and machine have it
    assert main(["--ranks", "2", "--microbatches", "3", "--steps", "1", "--task-ms", "5",
                 "--out", str(tmp_path), "--timeout", "120"]) == 0
    text = capsys.readouterr().out
    assert "transport:" in text
    assert "strict" in text and "ready" in text and "speedup" in text
    for name in ("strict.png", "ready.png", "compare.png", "strict.json", "ready.json"):
        assert (tmp_path / name).stat().st_size > 0, name
