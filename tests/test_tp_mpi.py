"""TP x PP under mpiexec: exactness in both modes, and a clear error without coordination.

Each case runs examples/tp_mlp.py in a child `mpiexec` with a timeout; ranks get different random
per-task delays, so uncoordinated members would pick different tasks.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from conftest import requires_mpi, run_mpi

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "tp_mlp.py"

pytestmark = [pytest.mark.mpi, requires_mpi]


def launch(n: int, *args: str, timeout: float = 150) -> subprocess.CompletedProcess[str]:
    return run_mpi(n, [str(SCRIPT), *args], timeout=timeout, env={"OMP_NUM_THREADS": "1"})


def result(proc: subprocess.CompletedProcess[str]) -> dict:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert len(lines) == 1, proc.stdout[-3000:]
    return json.loads(lines[0][len("RESULT "):])


def check_exact(res: dict, *, steps: int, microbatches: int, split: bool = False) -> None:
    tasks_per_rank = steps * microbatches * (3 if split else 2)
    followers = res["world"] - res["pp"]
    for mode, runs in res["runs"].items():
        (run,) = runs
        assert run["grad_diff"] <= 1e-10, (mode, run["grad_diff"])
        assert run["loss_diff"] <= 1e-10, (mode, run["loss_diff"])
        assert run["orders_equal"], mode
        assert run["num_tasks"] == res["world"] * tasks_per_rank
        assert run["num_collectives"] > 0
        expected = followers * tasks_per_rank if mode == "ready" else 0
        assert run["decision_messages"] == run["decisions_received"] == expected, mode


def test_pp2_tp2_exact_in_both_modes_with_uneven_members():
    res = result(launch(4, "--tp", "2", "--mode", "ready,strict", "--steps", "2",
                        "--microbatches", "4", "--cap", "4", "--jitter-ms", "4",
                        "--straggler-ms", "10", "--verify", "inline"))
    assert (res["pp"], res["tp"]) == (2, 2)
    check_exact(res, steps=2, microbatches=4)


def test_without_coordination_the_mismatch_is_detected_not_a_hang():
    proc = launch(4, "--tp", "2", "--mode", "ready", "--no-coordinate", "--steps", "3",
                  "--microbatches", "8", "--cap", "8", "--jitter-ms", "10", "--straggler-ms",
                  "60", "--timeout", "15", "--no-check", timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "CoordinationError" in out, out[-3000:]
    assert "different collectives" in out or "did not complete" in out, out[-3000:]
    assert "RESULT" not in proc.stdout


@pytest.mark.heavy
def test_pp4_tp2_and_pp2_tp4_exact_split_backward():
    res = result(launch(8, "--tp", "2", "--mode", "ready,strict", "--steps", "1",
                        "--microbatches", "4", "--split", "--jitter-ms", "2", timeout=400))
    assert (res["pp"], res["tp"]) == (4, 2)
    check_exact(res, steps=1, microbatches=4, split=True)
    res = result(launch(8, "--tp", "4", "--mode", "ready,strict", "--steps", "1",
                        "--microbatches", "4", "--jitter-ms", "2", timeout=400))
    assert (res["pp"], res["tp"]) == (2, 4)
    check_exact(res, steps=1, microbatches=4)
