"""The GPU data plane of mpirun jobs (docs/async.md "The GPU data plane"), on CPUs.

What runs here for real: the choice and the agreement between ranks (cuda/plane.py), the unique
id bytes and their broadcast under mpiexec (cuda/nccl_bootstrap.py), the per-peer order
(transports/ordered.py) and the payload framing over an in-process ordered byte plane with
NCCL's matching rule (transports/device_payloads.py, testing/loopback.py), and the transport's
choice, log line and error under mpiexec. The CuPy layer (cuda/nccl.py) needs a GPU: see the
gpu-marked test at the end and bench/gpu_nccl_check.py.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from conftest import ROOT, run_mpi
from hypothesis import given, settings
from hypothesis import strategies as st

from aioready.cuda import nccl_bootstrap as boot
from aioready.cuda.plane import (
    ASKED_NCCL,
    ASKED_OTHER,
    ENV_GPU_PLANE,
    PlaneChoice,
    RankPlane,
    choose_gpu_plane,
    settle_gpu_plane,
)
from aioready.errors import ConfigError, InternalError, ProtocolError
from aioready.testing.loopback import LoopbackHub
from aioready.transports.device_payloads import receive_payloads, send_payloads
from aioready.transports.header import TensorSpec
from aioready.transports.ordered import DEVICE_FLAG, OrderedArrivals, device_tag, split_tag
from aioready.transports.tensor_bytes import spec_of, torch_dtype

SCRIPT = str(ROOT / "tests" / "mpi_scripts" / "gpu_plane.py")


# -- the choice -------------------------------------------------------------------------------
def test_explicit_then_environment_then_automatic() -> None:
    env = {ENV_GPU_PLANE: "staged"}
    assert choose_gpu_plane("nccl", cuda_aware=True, nccl_missing="x", environ=env) == \
        PlaneChoice("nccl", "argument", "chosen by the caller")
    assert choose_gpu_plane(None, cuda_aware=True, nccl_missing=None, environ=env).plane == \
        "staged"
    auto = {}
    assert choose_gpu_plane(None, cuda_aware=True, nccl_missing=None, environ=auto).plane == "mpi"
    missing = choose_gpu_plane(None, cuda_aware=False, nccl_missing="no cupy", environ=auto)
    assert missing == PlaneChoice("staged", "auto", "no NCCL through CuPy: no cupy")
    assert choose_gpu_plane(None, cuda_aware=None, nccl_missing=None, environ=auto).plane == \
        "nccl"


@pytest.mark.parametrize("where", ["argument", "env"])
def test_an_unknown_plane_is_refused(where: str) -> None:
    with pytest.raises(ConfigError) as err:
        if where == "argument":
            choose_gpu_plane("gpu", cuda_aware=False, nccl_missing=None, environ={})
        else:
            choose_gpu_plane(None, cuda_aware=False, nccl_missing=None,
                             environ={ENV_GPU_PLANE: "NCCL"})
    assert "expected nccl | staged | mpi" in str(err.value)


AUTO_NCCL = PlaneChoice("nccl", "auto", "")
AUTO_STAGED = PlaneChoice("staged", "auto", "")
ASKED = PlaneChoice("nccl", "env", "")


def test_nccl_only_when_every_rank_can() -> None:
    table = [RankPlane(0, True, 11, True), RankPlane(0, True, 22, True)]
    assert settle_gpu_plane(0, AUTO_NCCL, table).plane == "nccl"
    table[1] = RankPlane(0, False, 0)
    assert settle_gpu_plane(0, AUTO_NCCL, table) == PlaneChoice(
        "staged", "auto", "ranks [1] cannot use NCCL")
    assert settle_gpu_plane(1, AUTO_STAGED, table) == AUTO_STAGED


def test_nccl_only_when_every_rank_chose_it() -> None:
    """A CUDA-aware rank chooses mpi by itself: device buffers to MPI mix with staging, not
    with NCCL, so the rank that could use NCCL stages."""
    table = [RankPlane(0, True, 11, False), RankPlane(0, True, 22, True)]
    mpi = PlaneChoice("mpi", "auto", "MPI takes device buffers")
    assert settle_gpu_plane(0, mpi, table) == mpi
    assert settle_gpu_plane(1, AUTO_NCCL, table) == PlaneChoice(
        "staged", "auto", "ranks [0] chose another plane")


def test_ranks_sharing_a_gpu_stage_unless_nccl_was_asked_for() -> None:
    table = [RankPlane(0, True, 7, True), RankPlane(0, True, 9, True),
             RankPlane(0, True, 7, True)]
    shared = settle_gpu_plane(2, AUTO_NCCL, table)
    assert shared.plane == "staged" and "ranks 0 and 2 share a GPU" in shared.reason
    table = [RankPlane(ASKED_NCCL, True, 7), RankPlane(ASKED_NCCL, True, 7)]
    assert settle_gpu_plane(1, ASKED, table) == ASKED


def test_one_rank_asking_makes_every_rank_use_nccl() -> None:
    table = [RankPlane(ASKED_NCCL, True, 1, True), RankPlane(0, True, 2, False)]
    assert settle_gpu_plane(1, PlaneChoice("mpi", "auto", ""), table).plane == "nccl"


def test_nccl_asked_for_and_not_possible_fails_on_every_rank() -> None:
    table = [RankPlane(ASKED_NCCL, True, 1), RankPlane(ASKED_NCCL, False, 0)]
    for me, missing in ((0, None), (1, "import cupy.cuda.nccl failed")):
        with pytest.raises(ConfigError) as err:
            settle_gpu_plane(me, ASKED, table, missing)
        text = str(err.value)
        assert "asked for on ranks [0, 1], but ranks [1] cannot use it" in text
        assert f"{ENV_GPU_PLANE}=staged" in text and "cupy-cuda12x" in text
        assert ("here: import cupy.cuda.nccl failed" in text) == (me == 1)


def test_conflicting_explicit_planes_fail() -> None:
    table = [RankPlane(ASKED_NCCL, True, 1), RankPlane(ASKED_OTHER, True, 2)]
    with pytest.raises(ConfigError, match="ranks \\[0\\] asked for the nccl GPU data plane "
                       "and ranks \\[1\\] for another one"):
        settle_gpu_plane(1, PlaneChoice("staged", "env", ""), table)


# -- unique ids as bytes --------------------------------------------------------------------
def test_unique_id_bytes_round_trip_for_signed_and_unsigned_chars() -> None:
    raw = bytes(range(128))[::-1]
    signed = boot.id_from_bytes(raw, signed=True)
    assert min(signed) == 0 and max(signed) == 127  # 0..127: the same either way
    raw = bytes((i * 37) % 256 for i in range(128))
    signed, unsigned = boot.id_from_bytes(raw, signed=True), boot.id_from_bytes(raw,
                                                                               signed=False)
    assert min(signed) < 0 and min(unsigned) >= 0 and max(unsigned) > 127
    assert boot.id_to_bytes(signed) == raw == boot.id_to_bytes(unsigned)
    with pytest.raises(ProtocolError, match="expected 128 bytes, got 127"):
        boot.id_from_bytes(raw[:-1])
    with pytest.raises(ProtocolError, match="expected 128 chars, got 129"):
        boot.id_to_bytes(signed + (0,))


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_every_one_way_pair_has_its_own_id(size: int) -> None:
    index = {boot.pair_index(a, b, size) for a in range(size) for b in range(size) if a != b}
    assert index == set(range(1, boot.num_ids(size)))
    with pytest.raises(ConfigError):
        boot.pair_index(0, 0, 2)


# -- per-peer order ---------------------------------------------------------------------------
def test_tags_carry_the_device_flag() -> None:
    for seq in (0, 1, 2047):
        assert split_tag(device_tag(seq, True)) == (seq, True)
        assert split_tag(device_tag(seq, False)) == (seq, False) and device_tag(seq, False) == seq
    assert device_tag(2047, True) <= 32767  # the MPI tag bound every MPI guarantees
    with pytest.raises(InternalError):
        device_tag(DEVICE_FLAG, True)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 10**6)), min_size=1, max_size=40))
def test_items_are_released_per_peer_in_ticket_order(arrivals: list[tuple[int, int]]) -> None:
    order: OrderedArrivals[tuple[int, int]] = OrderedArrivals()
    tickets = [(peer, order.ticket(peer)) for peer, _ in arrivals]
    shuffled = sorted(tickets, key=lambda pt: arrivals[tickets.index(pt)][1])
    released: dict[int, list[int]] = {}
    for peer, ticket in shuffled:
        for item in order.complete(peer, ticket, (peer, ticket)):
            released.setdefault(peer, []).append(item[1])
    for peer in {p for p, _ in tickets}:
        assert released[peer] == list(range(len([p for p, _ in tickets if p == peer])))
    assert order.num_waiting() == 0


def test_a_peer_never_waits_for_another() -> None:
    order: OrderedArrivals[str] = OrderedArrivals()
    a0, a1, b0 = order.ticket("a"), order.ticket("a"), order.ticket("b")
    assert order.complete("a", a1, "a1") == [] and order.num_waiting("a") == 1
    assert order.complete("b", b0, "b0") == ["b0"]
    assert order.complete("a", a0, "a0") == ["a0", "a1"]
    with pytest.raises(InternalError, match="not outstanding"):
        order.complete("a", a0, "again")


# -- the framing over an ordered byte plane ---------------------------------------------------
def _message(seed: int) -> tuple:
    """Tensors of a stage boundary whose shapes vary with `seed` (variable sequence lengths)."""
    g = torch.Generator().manual_seed(seed)
    n = 3 + seed % 5
    return (torch.randn(n, 8, generator=g), None, torch.randn(2, n, generator=g).bfloat16(),
            torch.empty(0, 4), torch.rand(n, generator=g) > 0.5, torch.randn(4, 4)[:, 1:])


def _layout(tensors: tuple) -> tuple[list[TensorSpec], list, list[int]]:
    specs = [spec_of(t) for t in tensors]
    dtypes = [None if s.dtype is None else torch_dtype(s.dtype) for s in specs]
    sizes = [0 if t is None else t.numel() * t.element_size() for t in tensors]
    return specs, dtypes, sizes


def _same(a: tuple, b: list) -> bool:
    return all((x is None and y is None) or (x.shape == y.shape and x.dtype == y.dtype and
               torch.equal(x, y)) for x, y in zip(a, b))


async def test_payloads_follow_their_headers_in_each_peers_send_order() -> None:
    """Two senders, three messages each; the receiver's headers complete in a shuffled order,
    the ordered arrivals release them per peer in send order, and every payload arrives
    intact into tensors of its advertised dtype and shape."""
    hub = LoopbackHub(3)
    planes = [hub.endpoint(r) for r in range(3)]
    sent = {src: [_message(10 * src + k) for k in range(3)] for src in (0, 1)}
    for src in (0, 1):
        for msg in sent[src]:
            send_payloads(planes[src], 2, msg, _layout(msg)[2])
    order: OrderedArrivals[tuple] = OrderedArrivals()
    headers = [(src, order.ticket(src), k) for k in range(3) for src in (0, 1)]  # matched
    random.Random(5).shuffle(headers)  # completed in another order
    received: dict[int, list] = {0: [], 1: []}
    waits = []
    for src, ticket, k in headers:
        for k_due in order.complete(src, ticket, k):
            tensors, futures = receive_payloads(planes[2], src, *_layout(sent[src][k_due]))
            received[src].append((k_due, tensors))
            waits += futures
    await asyncio.wait_for(asyncio.gather(*waits), 5)
    for src in (0, 1):
        assert [k for k, _ in received[src]] == [0, 1, 2]
        assert all(_same(sent[src][k], tensors) for k, tensors in received[src])
    assert hub.num_pending() == 0 and hub.num_matched == 2 * 3 * 4  # 4 non-empty slots each


async def test_payloads_posted_out_of_order_are_caught_not_misdelivered() -> None:
    """Without the order (message 1's receives posted before message 0's), the loopback plane
    reports the size mismatch that would hang or corrupt memory on NCCL."""
    hub = LoopbackHub(2)
    a, b = hub.endpoint(0), hub.endpoint(1)
    first, second = _message(1), _message(2)  # different row counts, so different sizes
    for msg in (first, second):
        send_payloads(a, 1, msg, _layout(msg)[2])
    _, futures = receive_payloads(b, 0, *_layout(second))
    with pytest.raises(ProtocolError, match="matched a receive of another size"):
        await asyncio.wait_for(asyncio.gather(*futures), 5)


async def test_a_message_mixing_devices_is_refused() -> None:
    plane = LoopbackHub(2).endpoint(0)
    plane.device = torch.device("meta")
    with pytest.raises(ProtocolError, match="mixes tensors"):
        send_payloads(plane, 1, (torch.ones(3),), [12], rank=0)


# -- over MPI -------------------------------------------------------------------------------
# (mode, error, detail) and (plane, what both ranks log): every token in one 2-rank launch
ID_MODES = [("ids", "", "IDS OK"),
            ("count", "ConfigError", "rank 0 sent 3 ids, this rank expected 4"),
            ("fail", "ConfigError", "making the ids failed: RuntimeError: no NCCL here"),
            ("zero", "ProtocolError", "an NCCL unique id is all zeros")]
PLANE_VALUES = [
    ("", "GPU data plane staged (auto: no NCCL through CuPy: no CUDA device given)"),
    ("staged", f"GPU data plane staged (env: {ENV_GPU_PLANE}=staged)"),
    ("mpi", f"GPU data plane mpi (env: {ENV_GPU_PLANE}=mpi)"),
    ("nccl", "the nccl GPU data plane was asked for on ranks [0, 1], but ranks [0, 1] cannot "
             "use it"),
    ("gpu", "AIOREADY_GPU_PLANE names an unknown GPU data plane")]
_LAUNCH: list[str] = []


def _lines_of(token: str) -> list[str]:
    """The lines both ranks printed while `token` ran, without its "[token] " prefix."""
    if not _LAUNCH:
        tokens = [m for m, _, _ in ID_MODES] + [f"transport={v}" if v else "transport"
                                                 for v, _ in PLANE_VALUES]
        out = run_mpi(2, [SCRIPT, *tokens], timeout=150)
        assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
        _LAUNCH.append(out.stdout)
    prefix = f"[{token}] "
    return [line[len(prefix):] for line in _LAUNCH[0].splitlines() if line.startswith(prefix)]


@pytest.mark.mpi
@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode, error, detail", ID_MODES)
def test_unique_ids_broadcast_as_bytes_over_mpi(mode: str, error: str, detail: str) -> None:
    """rank 0 makes the ids, every rank gets the same bytes; a wrong count, a failing maker or
    an all-zero id fails on both ranks (never one rank alone, which would leave the other
    waiting in NCCL's init)."""
    text = "\n".join(_lines_of(mode))
    assert detail in text, text[-3000:]
    if error:
        assert text.count(f"{error}: rank ") == 2, text[-3000:]
        assert "IDS OK" not in text, text[-3000:]
    else:
        assert text.count("IDS OK") == 2, text[-3000:]


@pytest.mark.mpi
@pytest.mark.timeout(200)
@pytest.mark.parametrize("value, expect", PLANE_VALUES)
def test_the_transport_agrees_on_the_plane_and_logs_it(value: str, expect: str) -> None:
    text = "\n".join(_lines_of(f"transport={value}" if value else "transport"))
    assert text.count(expect) == 2, text[-3000:]
    ok = value in ("", "staged", "mpi")
    assert text.count("PLANE OK") == 2 * ok, text[-3000:]
    assert text.count("ConfigError: ") == 2 * (not ok), text[-3000:]
    if value == "mpi":  # explicit wins over detection: device buffers straight to MPI
        assert "CUDA tensors take the device path" in text


# -- the transport's plane path end to end, on CPUs -----------------------------------------
PLANE_CASES = ["1f1b:ready:1:1", "zbv:strict:1:1", "ooo", "dtypes"]  # all: the heavy test


def _exact_over_byte_plane(n: int, cases: list[str], timeout: float = 250) -> None:
    """tests/mpi_scripts/exact.py with every payload over aioready.testing.mpi_plane's ordered
    byte plane (no inline payloads): flagged headers, per-peer order, receives posted by
    header, the same losses and gradients as the unsplit model."""
    out = run_mpi(n, [str(ROOT / "tests" / "mpi_scripts" / "exact.py"), *cases], timeout=timeout,
                  env={"PLANE": "mpi-bytes", "AIOREADY_MPI_INLINE_BYTES": "0"})
    assert out.returncode == 0, out.stderr[-3000:]
    results = dict(line.split(" ", 2)[1:] for line in out.stdout.splitlines()
                   if line.startswith("RESULT "))
    assert sorted(results) == sorted(cases), out.stdout[-3000:]
    for case, text in results.items():
        if case == "dtypes":
            assert "bad=0" in text, text
        else:
            diffs = [float(v) for k, v in (f.split("=") for f in text.split())
                     if k.endswith("_diff")]
            assert diffs and max(diffs) <= 1e-12, (case, text)
    counts = [line.split() for line in out.stdout.splitlines() if line.startswith("PLANE ")]
    assert len(counts) == n, out.stdout[-2000:]  # each rank sent and received over the plane
    assert all(int(c[3].split("=")[1]) > 0 and int(c[4].split("=")[1]) > 0 for c in counts), \
        counts


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_pipelines_are_exact_over_an_ordered_byte_plane() -> None:
    _exact_over_byte_plane(2, PLANE_CASES)


@pytest.mark.heavy
@pytest.mark.mpi
@pytest.mark.timeout(600)
@pytest.mark.parametrize("n", [2, 4])
def test_every_hint_is_exact_over_an_ordered_byte_plane(n: int) -> None:
    from test_mpi import cases
    _exact_over_byte_plane(n, cases(n) + (["ooo", "dtypes"] if n == 2 else []), timeout=560)


@pytest.mark.mpi
@pytest.mark.timeout(200)
def test_tp_through_the_device_comm_is_exact_on_cpus() -> None:
    """PP=2 x TP=2 with aioready.tp.nccl_collectives.mpi_tp_comm (on CPUs the ranks agree on
    the staged plane, and `allreduce_tensor_` sums through MPI), both tag checks: the same
    gradients and loss as the unsplit model, the same task order on the TP members."""
    import json
    out = run_mpi(4, [str(ROOT / "examples" / "tp_mlp.py"), "--tp", "2", "--mode", "ready",
                      "--steps", "2", "--microbatches", "4", "--cap", "4", "--verify",
                      "exchange,inline", "--device-comm"], timeout=180,
                  env={"OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    runs = json.loads(line[len("RESULT "):])["runs"]
    assert sorted(runs) == ["ready/exchange", "ready/inline"], runs.keys()
    for (run,) in runs.values():
        assert run["grad_diff"] <= 1e-10 and run["loss_diff"] <= 1e-10, run
        assert run["orders_equal"] and run["num_collectives"] > 0, run


# -- on a GPU -------------------------------------------------------------------------------
def _gpu_nccl_missing() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device (GPU) visible to torch"
    from aioready.cuda.nccl import nccl_missing
    missing = nccl_missing()
    return None if missing is None else f"a CUDA GPU, but no NCCL through CuPy: {missing}"


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_cupy_nccl_plane_on_one_gpu() -> None:
    """bench/gpu_nccl_check.py on 1 rank: send-to-self in an NCCL group and an all-reduce
    through NcclPlane's communicator, completions awaited as CUDA events."""
    missing = _gpu_nccl_missing()
    if missing is not None:
        pytest.skip(missing)
    out = run_mpi(1, [str(ROOT / "bench" / "gpu_nccl_check.py")], timeout=150)
    assert out.returncode == 0, out.stderr[-3000:]
    cases = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(cases) == 1 and '"ok": true' in cases[0], out.stdout[-3000:]


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_cupy_nccl_plane_with_two_ranks() -> None:
    """bench/gpu_nccl_check.py on 2 ranks, automatic plane: CUDA tensors between the ranks
    through MPITransport, and the TP and DP sums, exact. On one GPU the ranks share it, the
    automatic choice stages through the host, and NCCL's own 2-rank communicator (nccl_self)
    is expected to be refused (recorded, not asserted); with 2 GPUs every case uses NCCL."""
    missing = _gpu_nccl_missing()
    if missing is not None:
        pytest.skip(missing)
    out = run_mpi(2, [str(ROOT / "bench" / "gpu_nccl_check.py")], timeout=280)
    import json
    cases = {c["case"]: c for c in (json.loads(line[7:]) for line in out.stdout.splitlines()
                                    if line.startswith("RESULT "))}
    assert {"transport", "tp_dp"} <= set(cases), out.stdout[-3000:] + out.stderr[-3000:]
    assert cases["transport"]["ok"] and cases["tp_dp"]["ok"], cases
    one_gpu = torch.cuda.device_count() < 2
    assert cases["transport"]["plane"] == ("staged" if one_gpu else "nccl"), cases
    if not one_gpu:
        assert cases["nccl_self"]["ok"], cases
