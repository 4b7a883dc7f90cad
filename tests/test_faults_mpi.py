"""Faults under `mpiexec -n 4`: a rank killed, a rank that stops answering, an exception in
stage 2's forward. The job must end non-zero, saying why, within the bound; none may hang.

MPICH's mpiexec (hydra) kills the whole job itself as soon as a rank dies from a signal (even
with -disable-auto-cleanup), so for SIGKILL the user sees hydra's "BAD TERMINATION ... Killed
(signal 9)" report; the peer timeout is what catches a rank that is alive but silent (SIGSTOP
here, a hung driver in life). Detection times measured here are written up in
bench/results/faults.md.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "mpi_scripts" / "peer_fault.py"
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
PEER_TIMEOUT = 3.0

try:
    import mpi4py  # noqa: F401
    HAVE_MPI4PY = True
except ImportError:
    HAVE_MPI4PY = False

pytestmark = [
    pytest.mark.mpi, pytest.mark.timeout(200),
    pytest.mark.skipif(MPIEXEC is None or not HAVE_MPI4PY,
                       reason="needs mpi4py and mpiexec (pip install 'aioready[mpi]')"),
]


def run_fault(fault: str, victim: int = 2, step: int = 1) -> tuple[int, str, float]:
    """Run the job; return (exit code, output, seconds from the fault to the job's end)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1",
               AIOREADY_PEER_TIMEOUT=str(PEER_TIMEOUT))
    cmd = [MPIEXEC, "-n", "4", sys.executable, str(SCRIPT), fault, str(victim), str(step)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    end = time.time()
    out = proc.stdout + proc.stderr
    found = re.search(r"FAULT rank=\d+ t=([\d.]+)", out)
    assert found, out[-3000:]
    return proc.returncode, out, end - float(found.group(1))


def detected(out: str) -> dict[int, tuple[float, str, str]]:
    return {int(m.group(1)): (float(m.group(2)), m.group(3), m.group(4))
            for m in re.finditer(r"DETECTED rank=(\d+) t=([\d.]+) type=(\w+) msg=(.*)", out)}


def test_sigkill_ends_the_job() -> None:
    rc, out, took = run_fault("kill")
    assert rc != 0
    assert "Killed (signal 9)" in out, out[-3000:]
    assert took < 30.0  # the documented bound; hydra takes well under a second


def test_exception_in_stage2_forward_ends_the_job_with_its_message() -> None:
    rc, out, took = run_fault("raise")
    assert rc != 0
    want = "forward of stage 2 raised ValueError: injected failure in stage 2's forward"
    assert f"rank 2 of 4 on " in out and want in out, out[-3000:]
    fault_t = float(re.search(r"FAULT rank=2 t=([\d.]+)", out).group(1))  # type: ignore[union-attr]
    seen = detected(out)
    assert 2 in seen and seen[2][1] == "StageError"
    for rank, (t, kind, msg) in seen.items():
        assert kind == "StageError" and want in msg, msg
        assert t - fault_t < PEER_TIMEOUT  # by the broadcast, not by a timeout
    # the peers name rank 2 from the source MPI reported for its broadcast
    peer = {int(m.group(1)): (m.group(2), m.group(3))
            for m in re.finditer(r"PEER rank=(\d+) lost=(\w+) remote=(\w+)", out)}
    assert peer[2] == ("None", "False")
    assert all(peer[r] == ("2", "True") for r in seen if r != 2), peer
    assert took < 30.0


@pytest.mark.heavy  # ~10 s more of make test; the in-process twin is tests/test_faults.py
def test_silent_rank_is_declared_lost() -> None:
    rc, out, took = run_fault("stop")
    assert rc != 0
    fault_t = float(re.search(r"FAULT rank=2 t=([\d.]+)", out).group(1))  # type: ignore[union-attr]
    seen = detected(out)
    direct = {r: v for r, v in seen.items()
              if re.match(rf"rank {r}, step 1, task [FB]\d+: peer rank 2 of 4 sent nothing", v[2])}
    assert direct, out[-3000:]  # the ranks that wait on rank 2 say so themselves
    for rank, (t, kind, msg) in seen.items():
        assert kind == "PeerLostError" and "peer rank 2 of 4 sent nothing" in msg, msg
        assert PEER_TIMEOUT * 0.9 <= t - fault_t <= PEER_TIMEOUT * 1.25 + 5.0, t - fault_t
    assert took < 30.0
