"""Checkpoints are verified before anything is loaded: a corrupt file is refused naming it, a
file whose tensors disagree with its manifest or hold NaN leaves every stage untouched, a 0-byte
file is a clear error, killed writes leave no orphans, and the CLI can resume with another
schedule (--no-check-config, which the error suggests) and load a checkpoint from before
checksums (--no-verify, likewise)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from aioready import CheckpointError
from aioready.cli import main as cli_main
from aioready.runtime import checkpoint
from aioready.runtime.digest import content_digest
from aioready.runtime.pipeline import Pipeline
from tests.ckpt_job import build

pytestmark = pytest.mark.timeout(120)
FILE = "rank-00002-of-00004.pt"


def _params(pipe: Pipeline) -> list[torch.Tensor]:
    return [p.detach().clone() for rt in pipe.runtimes for ex in rt.executors  # type: ignore
            for p in ex.module.parameters()]


def _saved(tmp_path: Path) -> Path:
    pipe, opts = build()
    x, y = torch.randn(8, 16, dtype=torch.float64), torch.randn(8, 16, dtype=torch.float64)
    asyncio.run(pipe.step(x, y))
    for o in opts:
        o.step()
    out = checkpoint.save_checkpoint(tmp_path, pipe, opts)
    pipe.close()
    return out


def _rewrite(path: Path, change, keep_digest: bool) -> None:  # type: ignore[no-untyped-def]
    state = torch.load(path, weights_only=True)
    digest = state.pop("sha256")
    change(state)
    state["sha256"] = digest if keep_digest else content_digest(state)
    torch.save(state, path)


def _refused(tmp_path: Path, match: str) -> None:
    fresh, opts = build()
    before = _params(fresh)
    with pytest.raises(CheckpointError, match=match):
        checkpoint.load_checkpoint(tmp_path, fresh, opts)
    assert all(torch.equal(a, b) for a, b in zip(_params(fresh), before))  # nothing loaded
    fresh.close()


def test_a_flipped_value_is_refused_naming_the_file(tmp_path: Path) -> None:
    step = _saved(tmp_path)

    def flip(state):  # type: ignore[no-untyped-def]
        w = state["stages"][2]["model"]["0.up.weight"]
        w.view(torch.uint8).view(-1)[5] ^= 0x10  # one bit of one weight
    _rewrite(step / FILE, flip, keep_digest=True)
    _refused(tmp_path, f"{FILE} is corrupt: its content does not match its SHA-256")


def test_a_flipped_byte_in_the_file_is_refused_naming_it(tmp_path: Path) -> None:
    step = _saved(tmp_path)
    raw = bytearray((step / FILE).read_bytes())
    raw[len(raw) // 2] ^= 0x01
    (step / FILE).write_bytes(bytes(raw))
    _refused(tmp_path, FILE)


def test_tensors_that_disagree_with_the_manifest_load_nothing(tmp_path: Path) -> None:
    step = _saved(tmp_path)

    def widen(state):  # type: ignore[no-untyped-def]
        state["stages"][2]["model"]["0.up.weight"] = torch.zeros(3, 3, dtype=torch.float64)
    _rewrite(step / FILE, widen, keep_digest=False)  # a consistent file, but a wrong tensor
    _refused(tmp_path, "rank 2: stage 2: tensor '0.up.weight' disagrees with the manifest")


def test_nan_weights_are_refused(tmp_path: Path) -> None:
    step = _saved(tmp_path)

    def poison(state):  # type: ignore[no-untyped-def]
        state["stages"][2]["model"]["0.up.weight"][0, 0] = float("nan")
    _rewrite(step / FILE, poison, keep_digest=False)
    _refused(tmp_path, "stage 2: tensor '0.up.weight' holds NaN or inf")


def test_empty_file_and_missing_checksum_are_clear_errors(tmp_path: Path) -> None:
    step = _saved(tmp_path)
    good = (step / FILE).read_bytes()
    (step / FILE).write_bytes(b"")
    _refused(tmp_path, f"{FILE} is empty")
    (step / FILE).write_bytes(good)
    _rewrite(step / FILE, lambda state: None, keep_digest=True)
    state = torch.load(step / FILE, weights_only=True)
    del state["sha256"]
    torch.save(state, step / FILE)
    _refused(tmp_path, r"carries no checksum.*; a file written before checksums: load it "
             r"with verify=False \(aioready train: --resume --no-verify\)")
    fresh, opts = build()
    assert checkpoint.load_checkpoint(tmp_path, fresh, opts, verify=False) == 1
    fresh.close()


def test_orphan_temporary_files_are_removed(tmp_path: Path) -> None:
    step = _saved(tmp_path)
    orphan = step / f".{FILE}.tmp-999999"
    orphan.write_bytes(b"half a file")
    fresh, opts = build()
    assert checkpoint.resume(tmp_path, fresh, opts) == 1
    assert not orphan.exists()
    orphan.write_bytes(b"half a file")
    checkpoint.save_checkpoint(tmp_path, fresh, opts, step=1)
    assert not orphan.exists() and sorted(p.name for p in step.iterdir()) == \
        [f"rank-{r:05d}-of-00004.pt" for r in range(4)]
    fresh.close()


def test_cli_resumes_with_another_schedule_when_asked(tmp_path: Path) -> None:
    args = ["train", "--stages", "2", "--microbatches", "2", "--task-ms", "0", "--batch", "1",
            "--seq", "4", "--dim", "8", "--no-progress", "--checkpoint-dir", str(tmp_path)]
    assert cli_main([*args, "--steps", "1"]) == 0
    assert cli_main([*args, "--steps", "2", "--resume", "--hint", "gpipe"]) != 0
    assert checkpoint.latest(tmp_path) == tmp_path / "step-00000001"
    assert cli_main([*args, "--steps", "2", "--resume", "--hint", "gpipe",
                     "--no-check-config"]) == 0
    assert checkpoint.latest(tmp_path) == tmp_path / "step-00000002"


def test_disk_full_is_a_checkpoint_error_and_leaves_no_temporary(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import os
    pipe, opts = build()

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(CheckpointError, match="cannot write checkpoint file.*No space left"):
        checkpoint.save_checkpoint(tmp_path, pipe, opts)
    monkeypatch.undo()
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]
    pipe.close()


def test_cli_resumes_a_checkpoint_from_before_checksums_only_when_told(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["train", "--stages", "2", "--microbatches", "2", "--task-ms", "0", "--batch", "1",
            "--seq", "4", "--dim", "8", "--no-progress", "--checkpoint-dir", str(tmp_path)]
    assert cli_main([*args, "--steps", "1"]) == 0
    files = sorted((tmp_path / "step-00000001").glob("rank-*.pt"))
    assert len(files) == 2
    for f in files:  # as written before checksums
        state = torch.load(f, weights_only=True)
        del state["sha256"]
        torch.save(state, f)
    capsys.readouterr()
    assert cli_main([*args, "--steps", "2", "--resume"]) != 0
    err = capsys.readouterr().err
    assert "carries no checksum" in err and "--resume --no-verify" in err
    assert checkpoint.latest(tmp_path) == tmp_path / "step-00000001"
    assert cli_main([*args, "--steps", "2", "--resume", "--no-verify"]) == 0
    assert checkpoint.latest(tmp_path) == tmp_path / "step-00000002"
