"""A diverged (NaN) loss is loud: gathered as NaN under MPI (NaN used to mean "no loss" there,
so the run showed "loss -"), written to --json as null with `diverged_at` (never a bare NaN that
strict parsers reject), warned about once, and with on_nan="stop" it ends the run."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import numpy as np
import pytest

from aioready.cli import main as cli_main
from aioready.cli.trainer import TrainConfig, train, write_outputs
from aioready.errors import ConfigError, DivergedError
from aioready.telemetry.gather import STEP_COLUMNS, merge_rows
from aioready.telemetry.spans import SPAN_COLUMNS

pytestmark = pytest.mark.timeout(60)
TINY = dict(stages=2, microbatches=2, steps=2, task_ms=0, batch=1, seq=4, dim=8, heads=1,
            vocab=16)


def _strict(text: str) -> object:
    def refuse(name: str) -> None:
        raise AssertionError(f"bare {name} in JSON")
    return json.loads(text, parse_constant=refuse)


def test_gathered_nan_loss_stays_nan() -> None:
    row = {"step": 0, "start": 0.0, "end": 1.0, "peak_in_flight": 1, "num_ranks": 2,
           "peak_activation_bytes": -1}
    rows = np.array([[{**row, "rank": 0, "loss": math.nan, "has_loss": 0}[c]
                      for c in STEP_COLUMNS],
                     [{**row, "rank": 1, "loss": math.nan, "has_loss": 1}[c]
                      for c in STEP_COLUMNS]], dtype=np.float64)
    [(report, loss)] = merge_rows(np.zeros((0, len(SPAN_COLUMNS))), rows)
    assert loss is not None and math.isnan(loss)
    rows[1, STEP_COLUMNS.index("has_loss")] = 0  # nobody has a loss: None
    assert merge_rows(np.zeros((0, len(SPAN_COLUMNS))), rows)[0][1] is None


def test_diverged_run_warns_and_writes_strict_json(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run.json"
    assert cli_main(["train", *_args(), "--lr", "1e30", "--steps", "3",
                     "--json", str(out)]) == 0
    err = capsys.readouterr().err
    summary = _strict(out.read_text())
    assert isinstance(summary, dict)
    first = summary["diverged_at"]
    assert first is not None and summary["loss"][first] is None, summary["loss"]
    assert err.count("the run diverged") == 1, err


def test_on_nan_stop_ends_the_run() -> None:
    with pytest.raises(DivergedError, match="the loss is nan: the run diverged"):
        asyncio.run(train(TrainConfig(**{**TINY, "steps": 3}, lr=1e30, on_nan="stop")))
    with pytest.raises(ConfigError, match="on_nan"):
        TrainConfig(on_nan="ignore")


def test_finite_run_has_no_divergence(tmp_path: Path) -> None:
    cfg = TrainConfig(**TINY)
    result = asyncio.run(train(cfg))
    assert result.diverged_at is None and all(math.isfinite(x) for x in result.losses)
    [path] = write_outputs(result, cfg, json_out=str(tmp_path / "ok.json"))
    assert _strict(path.read_text())["loss"] == result.losses  # type: ignore[index]


def _args() -> list[str]:
    return ["--stages", "2", "--microbatches", "2", "--task-ms", "0", "--batch", "1", "--seq",
            "4", "--dim", "8", "--no-progress"]
