"""The notice board over MPI (aioready/transports/notice_board.py, docs/hot_path.md "Notices
through a shared-memory board"): the reserving 1F1B and the draining 1F1B with split backward
over two ranks equal the unsplit model with the board on (every notice posted on it, then read
where the forecast is consulted or dropped at its step's end, none sent as an MPI message: the
rings of two ranks never fill in a step of four microbatches) and off (`AIOREADY_NOTICE_BOARD=0`:
every notice an MPI message, the board unused)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import EXACT_2, requires_mpi, run_mpi, switched

SCRIPTS = Path(__file__).resolve().parent / "mpi_scripts"
TOL = 1e-10
CASES = ["1f1b:ready:0:0", "1f1b:ready:1:1:drain"]

pytestmark = [pytest.mark.mpi, requires_mpi]
TOKENS = {board: EXACT_2.need(*switched({"AIOREADY_MPI_FAST": "1", "AIOREADY_MPI_NATIVE": "1",
                                         "AIOREADY_NOTICE_BOARD": board}, *CASES))
          for board in ("1", "0")}


def _field(text: str, name: str) -> int | float:
    match = re.search(rf"\b{name}=(\S+)", text)
    assert match, f"no {name} in {text!r}"
    return float(match.group(1))


@pytest.mark.timeout(200)
@pytest.mark.parametrize("board", ["1", "0"], ids=["board", "switch-off"])
def test_exact_over_mpi_with_notices_on_the_board_or_not(board: str) -> None:
    results = EXACT_2.results(TOKENS[board])  # one launch other modules share
    for case, token in zip(CASES, TOKENS[board]):
        result = results[token]
        assert _field(result, "loss_seen") == 1, (case, result)
        assert _field(result, "loss_diff") <= TOL, (case, result)
        assert _field(result, "grad_diff") <= TOL, (case, result)
        posted, read, skipped, mpi = (_field(result, f) for f in (
            "board", "board_read", "board_skipped", "heads"))
        if board == "1":  # each record read where the forecast was consulted, else dropped
            assert posted > 0 and read + skipped == posted and mpi == 0, (case, result)
        else:
            assert posted == read == skipped == 0 and mpi > 0, (case, result)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("variable", ["AIOREADY_NOTICE_BOARD", "AIOREADY_MPI_FAST"])
def test_a_switch_set_differently_on_two_ranks_is_a_config_error_on_both_not_a_hang(
        variable: str) -> None:
    proc = run_mpi(2, [str(SCRIPTS / "switches.py"), variable], timeout=90,
                   env={"AIOREADY_MPI_FAST": "1", "AIOREADY_NOTICE_BOARD": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    assert [line.split(" ", 3)[1:3] for line in lines] == [["0", "ConfigError"],
                                                            ["1", "ConfigError"]], proc.stdout
    for line in lines:
        assert variable in line and "differs between ranks" in line, line
    assert "=on" in lines[0] and "=off" in lines[1], lines
