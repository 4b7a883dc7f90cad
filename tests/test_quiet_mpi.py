"""The CPU device's quiet path over MPI with the engine's doorbells disarmed during a task on the
loop thread (`ProgressEngine.inline_task_begins`, docs/hot_path_measurements.md "The quiet path's
doorbells") and with that switched off: the same losses and gradients as the unsplit model."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import EXACT_2, requires_mpi, switched

SCRIPTS = Path(__file__).resolve().parent / "mpi_scripts"
TOL = 1e-10
CASES = ["1f1b:ready:1:1", "1f1b:strict:0:1"]

pytestmark = [pytest.mark.mpi, requires_mpi]


def _field(text: str, name: str) -> str:
    return text.split(f"{name}=")[1].split()[0]


QUIET = {"AIOREADY_CPU_QUIET_INLINE": "1", "AIOREADY_MPI_FAST": "1", "AIOREADY_SPIN_US": "0"}
# each variant's switches on top of QUIET: no spin window, so a waiting rank parks on its
# doorbell and its next task starts inside that park (the case disarming and hushing are for)
VARIANTS = {
    "disarmed": {"AIOREADY_INLINE_DISARM": "1"},
    "not-disarmed": {"AIOREADY_INLINE_DISARM": "0"},
    "hushed": {"AIOREADY_INLINE_DISARM": "0", "AIOREADY_HUSH_NOTICES": "1",
               "AIOREADY_PROBE_AGAIN": "1", "AIOREADY_NOTICE_BOARD": "0"},  # MPI notices
    "not-hushed": {"AIOREADY_INLINE_DISARM": "0", "AIOREADY_HUSH_NOTICES": "0",
                   "AIOREADY_PROBE_AGAIN": "0", "AIOREADY_NOTICE_BOARD": "0"},
}


TOKENS = {v: EXACT_2.need(*switched({**QUIET, **VARIANTS[v]}, *CASES)) for v in VARIANTS}


@pytest.fixture(scope="module")
def quiet_results() -> dict[str, dict[str, str]]:
    """Every variant's cases (the launch tests/test_mpi.py and others share), each in its own
    event loop with its switches set: {variant: {case: RESULT line}}, each checked: loss seen,
    loss and gradients within TOL of the unsplit model, tasks run on the quiet path."""
    results = {}
    for variant, tokens in TOKENS.items():
        lines = EXACT_2.results(tokens)
        results[variant] = {case: lines[token] for case, token in zip(CASES, tokens)}
    for variant, by_case in results.items():
        for case, line in by_case.items():
            assert _field(line, "loss_seen") == "1", (variant, case, line)
            assert float(_field(line, "loss_diff")) <= TOL, (variant, case, line)
            assert float(_field(line, "grad_diff")) <= TOL, (variant, case, line)
            assert int(_field(line, "quiet")) > 0, (variant, case, line)
    return results


def _count(by_case: dict[str, str], name: str) -> int:
    """A counter summed over the cases (each case's event loop counts from its start)."""
    return sum(int(_field(line, name)) for line in by_case.values())


@pytest.mark.timeout(300)
def test_exact_over_mpi_with_the_quiet_paths_doorbells_disarmed_or_not(
        quiet_results: dict[str, dict[str, str]]) -> None:
    """The engine's doorbells disarmed during a task on the loop thread
    (`AIOREADY_INLINE_DISARM`) and not: exact either way, and disarmed only where it is on."""
    assert _count(quiet_results["disarmed"], "disarms") > 0, quiet_results["disarmed"]
    assert _count(quiet_results["not-disarmed"], "disarms") == 0, quiet_results["not-disarmed"]


@pytest.mark.timeout(300)
def test_exact_over_mpi_with_notices_hushed_and_probing_again_or_not(
        quiet_results: dict[str, dict[str, str]]) -> None:
    """A peer's notice rings no rank whose loop computes (`AIOREADY_HUSH_NOTICES`), and a probe
    after a match looks twice (`AIOREADY_PROBE_AGAIN`): the same losses and gradients as the
    unsplit model, with each on and off; tasks of the reserving policy's 1F1B started inside a
    doorbell park were hushed only where the switch is on."""
    assert _count(quiet_results["hushed"], "hushes") > 0, quiet_results["hushed"]
    assert _count(quiet_results["not-hushed"], "hushes") == 0, quiet_results["not-hushed"]
