"""Faults under `mpiexec -n 4`: a rank killed, a rank that stops answering, an exception in
stage 2's forward. The job must end non-zero, saying why, at the faulty step; none may hang (each
launch has a timeout).

MPICH's mpiexec (hydra) kills the whole job itself as soon as a rank dies from a signal (even
with -disable-auto-cleanup), so for SIGKILL the user sees hydra's "BAD TERMINATION ... Killed
(signal 9)" report; the peer timeout is what catches a rank that is alive but silent (SIGSTOP
here, a hung driver in life). How fast each fault is detected is a measurement, not a test:
bench/faults writes it up in bench/results/faults.md.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import requires_mpi, run_mpi

SCRIPT = Path(__file__).resolve().parent / "mpi_scripts" / "peer_fault.py"
PEER_TIMEOUT = 3.0

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(200), requires_mpi]


def run_fault(fault: str, victim: int = 2, step: int = 1) -> tuple[int, str]:
    """Run the job (a hang fails at the launch timeout); return (exit code, output). The job
    ends at the faulty step: the step before it completed, the faulty one never did."""
    proc = run_mpi(4, [str(SCRIPT), fault, str(victim), str(step)], timeout=180,
                   env={"AIOREADY_PEER_TIMEOUT": str(PEER_TIMEOUT)})
    out = proc.stdout + proc.stderr
    assert re.search(r"FAULT rank=\d+ t=([\d.]+)", out), out[-3000:]
    assert f"STEP {step - 1} done" in out and f"STEP {step} done" not in out, out[-3000:]
    return proc.returncode, out


def detected(out: str) -> dict[int, tuple[float, str, str]]:
    return {int(m.group(1)): (float(m.group(2)), m.group(3), m.group(4))
            for m in re.finditer(r"DETECTED rank=(\d+) t=([\d.]+) type=(\w+) msg=(.*)", out)}


def test_sigkill_ends_the_job() -> None:
    rc, out = run_fault("kill")
    assert rc != 0
    assert "Killed (signal 9)" in out, out[-3000:]


def test_exception_in_stage2_forward_ends_the_job_with_its_message() -> None:
    rc, out = run_fault("raise")
    assert rc != 0
    want = "forward of stage 2 raised ValueError: injected failure in stage 2's forward"
    assert "rank 2 of 4 on " in out and want in out, out[-3000:]
    # Which ranks print DETECTED before the first MPI_Abort ends the job is a race (an abort
    # kills the others mid-step), so every line that made it out is checked, and one must have.
    seen = detected(out)
    assert seen, out[-3000:]
    for rank, (t, kind, msg) in seen.items():
        assert kind == "StageError" and want in msg, msg
        assert "sent nothing" not in msg  # by the broadcast, not by the peer timeout
    # the peers name rank 2 from the source MPI reported for its broadcast; rank 2 names no one
    peer = {int(m.group(1)): (m.group(2), m.group(3))
            for m in re.finditer(r"PEER rank=(\d+) lost=(\w+) remote=(\w+)", out)}
    assert set(peer) == set(seen), out[-3000:]
    assert all(peer[r] == (("None", "False") if r == 2 else ("2", "True")) for r in seen), peer


@pytest.mark.heavy  # ~10 s more of make test; the in-process twin is tests/test_faults.py
def test_silent_rank_is_declared_lost() -> None:
    rc, out = run_fault("stop")
    assert rc != 0
    seen = detected(out)
    direct = {r: v for r, v in seen.items()
              if re.match(rf"rank {r}, step 1, task [FB]\d+: peer rank 2 of 4 sent nothing", v[2])}
    assert direct, out[-3000:]  # the ranks that wait on rank 2 say so themselves
    for rank, (t, kind, msg) in seen.items():
        assert kind == "PeerLostError" and "peer rank 2 of 4 sent nothing" in msg, msg


STOP_SCRIPT = Path(__file__).resolve().parent / "mpi_scripts" / "train_stop.py"


@pytest.mark.parametrize("where", ["barrier", pytest.param("checkpoint", marks=pytest.mark.heavy),
                                   pytest.param("gather", marks=pytest.mark.heavy)])
def test_rank_stopped_outside_a_step_ends_the_job(where: str, tmp_path: Path) -> None:
    """A rank stopped in the start barrier, its checkpoint write or the report gather of
    `aioready train`'s loop: its peer names it with PeerLostError within the peer timeout and
    the job ends (it used to wait forever: the timeouts were armed only inside pipe.step)."""
    proc = run_mpi(2, [str(STOP_SCRIPT), where, "1", "1", str(tmp_path)], timeout=100,
                   env={"AIOREADY_PEER_TIMEOUT": "2"})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert f"STOPPING rank=1 where={where}" in out, out[-3000:]
    assert "FINISHED" not in out, out[-3000:]
    found = re.search(r"DETECTED rank=0 type=(\w+) lost=(\w+) msg=(.*)", out)
    assert found, out[-3000:]
    kind, lost, msg = found.groups()
    assert (kind, lost) == ("PeerLostError", "1"), msg
    during = {"barrier": "the start barrier", "checkpoint": "the report gather of step 1",
              "gather": "the report gather of step 1"}[where]
    assert "peer rank 1 of 2 sent nothing" in msg and f"during {during}" in msg, msg
