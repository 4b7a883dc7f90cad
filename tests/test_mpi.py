"""MPITransport under mpiexec: exactness against the unsplit model, variable shapes, out-of-order
arrival, and bad messages ending the job. Each launch runs several cases (one torch import)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from conftest import EXACT_2, requires_mpi, run_mpi, switched

from aioready.schedulers import HINTS

SCRIPTS = Path(__file__).resolve().parent / "mpi_scripts"
TOL = 1e-10

pytestmark = [pytest.mark.mpi, requires_mpi]


def launch(n: int, script: str, *args: str, timeout: float = 100) -> subprocess.CompletedProcess:
    return run_mpi(n, [str(SCRIPTS / script), *args], timeout=timeout)


def cases(num_ranks: int) -> list[str]:
    """hint:mode:split:varlen for every registered hint that fits `num_ranks` ranks.

    4 ranks: every mode x split; 2 ranks (which also runs the extra cases): ready with split
    backward and strict without, all with variable sequence lengths.
    """
    out = []
    for name in sorted(HINTS):
        spec = HINTS[name]
        splits = [0, 1] if spec.needs_split is None else [int(spec.needs_split)]
        for mode in ("ready", "strict"):
            for split in splits:
                if num_ranks == 2 and len(splits) == 2 and split != (mode == "ready"):
                    continue
                varlen = int(num_ranks == 2 or (mode == "ready") == bool(split))
                out.append(f"{name}:{mode}:{split}:{varlen}")
    return out


EXTRA = ["ooo", "dtypes"]
_RUNS: dict[int, tuple[subprocess.CompletedProcess, dict[str, str]]] = {}


def run_cases(n: int) -> tuple[subprocess.CompletedProcess, dict[str, str]]:
    """Every case on `n` ranks: on 2, in the launch other modules share (conftest.SharedLaunch)."""
    if n not in _RUNS:
        if n == 2:
            _RUNS[n] = (subprocess.CompletedProcess([], 0, "", ""),
                        EXACT_2.results(cases(2) + EXTRA))
        else:
            proc = launch(n, "exact.py", *cases(n))
            results = {}
            for line in proc.stdout.splitlines():
                if line.startswith("RESULT "):
                    _, case, rest = line.split(" ", 2)
                    results[case] = rest
            _RUNS[n] = (proc, results)
    return _RUNS[n]


EXACT_2.need(*cases(2), *EXTRA)


def _field(text: str, name: str) -> str:
    match = re.search(rf"{name}=(\S+)", text)
    assert match, f"no {name} in {text!r}"
    return match.group(1)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("n", [2, 4])
def test_pipeline_exact_over_mpi(n: int) -> None:
    """Loss and every gradient equal the unsplit model's, for every hint, mode, split, shape."""
    proc, results = run_cases(n)
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = cases(n)
    assert sorted(results) == sorted(expected + (EXTRA if n == 2 else [])), proc.stdout
    for case in expected:
        text = results[case]
        assert _field(text, "loss_seen") == "1", (case, text)
        assert float(_field(text, "loss_diff")) <= TOL, (case, text)
        assert float(_field(text, "grad_diff")) <= TOL, (case, text)


FAST_CASES = ["1f1b:ready:1:1", "1f1b:strict:0:1", "interleaved-1f1b:ready:0:1", "dtypes",
              "plans"]


FAST_OFF = {"AIOREADY_MPI_FAST": "0", "AIOREADY_CPU_QUIET_INLINE": "0"}
FAST_OFF_TOKENS = EXACT_2.need(*switched(FAST_OFF, *FAST_CASES))


@pytest.mark.timeout(200)
@pytest.mark.parametrize("env", [FAST_OFF,
                                 {"AIOREADY_MPI_FAST": "1", "AIOREADY_CPU_INLINE_US": "1e7",
                                  "AIOREADY_BUSY_SLEEP": "1", "AIOREADY_MPI_ZERO_COPY": "16",
                                  "AIOREADY_CPU_QUIET_INLINE": "1"}],
                         ids=["fast-paths-off", "fast-paths-on"])
