"""SecureTransport over TorchDistTransport (torchrun, gloo, 2 ranks): a sealed step is
bit-identical to the plain one and to the unsplit model, and a rank holding another key ends the
job with an error naming the sender instead of computing with what it could not authenticate.
The same script as the MPI test (tests/mpi_scripts/sealed.py), launched by torchrun."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from conftest import run_torchrun
from test_secure_mpi import SCRIPT, miskeyed

pytestmark = pytest.mark.timeout(200)


def test_sealed_step_under_torchrun_is_exact_and_a_wrong_key_is_refused() -> None:
    seen = miskeyed(run_torchrun(2, [str(SCRIPT)], timeout=150))
    # rank 1 opens rank 0's first activation with the wrong key; rank 0 then hears nothing
    # it can use from rank 1 and ends within its peer timeout (8 s here), naming rank 1
    assert "type=ProtocolError" in seen["1"], seen["1"]
    assert "message from rank 0 failed authentication" in seen["1"], seen["1"]
    assert re.search(r"type=(ProtocolError|PeerLostError) .*rank 1", seen["0"]), seen["0"]


@pytest.mark.heavy  # two more launches importing torch
def test_aioready_train_under_torchrun_seals_with_the_key_file(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text(os.urandom(32).hex())
    key.chmod(0o600)
    args = ["-m", "aioready", "train", "--stages", "2", "--microbatches", "2", "--steps", "2",
            "--task-ms", "0", "--dim", "8", "--seq", "4", "--no-progress", "--mode", "strict"]
    sealed = run_torchrun(2, [*args, "--key-file", str(key), "--json", str(tmp_path / "s.json")],
                          timeout=150)
    assert sealed.returncode == 0, sealed.stderr[-3000:]
    assert "torch.distributed ranks, sealed with key" in sealed.stdout, sealed.stdout
    plain = run_torchrun(2, [*args, "--json", str(tmp_path / "p.json")], timeout=150)
    assert plain.returncode == 0, plain.stderr[-3000:]
    s, p = (json.loads((tmp_path / f"{n}.json").read_text()) for n in "sp")
    assert s["sealed"] and len(s["sealed"]) == 16 and p["sealed"] is None
    assert s["loss"] == p["loss"]  # sealing changes no bit of the computation
