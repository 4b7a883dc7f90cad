"""Checkpoints: resume after SIGKILL gives the same losses, interrupted writes keep the previous
checkpoint, and checkpoints of another model or stage count are refused with nothing changed."""

from __future__ import annotations

import argparse
import asyncio
import copy
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aioready import CheckpointError
from aioready.runtime import checkpoint
from aioready.runtime.pipeline import Pipeline
from aioready.testing.helpers import make_mlp_stages, mse_loss
from tests.ckpt_job import build
from tests.ckpt_job import main as job_main

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(120)


def _job(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(ROOT / "tests" / "ckpt_job.py"), *args],
                          capture_output=True, text=True, timeout=100, env=env, cwd=ROOT)


def _losses(out: str) -> dict[int, str]:
    return {int(a): b for a, b in (line.split() for line in out.splitlines())}


def test_resume_after_sigkill_matches_uninterrupted(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    asyncio.run(job_main(argparse.Namespace(dir=None, steps=6, kill_after=0, resume=False,
                                            width=16)))
    whole = _losses(capsys.readouterr().out)
    killed = _job("--dir", str(tmp_path), "--kill-after", "3")
    assert killed.returncode == -9, killed.stderr
    assert sorted(_losses(killed.stdout)) == [0, 1, 2]
    assert checkpoint.latest(tmp_path) == tmp_path / "step-00000003"
    asyncio.run(job_main(argparse.Namespace(dir=str(tmp_path), steps=6, kill_after=0,
                                            resume=True, width=16)))
    after = _losses(capsys.readouterr().out)
    assert sorted(after) == [3, 4, 5]
    assert all(after[s] == whole[s] for s in (3, 4, 5)), (after, whole)  # bit for bit


def _params(pipe: Pipeline) -> list[torch.Tensor]:
    return [p.detach().clone() for rt in pipe.runtimes for ex in rt.executors  # type: ignore
            for p in ex.module.parameters()]


async def _train(pipe: Pipeline, opts: list[torch.optim.Optimizer], steps: int) -> None:
    for _ in range(steps):
        x, y = torch.randn(8, 16, dtype=torch.float64), torch.randn(8, 16, dtype=torch.float64)
        for o in opts:
            o.zero_grad()
        await pipe.step(x, y)
        for o in opts:
            o.step()


async def test_interrupted_write_keeps_previous(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    pipe, opts = build()
    await _train(pipe, opts, 1)
    checkpoint.save_checkpoint(tmp_path, pipe, opts)
    saved = _params(pipe)
    await _train(pipe, opts, 1)
    real_replace, calls = os.replace, []

    def crash_on_third(src: str, dst: str) -> None:  # dies after two of four rank files
        calls.append(dst)
        if len(calls) == 3:
            raise KeyboardInterrupt("killed mid-write")
        real_replace(src, dst)
    monkeypatch.setattr(os, "replace", crash_on_third)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_checkpoint(tmp_path, pipe, opts)
    monkeypatch.undo()
    partial = tmp_path / "step-00000002"
    assert sorted(p.name for p in partial.iterdir()) == ["rank-00000-of-00004.pt",
                                                         "rank-00001-of-00004.pt"]
    (partial / ".rank-00002-of-00004.pt.tmp-1").write_bytes(b"half a file")  # a hard kill's leftover
    assert checkpoint.latest(tmp_path) == tmp_path / "step-00000001"
    fresh, fresh_opts = build()
    assert checkpoint.load_checkpoint(tmp_path, fresh, fresh_opts) == 1
    assert fresh.step_index == 1
    assert all(torch.equal(a, b) for a, b in zip(_params(fresh), saved))
    pipe.close()
    fresh.close()


async def test_other_model_or_stage_count_refused(tmp_path: Path) -> None:
    pipe, opts = build()
    await _train(pipe, opts, 1)
    checkpoint.save_checkpoint(tmp_path, pipe, opts)
    files = {p: p.read_bytes() for p in tmp_path.rglob("*.pt")}

    wide, wide_opts = build(width=32)
    before = _params(wide)
    with pytest.raises(CheckpointError, match=r"stage 0: parameter '0.norm.weight' differs "
                       r"\(expected shape \(32,\) float64 \(this model\), got shape \(16,\)"):
        checkpoint.load_checkpoint(tmp_path, wide, wide_opts)
    assert all(torch.equal(a, b) for a, b in zip(_params(wide), before))  # nothing loaded

    two = make_mlp_stages(2)
    pipe2 = Pipeline(two, mse_loss, microbatches=4, hint="1f1b", mode="strict")
    with pytest.raises(CheckpointError, match="no file for rank 0 of 2"):
        checkpoint.load_checkpoint(tmp_path, pipe2)
    for r in (0, 1):
        (tmp_path / "step-00000001" / f"rank-{r:05d}-of-00002.pt").write_bytes(
            (tmp_path / "step-00000001" / f"rank-{r:05d}-of-00004.pt").read_bytes())
    with pytest.raises(CheckpointError, match=r"another stage count \(expected stage count 2 "
                       r"\(this pipeline\), got 4 \(the checkpoint\)\)"):
        checkpoint.load_checkpoint(tmp_path / "step-00000001", pipe2)
    for r in (0, 1):
        (tmp_path / "step-00000001" / f"rank-{r:05d}-of-00002.pt").unlink()

    other, other_opts = build()
    other.hint = type(other.hint)("gpipe-like", other.hint.placement, 4, False,
                                  other.hint.orders)
    with pytest.raises(CheckpointError, match="another hint.*check_config=False"):
        checkpoint.load_checkpoint(tmp_path, other, other_opts)
    with pytest.raises(CheckpointError, match="stage 0: the optimizers do not match"):
        checkpoint.load_checkpoint(tmp_path, build()[0])  # no optimizers given
    assert checkpoint.load_checkpoint(tmp_path, other, other_opts, check_config=False) == 1
    assert {p: p.read_bytes() for p in tmp_path.rglob("*.pt")} == files  # nothing overwritten
    for p in (pipe, wide, pipe2, other):
        p.close()


def test_unreadable_files_refused(tmp_path: Path) -> None:
    pipe, opts = build()
    d = tmp_path / "step-00000001"
    d.mkdir()
    for r in range(4):
        (d / f"rank-{r:05d}-of-00004.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot read checkpoint file"):
        checkpoint.load_checkpoint(tmp_path, pipe, opts)
    buf = io.BytesIO()
    torch.save({"manifest": argparse.Namespace(x=1)}, buf)  # an arbitrary object: never unpickled
    (d / "rank-00000-of-00004.pt").write_bytes(buf.getvalue())
    with pytest.raises(CheckpointError, match="cannot read checkpoint file.*UnpicklingError"):
        checkpoint.load_checkpoint(tmp_path, pipe, opts)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        checkpoint.load_checkpoint(tmp_path / "empty", pipe, opts)
    assert checkpoint.resume(tmp_path / "empty", pipe, opts) == 0
    pipe.close()


async def test_state_dict_roundtrip_in_memory() -> None:
    pipe, opts = build()
    await _train(pipe, opts, 2)
    state = copy.deepcopy(pipe.state_dict(opts))  # like torch's, it references live tensors
    assert sorted(state) == [0, 1, 2, 3] and state[3]["manifest"]["step"] == 2
    want = _params(pipe)
    await _train(pipe, opts, 1)
    assert pipe.load_state_dict(state, opts) == 2
    assert all(torch.equal(a, b) for a, b in zip(_params(pipe), want))
    with pytest.raises(Exception, match="optimizers: one per local stage"):
        pipe.state_dict(opts[:2])
    pipe.close()


async def test_one_optimizer_over_all_stages(tmp_path: Path) -> None:
    stages = make_mlp_stages(4)
    opt = torch.optim.AdamW([p for s in stages for p in s.parameters()], lr=1e-2)
    pipe = Pipeline(stages, mse_loss, microbatches=4, hint="1f1b", mode="strict")
    await _train(pipe, [opt], 2)
    checkpoint.save_checkpoint(tmp_path, pipe, opt)
    want, want_opt = _params(pipe), copy.deepcopy(opt.state_dict())
    stages2 = make_mlp_stages(4, seed=5)
    opt2 = torch.optim.AdamW([p for s in stages2 for p in s.parameters()], lr=1e-2)
    pipe2 = Pipeline(stages2, mse_loss, microbatches=4, hint="1f1b", mode="strict")
    with pytest.raises(CheckpointError, match="optimizers do not match"):
        checkpoint.load_checkpoint(tmp_path, pipe2, None)
    assert checkpoint.load_checkpoint(tmp_path, pipe2, opt2) == 2
    assert all(torch.equal(a, b) for a, b in zip(_params(pipe2), want))
    got = opt2.state_dict()["state"]
    assert all(torch.equal(got[k]["exp_avg"], v["exp_avg"]) for k, v in want_opt["state"].items())
    with pytest.raises(Exception, match="outside this pipeline"):
        checkpoint.save_checkpoint(tmp_path, pipe2, opt)
    pipe.close()
    pipe2.close()
