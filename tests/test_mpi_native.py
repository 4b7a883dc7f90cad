"""The compiled MPI helper (aioready/transports/native, docs/hot_path.md "The compiled helper"):
built by `make test`, used on the MPI path where a plan applies, the same bytes and the same
tensors as the Python plans, bad headers raising what the Python path raises, and the exactness
suite's cases equal to the unsplit model with it on and off (`AIOREADY_MPI_NATIVE`)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from conftest import EXACT_2, requires_mpi, run_mpi, switched

SCRIPTS = Path(__file__).resolve().parent / "mpi_scripts"
TOL = 1e-10

pytestmark = [pytest.mark.mpi, requires_mpi]


def _results(proc: subprocess.CompletedProcess) -> dict[str, str]:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(line.split(" ", 2)[1:] for line in proc.stdout.splitlines()
                if line.startswith("RESULT "))


def _field(text: str, name: str) -> str:
    match = re.search(rf"{name}=(\S+)", text)
    assert match, f"no {name} in {text!r}"
    return match.group(1)


@pytest.mark.timeout(120)
def test_the_helper_is_built_and_matches_the_python_plans() -> None:
    """It loads (make test builds it: `python -m aioready.transports.native build`); its send
    writes the Python send plan's bytes for every plannable dtype and shape; its receive builds
    the Python receive plan's message, tensors bit for bit, and declines what that declines."""
    proc = run_mpi(1, [str(SCRIPTS / "native.py"), "bytes", "receive", "declined", "heads",
                       "multi", "notices"],
                   timeout=100, env={"AIOREADY_MPI_NATIVE": "1"})
    assert "STATUS on" in proc.stdout, (proc.stdout, proc.stderr[-2000:])
    results = _results(proc)
    sent = results["bytes"]
    assert int(_field(sent, "num")) >= 100 and _field(sent, "bad") == "0", sent
    assert int(_field(sent, "parts")) >= 30, sent  # send_parts: from the tensor's memory
    receive = results["receive"]
    assert int(_field(receive, "num")) >= 50 and _field(receive, "bad") == "0", receive
    assert _field(receive, "header_only") == "1", receive
    declined = results["declined"]
    assert _field(declined, "taken") == "[]", declined  # every bad header went the Python way
    assert _field(declined, "bound") == "1", declined  # too large: matched, not received
    assert _field(declined, "overflow") == "1", declined
    heads = results["heads"]  # send_head: a notice's bytes, as both Python encoders write them
    assert _field(heads, "num") == "4" and _field(heads, "bad") == "0", heads
    assert _field(heads, "overflow") == "1", heads
    several = results["multi"]  # send_multi: several tensors and None slots, the plan's bytes
    assert _field(several, "num") == "10" and _field(several, "bad") == "0", several
    assert _field(several, "overflow") == "1", several
    assert _field(several, "received") == "10", several  # viewed in C as the plan views them
    notices = results["notices"]  # a notice's fields to the handler, as the Python plan reads
    assert _field(notices, "num") == "3" and _field(notices, "bad") == "0", notices
    assert _field(notices, "taken") == "[]", notices  # bad notice headers: the Python way
    assert _field(notices, "untouched") == "1", notices  # ... and the handler never called
    assert _field(notices, "raised") == "1", notices


@pytest.mark.timeout(120)
def test_bad_headers_raise_what_the_python_path_raises() -> None:
    """Magic, version, tensor count, kind, dtype code and shape altered after a plan was
    learned: the same ProtocolError, word for word, with the helper (which took the good
    message) and without."""
    out = {}
    for native in ("1", "0"):
        proc = run_mpi(1, [str(SCRIPTS / "native.py"), "errors"], timeout=100,
                       env={"AIOREADY_MPI_NATIVE": native})
        out[native] = _results(proc)["errors"]
    assert _field(out["1"], "native_used") == "1", out["1"]
    assert _field(out["0"], "native_used") == "0", out["0"]
    errors = {native: text.split(" ", 1)[1] for native, text in out.items()}
    assert errors["1"] == errors["0"]
    assert errors["1"].count("=ProtocolError:") == 7, errors["1"]


