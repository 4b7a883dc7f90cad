"""examples/hf_pipeline.py, short: a `transformers` Llama decoder over 2 MPI ranks (V placement:
4 stages, ZBV with split backward, recompute, AdamW) follows the one-process loss curve step by
step. (2 ranks, not the README's 4: each rank's import of torch and transformers is most of the
launch; the placement, schedule and split are the same.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import requires_mpi, run_mpi

pytestmark = [pytest.mark.mpi, requires_mpi]
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hf_pipeline.py"


@pytest.mark.timeout(200)
def test_example_loss_curve_matches_one_process_training() -> None:
    pytest.importorskip("transformers")
    proc = run_mpi(2, [str(EXAMPLE), "--steps", "3", "--batch", "8", "--seq", "16",
                       "--compare"], timeout=180, env={"HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    curve = re.findall(r"curve step +\d+ +pipeline (\S+) +one-process (\S+)", proc.stdout)
    assert len(curve) == 3, proc.stdout
    for pipeline, single in curve:
        assert abs(float(pipeline) - float(single)) <= 1e-10, curve
    assert float(curve[-1][1]) < float(curve[0][1])  # it trains
    assert "(ok)" in proc.stdout
