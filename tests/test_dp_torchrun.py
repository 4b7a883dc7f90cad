"""Pipeline x data parallel under torchrun (gloo, no MPI): the same script and the same checks
as tests/test_dp_mpi.py, with the grid split into torch.distributed groups and the gradients
averaged by TorchGradReducer. 3 SGD steps equal one unsplit model on the whole batch (float64)
in ready and strict modes, split and unsplit backward, with global clipping, token-weighted
loss and tied weights (the cross-stage sums over torch groups); the rest is heavy."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from conftest import run_torchrun
from test_dp_mpi import SCRIPT, check_exact, field, results_of, train_losses

pytestmark = pytest.mark.timeout(200)


def launch(n: int, tp: int, dp: int, cases: list[str], env: dict[str, str] | None = None
           ) -> dict[str, str]:
    proc: subprocess.CompletedProcess = run_torchrun(n, [SCRIPT, str(tp), str(dp), *cases],
                                                     timeout=180, env=env)
    return results_of(proc, cases)


def test_pp2_dp2_exact_under_torchrun() -> None:
    results = launch(4, 1, 2, ["1f1b:ready:1:clip,weight", "interleaved-1f1b:strict:0:tied",
                               "grid_errors"])
    check_exact(results)
    errors = results["grid_errors"]
    assert "torch.distributed_world_does_not_match" in field(errors, "error0"), errors
    assert "got_world_size_4" in field(errors, "error0"), errors
    assert "6_ranks_=_pp_3_x_tp_1_x_dp_2" in field(errors, "error0"), errors


@pytest.mark.heavy
def test_pp2_dp2_scaler_and_checkpoints_under_torchrun(tmp_path: Path) -> None:
    results = launch(4, 1, 2, ["1f1b:strict:0:scaler", "interleaved-1f1b:ready:1",
                               "zb-h1:ready:1:clip,tied", "ckpt"],
                     env={"DP_CKPT_DIR": str(tmp_path)})
    check_exact(results)
    ckpt = results["ckpt"]
    assert field(ckpt, "files") == "rank-00000-of-00002.pt,rank-00001-of-00002.pt", ckpt
    assert field(ckpt, "resumed") == "1", ckpt


@pytest.mark.heavy
def test_pp2_tp2_dp2_under_torchrun() -> None:
    check_exact(launch(8, 2, 2, ["1f1b:ready:1:clip,weight", "1f1b:strict:0"]))


@pytest.mark.heavy
def test_train_command_with_dp_under_torchrun_equals_one_pipeline(tmp_path: Path) -> None:
    """`torchrun -m aioready train --dp 2` with 4 microbatches per replica trains like one
    pipeline with the same 8 microbatches (float32 sums in another order)."""
    one = train_losses(2, tmp_path / "one.json", "--microbatches", "8", launch=run_torchrun,
                       timeout=150)
    dp = train_losses(4, tmp_path / "dp.json", "--microbatches", "4", "--dp", "2",
                      launch=run_torchrun, timeout=150)
    assert len(one) == len(dp) == 3 and one[-1] < one[0], (one, dp)
    assert max(abs(a - b) for a, b in zip(one, dp)) <= 1e-5, (one, dp)
