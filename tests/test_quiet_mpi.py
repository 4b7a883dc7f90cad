"""The CPU device's quiet path over MPI with the engine's doorbells disarmed during a task on the
loop thread (`ProgressEngine.inline_task_begins`, docs/hot_path_measurements.md "The quiet path's
doorbells") and with that switched off: the same losses and gradients as the unsplit model."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import requires_mpi, run_mpi

SCRIPTS = Path(__file__).resolve().parent / "mpi_scripts"
TOL = 1e-10
CASES = ["1f1b:ready:1:1", "1f1b:strict:0:1"]

pytestmark = [pytest.mark.mpi, requires_mpi]


def _field(text: str, name: str) -> str:
    return text.split(f"{name}=")[1].split()[0]


def _exact_on_the_quiet_path(env: dict[str, str]) -> dict[str, str]:
    """Every case's RESULT line, each checked: loss seen, loss and gradients within TOL of the
    unsplit model, tasks run on the quiet path."""
    proc = run_mpi(2, [str(SCRIPTS / "exact.py"), *CASES], timeout=150, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = dict(line.split(" ", 2)[1:] for line in proc.stdout.splitlines()
                   if line.startswith("RESULT "))
    assert sorted(results) == sorted(CASES), proc.stdout
    for case in CASES:
        assert _field(results[case], "loss_seen") == "1", (case, results[case])
        assert float(_field(results[case], "loss_diff")) <= TOL, (case, results[case])
        assert float(_field(results[case], "grad_diff")) <= TOL, (case, results[case])
        assert int(_field(results[case], "quiet")) > 0, (case, results[case])
    return results


@pytest.mark.timeout(200)
@pytest.mark.parametrize("disarm", ["1", "0"], ids=["disarmed", "switch-off"])
def test_exact_over_mpi_with_the_quiet_paths_doorbells_disarmed_or_not(disarm: str) -> None:
    """No spin window, so a waiting rank parks on its doorbell and its next task starts inside
    that park (the case the disarming is for); the quiet path and the doorbells on."""
    env = {"AIOREADY_CPU_QUIET_INLINE": "1", "AIOREADY_MPI_FAST": "1", "AIOREADY_SPIN_US": "0",
           "AIOREADY_INLINE_DISARM": disarm}
    results = _exact_on_the_quiet_path(env)
    disarms = int(_field(results[CASES[-1]], "disarms"))  # counted from the launch's start
    assert (disarms > 0) if disarm == "1" else disarms == 0, results


@pytest.mark.timeout(200)
@pytest.mark.parametrize("hush,again", [("1", "1"), ("0", "0")], ids=["on", "switches-off"])
def test_exact_over_mpi_with_notices_hushed_and_probing_again_or_not(hush: str,
                                                                     again: str) -> None:
    """A peer's notice rings no rank whose loop computes (`AIOREADY_HUSH_NOTICES`), and a probe
    after a match looks twice (`AIOREADY_PROBE_AGAIN`): the same losses and gradients as the
    unsplit model, with each on and off; tasks of the reserving policy's 1F1B started inside a
    doorbell park were hushed only where the switch is on."""
    env = {"AIOREADY_CPU_QUIET_INLINE": "1", "AIOREADY_MPI_FAST": "1", "AIOREADY_SPIN_US": "0",
           "AIOREADY_INLINE_DISARM": "0", "AIOREADY_HUSH_NOTICES": hush,
           "AIOREADY_PROBE_AGAIN": again, "AIOREADY_NOTICE_BOARD": "0"}  # MPI notices
    results = _exact_on_the_quiet_path(env)
    hushes = int(_field(results[CASES[-1]], "hushes"))  # counted from the launch's start
    assert (hushes > 0) if hush == "1" else hushes == 0, results