@pytest.mark.timeout(120)
def test_bad_notice_headers_raise_the_same_with_notices_read_in_c_or_not() -> None:
    """A notice's magic, version, tensor count and kind altered after its plan was learned,
    the transport's notices routed to a handler: the same ProtocolError, word for word, with
    the C probe handing notices over (`AIOREADY_NATIVE_RECV_HEADS=1`, which took the good
    ones) and without."""
    out = {}
    for recv in ("1", "0"):
        proc = run_mpi(1, [str(SCRIPTS / "native.py"), "notice_errors"], timeout=100,
                       env={"AIOREADY_MPI_NATIVE": "1", "AIOREADY_NATIVE_RECV_HEADS": recv})
        out[recv] = _results(proc)["notice_errors"]
    assert _field(out["1"], "native_used") == "1", out["1"]
    assert _field(out["0"], "native_used") == "0", out["0"]
    errors = {recv: text.split(" ", 1)[1] for recv, text in out.items()}
    assert errors["1"] == errors["0"]
    assert errors["1"].count("=ProtocolError:") == 4, errors["1"]


CASES = ["1f1b:ready:1:1", "interleaved-1f1b:strict:0:1", "dtypes", "plans"]
NOTICE = "1f1b:ready:1:1"
MPI_NOTICES = {"AIOREADY_MPI_NATIVE": "1", "AIOREADY_NOTICE_BOARD": "0"}  # notices as messages
# every switch on and off, run in the 2-rank launch other modules share (conftest.SharedLaunch)
HELPER = {n: EXACT_2.need(*switched({"AIOREADY_MPI_NATIVE": n}, *CASES)) for n in ("1", "0")}
HEADS = {h: EXACT_2.need(*switched({**MPI_NOTICES, "AIOREADY_NATIVE_HEADERS": h}, NOTICE))[0]
         for h in ("1", "0")}
RECV_HEADS = {r: EXACT_2.need(*switched({**MPI_NOTICES, "AIOREADY_NATIVE_RECV_HEADS": r},
                                        NOTICE))[0] for r in ("1", "0")}
MULTI = {m: EXACT_2.need(*switched({"AIOREADY_MPI_NATIVE": "1", "AIOREADY_NATIVE_MULTI": m,
                                    "AIOREADY_NATIVE_RECV_MULTI": "0"}, "multi"))[0]
         for m in ("1", "0")}
RECV_MULTI = {r: EXACT_2.need(*switched({"AIOREADY_MPI_NATIVE": "1",
                                         "AIOREADY_NATIVE_RECV_MULTI": r}, "multi"))[0]
              for r in ("1", "0")}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("native", ["1", "0"], ids=["helper-on", "helper-off"])
def test_exact_over_mpi_with_the_helper_on_and_off(native: str) -> None:
    """Pipelines over two ranks equal the unsplit model, payloads of every kind and lone tensors
    there and back arrive intact, and the lone tensors went through the helper's send and
    receive exactly where it is on."""
    lines = EXACT_2.results(HELPER[native])
    results = {case: lines[token] for case, token in zip(CASES, HELPER[native])}
    for case in CASES[:2]:
        assert _field(results[case], "loss_seen") == "1", (case, results[case])
        assert float(_field(results[case], "loss_diff")) <= TOL, (case, results[case])
        assert float(_field(results[case], "grad_diff")) <= TOL, (case, results[case])
    assert _field(results["dtypes"], "bad") == "0", results["dtypes"]
    plans = results["plans"]
    assert _field(plans, "bad") == "0", plans
    assert int(_field(plans, "taken")) > 0, plans
    native_in, native_out = int(_field(plans, "native_in")), int(_field(plans, "native_out"))
    if native == "1":
        assert native_in > 0 and native_out > 0, plans
    else:
        assert native_in == native_out == 0, plans


