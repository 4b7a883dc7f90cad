"""Pipeline x data parallel under mpiexec: 3 SGD steps equal one unsplit model on the whole
batch (float64), in ready and strict modes, split and unsplit backward, with random per-rank
delays after every task (tests/mpi_scripts/dp.py), and so do global clipping, token-weighted
loss, tied weights, ZeRO-1 (AdamW state sharded over replicas) and a GradScaler whose injected
inf on one rank makes every rank skip; the grid's errors name the world size. One launch runs several cases (MPI start and torch import
dominate); the rest of the matrix and 8 ranks (PP x TP x DP) are heavy."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any, Callable

import pytest
from conftest import requires_mpi, run_mpi

SCRIPT = str(Path(__file__).resolve().parent / "mpi_scripts" / "dp.py")
TOL = 1e-10
STEPS = 3

pytestmark = [pytest.mark.mpi, requires_mpi]


def launch(n: int, tp: int, dp: int, cases: list[str], env: dict[str, str] | None = None
           ) -> dict[str, str]:
    proc: subprocess.CompletedProcess = run_mpi(n, [SCRIPT, str(tp), str(dp), *cases],
                                                timeout=100, env=env)
    return results_of(proc, cases)


def results_of(proc: subprocess.CompletedProcess, cases: list[str]) -> dict[str, str]:
    """case -> its RESULT line of a launch of SCRIPT, which must have succeeded for every case
    (the MPI and the torchrun launches print the same lines)."""
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            _, case, rest = line.split(" ", 2)
            results[case] = rest
    assert sorted(results) == sorted(cases), proc.stdout + proc.stderr[-2000:]
    return results


def field(text: str, name: str) -> str:
    match = re.search(rf"{name}=(\S+)", text)
    assert match, f"no {name} in {text!r}"
    return match.group(1)


def check_exact(results: dict[str, str]) -> None:
    for case, text in results.items():
        if case in ("grid_errors", "ckpt"):
            continue
        skipped = 1 if case.endswith("scaler") else 0  # the step with the injected inf
        assert float(field(text, "loss_diff")) <= TOL, (case, text)
        assert float(field(text, "grad_diff")) <= TOL, (case, text)
        assert float(field(text, "norm_diff")) <= TOL, (case, text)
        assert int(field(text, "loss_seen")) == STEPS - skipped, (case, text)
        assert field(text, "skipped_min") == field(text, "skipped_max") == str(skipped), text
        if "clip" in case:
            assert float(field(text, "norm_min")) > 0.05, (case, text)  # the clip was active
        if "zero" in case:  # AdamW's state sharded over the 2 replicas
            assert 0.45 <= float(field(text, "zero_state")) <= 0.5 + 1e-3, (case, text)
        chunks = 2 if case.startswith("interleaved") else 1
        assert int(field(text, "reductions")) == STEPS * chunks, (case, text)
        if chunks == 2:  # chunk 1's reduction started while chunk 0 still had backward work
            assert int(field(text, "overlapped")) >= STEPS, (case, text)


@pytest.mark.timeout(120)
def test_pp2_dp2_modes_splits_and_cross_stage_reductions(tmp_path: Path) -> None:
    results = launch(4, 1, 2, ["1f1b:ready:1:clip,weight", "interleaved-1f1b:strict:0:tied",
                               "interleaved-1f1b:ready:1:zero", "1f1b:strict:0:scaler",
                               "grid_errors", "ckpt"], env={"DP_CKPT_DIR": str(tmp_path)})
    check_exact(results)
    ckpt = results["ckpt"]
    assert field(ckpt, "files") == "rank-00000-of-00002.pt,rank-00001-of-00002.pt", ckpt
    assert field(ckpt, "resumed") == "1", ckpt
    refused = field(ckpt, "refused")
    assert "process_grid" in refused and "pp_4_x_tp_1_x_dp_1" in refused, ckpt
    assert "pp_2_x_tp_1_x_dp_2" in refused, ckpt
    errors = results["grid_errors"]
    assert "got_world_size_4" in field(errors, "error0"), errors
    assert "6_ranks_=_pp_3_x_tp_1_x_dp_2" in field(errors, "error0"), errors
    assert "divisible_by_tp*dp_=_1*3" in field(errors, "error1"), errors


@pytest.mark.heavy
@pytest.mark.timeout(200)
def test_pp2_dp2_rest_of_the_matrix() -> None:
    check_exact(launch(4, 1, 2, ["1f1b:ready:0", "1f1b:strict:1", "interleaved-1f1b:ready:1",
                                 "interleaved-1f1b:strict:1:zero,clip",
                                 "zb-h1:ready:1:clip,tied", "interleaved-1f1b:ready:0:weight",
                                 "1f1b:ready:1:scaler"]))


@pytest.mark.heavy
@pytest.mark.timeout(200)
def test_pp2_tp2_dp2() -> None:
    check_exact(launch(8, 2, 2, ["1f1b:ready:1:clip,weight", "1f1b:strict:0:scaler"]))


def train_losses(n: int, out: Path, *args: str, launch: Callable[..., Any] = run_mpi,
                 timeout: float = 100) -> list[float]:
    """The losses of `aioready train` on `n` ranks started by `launch` (run_mpi or
    run_torchrun)."""
    proc = launch(n, ["-m", "aioready", "train", "--stages", "2", "--steps", "3",
                      "--task-ms", "0", "--no-progress", "--json", str(out), *args],
                  timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json
    summary = json.loads(out.read_text())
    assert summary["ranks"] == n, summary
    return summary["loss"]  # type: ignore[no-any-return]


@pytest.mark.timeout(200)
def test_train_command_with_dp_equals_one_pipeline(tmp_path: Path) -> None:
    """`aioready train --dp 2` with 4 microbatches per replica trains like one pipeline with
    the same 8 microbatches (same data, same AdamW steps; float32 sums in another order)."""
    one = train_losses(2, tmp_path / "one.json", "--microbatches", "8")
    dp = train_losses(4, tmp_path / "dp.json", "--microbatches", "4", "--dp", "2")
    assert len(one) == len(dp) == 3 and one[-1] < one[0], (one, dp)
    assert max(abs(a - b) for a, b in zip(one, dp)) <= 1e-5, (one, dp)


@pytest.mark.heavy
@pytest.mark.timeout(200)
def test_train_command_with_tp_equals_one_pipeline(tmp_path: Path) -> None:
    """`aioready train --tp 2` (each block's MLP split over 2 ranks) trains like no TP."""
    one = train_losses(2, tmp_path / "one.json", "--microbatches", "4")
    tp = train_losses(4, tmp_path / "tp.json", "--microbatches", "4", "--tp", "2")
    assert max(abs(a - b) for a, b in zip(one, tp)) <= 1e-5, (one, tp)
