"""The per-step, per-rank table: values a textbook schedule fixes, CSV and Parquet alike."""

from __future__ import annotations

import csv
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import aioready
from aioready.cli import main
from aioready.clock import run_virtual
from aioready.devices.sim import SimDevice
from aioready.errors import ConfigError
from aioready.tasks import Kind
from aioready.telemetry.step_table import STEP_TABLE_COLUMNS, step_table, write_step_table

S, M = 2, 3


def _reports() -> list[aioready.telemetry.StepReport]:
    async def go():  # type: ignore[no-untyped-def]
        pipe = aioready.Pipeline([None] * S, None, microbatches=M, mode="strict",
                                 device=SimDevice(lambda i: 1.0 if i.kind is Kind.F else 2.0,
                                                  run_compute=False))
        out = []
        for _ in range(2):
            await pipe.step()
            out.append(pipe.last_step)
        return out
    return run_virtual(go())


def test_rows_of_strict_1f1b_are_the_textbook_ones() -> None:
    rows = step_table(_reports())
    assert [(r["step"], r["rank"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in rows:
        assert r["step_time_s"] == (M + S - 1) * 3.0  # (M + S - 1)(F + B)
        assert r["efficiency"] == 1.0 and r["lower_bound_s"] == r["step_time_s"]
        assert r["busy_s"] == M * 3.0 and r["busy_fraction"] == pytest.approx(M / (M + S - 1))
        assert (r["num_tasks"], r["num_f"], r["num_b"], r["num_w"]) == (2 * M, M, M, 0)
        assert r["messages_sent"] == M  # rank 0 its activations, rank 1 its gradients
        total = r["busy_fraction"] + r["waiting_fraction"] + r["gated_fraction"] + \
            r["idle_fraction"]
        assert total == pytest.approx(1.0)
    # by hand (times 0..12): rank 0 runs F0 F1 | B0 F2 B1 | B2; F2 was ready from 0 but strict
    # order held it over 2-4 (gated), and 9-10 it waited for B2's gradient. Rank 1 waited 0-1
    # for F0's activation and was done at 10 (idle 10-12).
    r0, r1 = ((r["busy_fraction"], r["waiting_fraction"], r["gated_fraction"], r["idle_fraction"])
              for r in rows[:2])
    assert r0 == pytest.approx((9 / 12, 1 / 12, 2 / 12, 0.0))
    assert r1 == pytest.approx((9 / 12, 1 / 12, 0.0, 2 / 12))
    assert rows[2]["step_start_s"] == rows[0]["step_time_s"]


def test_csv_and_parquet_hold_the_same_rows(tmp_path: Path) -> None:
    reps = _reports()
    names = [c for c, _, _ in STEP_TABLE_COLUMNS]
    a = write_step_table(reps, tmp_path / "t.csv")
    b = write_step_table(reps, tmp_path / "t.parquet")
    with a.open() as fh:
        from_csv = list(csv.DictReader(fh))
    table = pq.read_table(b)
    assert table.column_names == names == list(from_csv[0])
    assert table.schema.field("busy_s").metadata[b"doc"].startswith(b"seconds")
    for got, want in zip(from_csv, table.to_pylist()):
        assert {k: float(v) for k, v in got.items()} == {k: float(v) for k, v in want.items()}
    with pytest.raises(ConfigError, match="unknown table type"):
        write_step_table(reps, tmp_path / "t.xlsx")


def test_train_writes_the_table(tmp_path: Path) -> None:
    out = tmp_path / "steps.parquet"
    assert main(["train", "--stages", "2", "--microbatches", "2", "--steps", "2", "--sleep-only",
                 "--task-ms", "1", "--no-progress", "--step-table", str(out)]) == 0
    assert pq.read_table(out).num_rows == 2 * 2