@pytest.mark.timeout(200)
@pytest.mark.parametrize("heads", ["1", "0"], ids=["notices-in-c", "switch-off"])
def test_exact_over_mpi_with_notices_sent_by_the_helper_or_not(heads: str) -> None:
    """The reserving policy's 1F1B over two ranks, its notices sent by the compiled helper's
    `send_head` (`AIOREADY_NATIVE_HEADERS`, docs/hot_path_measurements.md "Ready against strict")
    and by the Python path: the same losses and gradients as the unsplit model either way, and
    notices went through the helper exactly where the switch is on."""
    result = EXACT_2.results([HEADS[heads]])[HEADS[heads]]
    assert _field(result, "loss_seen") == "1", result
    assert float(_field(result, "loss_diff")) <= TOL, result
    assert float(_field(result, "grad_diff")) <= TOL, result
    sent = int(_field(result, "heads"))
    assert (sent > 0) if heads == "1" else sent == 0, result


@pytest.mark.timeout(200)
@pytest.mark.parametrize("recv", ["1", "0"], ids=["notices-read-in-c", "switch-off"])
def test_exact_over_mpi_with_notices_read_by_the_helper_or_not(recv: str) -> None:
    """The reserving 1F1B over two ranks, each notice received handed by the C probe straight to
    the runtime's notice handler as its fields (`AIOREADY_NATIVE_RECV_HEADS`,
    docs/hot_path_measurements.md "The notice's read in one C call") or delivered as a Message: the
    unsplit model's losses and gradients either way, and notices read in C exactly where the switch
    is on: every one sent but each rank's first (header-only messages' receive plan is learned from
    it)."""
    result = EXACT_2.results([RECV_HEADS[recv]])[RECV_HEADS[recv]]
    assert _field(result, "loss_seen") == "1", result
    assert float(_field(result, "loss_diff")) <= TOL, result
    assert float(_field(result, "grad_diff")) <= TOL, result
    sent, read = int(_field(result, "heads")), int(_field(result, "notices_in"))
    assert sent > 0, result
    if recv == "1":
        assert 0 < read and sent - 2 <= read <= sent, result
    else:
        assert read == 0, result


@pytest.mark.timeout(200)
@pytest.mark.parametrize("multi", ["1", "0"], ids=["several-in-c", "switch-off"])
def test_several_tensors_there_and_back_with_the_helpers_send_or_not(multi: str) -> None:
    """Messages of several tensors with None slots, sent by the compiled helper's `send_multi`
    (`AIOREADY_NATIVE_MULTI`, docs/hot_path_measurements.md "Ready against strict") and by the
    Python plan: every tensor and None slot comes back as sent, through the C send exactly where it
    is on (received by the Python plan: AIOREADY_NATIVE_RECV_MULTI=0, the test below has the C
    one)."""
    result = EXACT_2.results([MULTI[multi]])[MULTI[multi]]
    assert _field(result, "bad") == "0" and int(_field(result, "taken")) > 0, result
    sent = int(_field(result, "native_multi"))
    assert (sent > 0) if multi == "1" else sent == 0, result


@pytest.mark.timeout(200)
@pytest.mark.parametrize("recv", ["1", "0"], ids=["viewed-in-c", "switch-off"])
def test_several_tensors_there_and_back_received_by_the_helper_or_not(recv: str) -> None:
    """The same messages received by the C probe, which views several tensors from the receive plan
    (`AIOREADY_NATIVE_RECV_MULTI`, docs/hot_path_measurements.md "The notice's read in one C
    call"), or by the Python plan: every tensor and None slot comes back as sent either way,
    through the C receive exactly where it is on."""
    result = EXACT_2.results([RECV_MULTI[recv]])[RECV_MULTI[recv]]
    assert _field(result, "bad") == "0", result
    in_c, python = int(_field(result, "native_in")), int(_field(result, "taken"))
    if recv == "1":
        assert in_c > 0, result
    else:
        assert in_c == 0 and python > 0, result
