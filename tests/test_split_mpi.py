"""`aioready.split` stages over MPI (2 ranks): a dict boundary (the hidden state with the model's
context) crosses ranks without pickle, the context travels once per rank under V placement, and
loss and gradients equal the unsplit model's in float64. One launch runs every case."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import requires_mpi, run_mpi

pytestmark = [pytest.mark.mpi, requires_mpi]
SCRIPT = Path(__file__).resolve().parent / "mpi_scripts" / "split_exact.py"
TOL = 1e-10
CASES = ["gpt:v:zbv:1:1", "llama:linear:1f1b:0:0", "llama:v:zbv:1:0",
         "llama:linear:zb-h1:1:1"]


@pytest.mark.timeout(200)
def test_split_stages_train_exactly_over_mpi() -> None:
    pytest.importorskip("transformers")
    proc = run_mpi(2, [str(SCRIPT), *CASES], timeout=180, env={"HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = dict(re.findall(r"^RESULT (\S+) (.*)$", proc.stdout, re.MULTILINE))
    assert sorted(results) == sorted(CASES), proc.stdout
    for case, text in results.items():
        fields = dict(re.findall(r"(\w+)=(\S+)", text))
        assert fields["loss_seen"] == "1" and fields["missing"] == "0", (case, text)
        assert float(fields["loss_diff"]) <= TOL, (case, text)
        assert float(fields["grad_diff"]) <= TOL, (case, text)
