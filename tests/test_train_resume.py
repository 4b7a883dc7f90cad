"""`aioready train --checkpoint-dir D --resume`: a run stopped after step 3 of 6 and resumed gives
the same losses for steps 4..6 as an uninterrupted run, bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aioready.cli import main

pytestmark = pytest.mark.timeout(120)
ARGS = ["train", "--stages", "4", "--microbatches", "4", "--mode", "strict", "--task-ms", "0",
        "--no-progress", "--seq", "8", "--dim", "16"]


def _losses(tmp: Path, name: str, *extra: str) -> list[float]:
    out = tmp / f"{name}.json"
    assert main([*ARGS, "--json", str(out), *extra]) == 0
    return json.loads(out.read_text())["loss"]  # type: ignore[no-any-return]


def test_train_resume_matches_uninterrupted(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    whole = _losses(tmp_path, "whole", "--steps", "6")
    ckpt = tmp_path / "ckpt"
    first = _losses(tmp_path, "first", "--steps", "3", "--checkpoint-dir", str(ckpt))
    assert first == whole[:3]
    assert sorted(p.name for p in ckpt.iterdir()) == [f"step-{i:08d}" for i in (1, 2, 3)]
    rest = _losses(tmp_path, "rest", "--steps", "6", "--checkpoint-dir", str(ckpt), "--resume")
    assert rest == whole[3:]  # exact
    capsys.readouterr()
    # a checkpoint of another model is refused before anything is loaded or written
    before = {p: p.read_bytes() for p in ckpt.rglob("*.pt")}
    assert main([*ARGS, "--steps", "7", "--dim", "32", "--checkpoint-dir", str(ckpt),
                 "--resume"]) == 1
    err = capsys.readouterr().err
    assert "aioready train: error: rank 0: stage 0: parameter" in err and "differs" in err, err
    assert {p: p.read_bytes() for p in ckpt.rglob("*.pt")} == before


def test_resume_needs_a_directory(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*ARGS, "--steps", "1", "--resume"]) == 1
    assert "resume needs a checkpoint directory" in capsys.readouterr().err