def test_exact_over_mpi_with_fast_paths_on_and_off(env: dict[str, str]) -> None:
    """The hot path's fast paths (docs/hot_path.md) off, and all on (the CPU device's tiny-task
    path, its compute on the loop thread when nothing else needs it, and the engine sleeping
    through tasks included, and every inline payload of 16 bytes or more sent from its
    tensor's memory): the same losses, gradients and payloads as the unsplit model. Off runs in
    the launch other modules share; on needs its own (the zero-copy size is read at import)."""
    if env is FAST_OFF:
        lines = EXACT_2.results(FAST_OFF_TOKENS)
        results = {case: lines[token] for case, token in zip(FAST_CASES, FAST_OFF_TOKENS)}
    else:
        proc = run_mpi(2, [str(SCRIPTS / "exact.py"), *FAST_CASES], timeout=150, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results = dict(line.split(" ", 2)[1:] for line in proc.stdout.splitlines()
                       if line.startswith("RESULT "))
    assert sorted(results) == sorted(FAST_CASES), results
    for case in FAST_CASES[:-2]:
        assert _field(results[case], "loss_seen") == "1", (case, results[case])
        assert float(_field(results[case], "loss_diff")) <= TOL, (case, results[case])
        assert float(_field(results[case], "grad_diff")) <= TOL, (case, results[case])
        # the CPU device's quiet path computed on the loop thread only where it was on
        quiet = int(_field(results[case], "quiet"))
        assert (quiet > 0) if env["AIOREADY_CPU_QUIET_INLINE"] == "1" else quiet == 0, case
    assert _field(results["dtypes"], "bad") == "0", results["dtypes"]
    assert _field(results["plans"], "bad") == "0", results["plans"]
    # the receive plans (wire_plans.py) took lone tensors with the fast paths on, none off
    taken = int(_field(results["plans"], "taken"))
    assert (taken > 0) if env["AIOREADY_MPI_FAST"] == "1" else taken == 0, results["plans"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fast,ring_poll", [("1", "1"), ("1", "0"), ("0", "1")],
                         ids=["doorbell", "doorbell-no-ring-poll", "no-doorbell"])
def test_parked_rank_is_woken_by_the_doorbell(fast: str, ring_poll: str) -> None:
    """A waiting rank parks on its doorbell and each message rings it (transports/doorbell.py);
    the ring's callback delivers the message (`AIOREADY_RING_POLL`, on by default); with the
    fast paths off it parks on its timer alone. Either way every message arrives."""
    proc = run_mpi(2, [str(SCRIPTS / "doorbell.py")], timeout=100,
                   env={"AIOREADY_MPI_FAST": fast, "AIOREADY_RING_POLL": ring_poll})
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    assert _field(line, "got") == "10,11,12", line
    if fast == "1":
        assert int(_field(line, "doorbell_parks")) >= 3, line
        assert int(_field(line, "rung")) >= 1, line
        polled = int(_field(line, "ring_polls"))
        assert polled >= 1 if ring_poll == "1" else polled == 0, line
    else:
        assert _field(line, "doorbell_parks") == "0", line
        assert _field(line, "rung") == "0", line


@pytest.mark.timeout(200)
def test_out_of_order_arrival_runs_first_arrival_first() -> None:
    """The sender sends microbatch 3 first: the receiver, in ready mode, runs F3 first."""
    proc, results = run_cases(2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = results["ooo"]
    order = _field(text, "order").split(",")
    assert order[0] == "F3", text
    assert sorted(order) == ["F0", "F1", "F2", "F3"], text
    assert float(_field(text, "grad_diff")) <= TOL, text


@pytest.mark.timeout(200)
def test_every_dtype_and_layout_arrives_intact() -> None:
    """All wire dtypes, 0-d, empty, None slots, views, grad-requiring, inline and large payloads,
    to a peer and to this rank itself, and echoed back: same dtype, shape and values."""
    proc, results = run_cases(2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _field(results["dtypes"], "bad") == "0", results["dtypes"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault, message", [
    ("malformed", r"header from rank 0 is not an aioready header \(expected magic 0xa10d"),
    ("unexpected", r"rank 1, step 0: message for an unknown microbatch \(expected 0\.\.3, got "
                   r"activation for stage 1 microbatch 99"),
])
def test_bad_message_ends_the_job(fault: str, message: str) -> None:
    """The receiving rank raises ProtocolError and MPI_Abort stops every rank. The sender waits
    for gradients forever, so only the abort ends the job before the launch times out."""
    proc = launch(2, "faults.py", fault, timeout=60)
    assert proc.returncode != 0
    assert "ProtocolError" in proc.stderr and re.search(message, proc.stderr), proc.stderr[-3000:]
    assert "rank 1 of 2" in proc.stderr
    assert "SENDER got" not in proc.stdout  # the sender was stopped, not left to finish


@pytest.mark.timeout(120)
def test_fault_script_control_run_succeeds() -> None:
    """The same script with good messages completes: the failures above come from the fault."""
    proc = launch(2, "faults.py", "none", timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RECEIVER ran" in proc.stdout and "SENDER got [0, 1, 2, 3]" in proc.stdout


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_cuda_tensors_arrive_intact() -> None:
    """CUDA payloads (CUDA-aware or staged through pinned memory) arrive on the device intact."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    proc = launch(2, "cuda_roundtrip.py", timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "CUDA OK" in proc.stdout, proc.stdout


_OVERSUB = ("from mpi4py import MPI; from aioready.launch import say; "
            "from aioready.transports.mpi import MPITransport; "
            "say('OVERSUBSCRIBED', MPITransport(MPI.COMM_WORLD).oversubscribed)")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bind, n", [("none", 2), ("none", 4), ("core", 2)])
def test_oversubscription_counts_the_cores_of_all_local_ranks(bind: str, n: int) -> None:
    """Ranks bound one per core each see one core but are not oversubscribed (a wrong answer
    turned the spin window off and made small-message latency 10x worse)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = cores or 1
    if bind == "core":
        n = min(n, cores)  # one rank per core: a one-core machine binds its single rank
    proc = run_mpi(n, ["-c", _OVERSUB], timeout=50, bind=bind)
    assert proc.returncode == 0, proc.stderr[-2000:]
    answers = re.findall(r"OVERSUBSCRIBED (\w+)", proc.stdout)
    assert answers == [str(n > cores)] * n, proc.stdout
