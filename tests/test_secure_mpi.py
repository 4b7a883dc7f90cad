"""SecureTransport over MPI (mpiexec -n 2): a sealed step is bit-identical to the plain one and
to the unsplit model; ranks holding different keys both stop with ProtocolError naming the
other; `aioready train` seals when AIOREADY_KEY_FILE names a private key file."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from conftest import requires_mpi, run_mpi

pytestmark = [pytest.mark.mpi, requires_mpi, pytest.mark.timeout(150)]
SCRIPT = Path(__file__).resolve().parent / "mpi_scripts" / "sealed.py"


def miskeyed(proc: subprocess.CompletedProcess) -> dict[str, str]:
    """rank -> what the mis-keyed run ended with, from a launch of SCRIPT (under either
    launcher) whose sealed step matched the plain one and the reference exactly."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "RESULT identical=True ref_diff=0.000e+00" in out, out[-3000:]
    seen = dict(re.findall(r"MISKEYED rank=(\d) (.*)", out))
    assert set(seen) == {"0", "1"}, out[-3000:]
    return seen


def test_sealed_step_is_exact_and_a_wrong_key_is_refused() -> None:
    proc = run_mpi(2, [str(SCRIPT)], timeout=120)
    seen = miskeyed(proc)
    # where the plain step's notices went on the notice board (-1: no board, switched off),
    # the sealed step's went on none: sealed Messages (a board would bypass the sealing)
    plain, sealed = (int(re.search(rf"board_{n}=(-?\d+)", proc.stdout).group(1))  # type: ignore
                     for n in ("plain", "sealed"))
    assert sealed == 0 and plain > 0 or sealed == plain == -1, proc.stdout
    for rank, other in (("0", "1"), ("1", "0")):
        assert "type=ProtocolError" in seen[rank], seen[rank]
        assert f"message from rank {other} failed authentication" in seen[rank], seen[rank]


@pytest.mark.heavy  # two more interpreters importing torch
def test_aioready_train_seals_with_the_key_file(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text(os.urandom(32).hex())
    key.chmod(0o600)
    args = ["-m", "aioready", "train", "--stages", "2", "--microbatches", "2", "--steps", "2",
            "--task-ms", "0", "--dim", "8", "--seq", "4", "--no-progress", "--mode", "strict"]
    sealed = run_mpi(2, [*args, "--json", str(tmp_path / "s.json")], timeout=120,
                     env={"AIOREADY_KEY_FILE": str(key)})
    assert sealed.returncode == 0, sealed.stderr[-3000:]
    plain = run_mpi(2, [*args, "--json", str(tmp_path / "p.json")], timeout=120)
    assert plain.returncode == 0, plain.stderr[-3000:]
    s, p = (json.loads((tmp_path / f"{n}.json").read_text()) for n in "sp")
    assert s["sealed"] and len(s["sealed"]) == 16 and p["sealed"] is None
    assert s["loss"] == p["loss"]  # sealing changes no bit of the computation
    key.chmod(0o644)
    bad = run_mpi(2, args, timeout=120, env={"AIOREADY_KEY_FILE": str(key)})
    assert bad.returncode != 0 and "readable by others" in bad.stdout + bad.stderr
