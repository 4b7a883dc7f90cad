"""CUDA over MPI: detection (runs on CPU: the MPICH wheel is not CUDA-aware), the override, the
pinned pool's bookkeeping with fake buffers, the transport's path and its staged control flow
with fake CUDA, and the real GPU paths on a GPU."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, run_mpi

from aioready.cuda import mpi as cuda_mpi
from aioready.errors import ConfigError, InternalError

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (GPU) visible "
                         "to torch")


def test_find_libmpi_reads_the_maps_file(tmp_path) -> None:
    lib = tmp_path / "libmpi.so.12"
    lib.write_bytes(b"")
    maps = tmp_path / "maps"
    maps.write_text(f"7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n"
                    f"7f02-7f03 r-xp 00000000 08:01 2 {lib}\n")
    assert cuda_mpi.find_libmpi(str(maps)) == str(lib)
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n")
    assert cuda_mpi.find_libmpi(str(maps)) is None


DETECT = "import json,aioready.cuda.mpi as c;print(json.dumps(c.cuda_mpi_support()._asdict()))"


def _mpich_wheel() -> bool:
    try:
        importlib.metadata.distribution("mpich")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_detection_on_the_loaded_mpi(child_env) -> None:
    pytest.importorskip("mpi4py")
    env = {k: v for k, v in child_env.items() if k != cuda_mpi.ENV_CUDA_AWARE}
    out = subprocess.run([sys.executable, "-c", DETECT], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["method"] in ("MPIX_Query_cuda_support", "mpi_memory_alloc_kinds", "none")
    if got["method"] == "MPIX_Query_cuda_support":
        assert got["library"] and "libmpi" in got["library"]
        assert isinstance(got["aware"], bool)
    if _mpich_wheel() and got["library"] and got["library"].startswith(sys.prefix):
        # the PyPI MPICH wheel is built without CUDA: the staged path
        assert got == {"aware": False, "method": "MPIX_Query_cuda_support",
                       "library": got["library"], "detail": "returned 0"}


def test_env_override_and_its_bad_value(monkeypatch) -> None:
    monkeypatch.setattr(cuda_mpi, "_cached", None)
    monkeypatch.setenv("AIOREADY_MPI_CUDA_AWARE", "1")
    got = cuda_mpi.cuda_mpi_support(refresh=True)
    assert got.aware is True and got.method == "env"
    assert cuda_mpi.transfer_path(got) == "device"
    monkeypatch.setenv("AIOREADY_MPI_CUDA_AWARE", "0")
    got = cuda_mpi.cuda_mpi_support(refresh=True)
    assert got.aware is False and cuda_mpi.transfer_path(got) == "staged"
    monkeypatch.setenv("AIOREADY_MPI_CUDA_AWARE", "yes")
    with pytest.raises(ConfigError, match="0 or 1"):
        cuda_mpi.cuda_mpi_support(refresh=True)


@pytest.mark.parametrize("value", ["yes", "true", "", " 1", "2", "on"])
def test_every_value_but_0_and_1_is_a_config_error(value: str) -> None:
    with pytest.raises(ConfigError) as info:
        cuda_mpi.forced_cuda_aware({"AIOREADY_MPI_CUDA_AWARE": value})
    assert f"expected 0 or 1, got {value!r}" in str(info.value)
    assert "AIOREADY_MPI_CUDA_AWARE" in str(info.value)


def test_the_override_is_read_as_a_switch() -> None:
    assert cuda_mpi.forced_cuda_aware({"AIOREADY_MPI_CUDA_AWARE": "1"}) is True
    assert cuda_mpi.forced_cuda_aware({"AIOREADY_MPI_CUDA_AWARE": "0"}) is False
    assert cuda_mpi.forced_cuda_aware({}) is None


def test_unknown_support_takes_the_staged_path() -> None:
    unknown = cuda_mpi.CudaMPISupport(None, "none", None, "no query symbol, no memory kinds")
    assert cuda_mpi.transfer_path(unknown) == "staged"


def test_device_buffer_needs_contiguous_data() -> None:
    t = torch.ones(4, 4, requires_grad=True)
    buf = cuda_mpi.mpi_device_buffer(t)
    assert not buf.requires_grad and buf.data_ptr() == t.data_ptr()
    with pytest.raises(ConfigError, match="contiguous"):
        cuda_mpi.mpi_device_buffer(torch.ones(4, 4).t())


# -- the pinned pool, with fake buffers ----------------------------------------------------------
class FakeBuffer:
    """Stands in for a pinned uint8 tensor: a size and an address."""

    next_addr = 0x1000

    def __init__(self, size: int) -> None:
        self.size = size
        self.addr = FakeBuffer.next_addr
        FakeBuffer.next_addr += size

    def __len__(self) -> int:
        return self.size


class FakeView:
    """A typed view of a FakeBuffer: another object at the same address."""

    def __init__(self, buf: FakeBuffer) -> None:
        self.addr = buf.addr


def fake_pool(**kw) -> tuple[cuda_mpi.PinnedPool, list[int]]:
    made: list[int] = []

    def allocate(n: int) -> FakeBuffer:
        made.append(n)
        return FakeBuffer(n)

    return cuda_mpi.PinnedPool(allocate, key=lambda b: b.addr, **kw), made


def test_pool_rounds_sizes_up_to_a_power_of_two() -> None:
    pool, made = fake_pool(min_bytes=4096)
    assert [pool.size_class(n) for n in (0, 1, 4096, 4097, 5000, 1 << 20, (1 << 20) + 1)] == \
        [4096, 4096, 4096, 8192, 8192, 1 << 20, 2 << 20]
    a = pool.take(5000)
    assert len(a) == 8192 and made == [8192]


def test_pool_reuses_a_buffer_only_once_it_was_given_back() -> None:
    pool, made = fake_pool()
    a = pool.take(6000)
    b = pool.take(7000)  # same class, but `a` is still lent: a new buffer
    assert b is not a and made == [8192, 8192] and pool.num_lent == 2
    pool.give(FakeView(a))  # a view of it is enough
    c = pool.take(5000)
    assert c is a and made == [8192, 8192]
    assert (pool.num_allocated, pool.num_reused, pool.num_lent) == (2, 1, 2)
    d = pool.take(100_000)  # another class: never a smaller buffer
    assert d is not b and len(d) == 131072
    pool.give(b)
    pool.give(c)
    assert pool.take(6500) is c  # newest given back first
    assert pool.free_bytes == 8192


def test_pool_refuses_a_buffer_given_back_twice_or_from_elsewhere() -> None:
    pool, _ = fake_pool()
    a = pool.take(10)
    pool.give(a)
    with pytest.raises(InternalError, match="not lent out"):
        pool.give(a)
    with pytest.raises(InternalError, match="not lent out"):
        pool.give(FakeBuffer(4096))
    assert pool.take(10) is a


def test_pool_keeps_at_most_max_free_bytes_dropping_the_oldest() -> None:
    pool, made = fake_pool(max_free_bytes=3 * 4096)
    bufs = [pool.take(4096) for _ in range(4)]
    for b in bufs:
        pool.give(b)
    assert pool.free_bytes == 3 * 4096 and pool.num_lent == 0
    again = [pool.take(4096) for _ in range(4)]
    assert again[:3] == [bufs[3], bufs[2], bufs[1]]  # bufs[0], the oldest, was dropped
    assert again[3] is not bufs[0] and len(made) == 5


def test_host_stager_lends_typed_views_of_pooled_buffers() -> None:
    """host_buffer()/release() on ordinary CPU memory: no CUDA is touched before a copy."""
    pool = cuda_mpi.PinnedPool(lambda n: torch.empty(n, dtype=torch.uint8),
                               key=lambda t: t.data_ptr())
    stager = cuda_mpi.HostStager(torch.device("cuda", 0), pool=pool)
    for dtype in (torch.bfloat16, torch.float64, torch.float16, torch.int64, torch.bool):
        host = stager.host_buffer((7, 9), dtype)
        assert host.shape == (7, 9) and host.dtype == dtype and host.is_contiguous()
        host.copy_(torch.arange(63).reshape(7, 9).to(dtype))
        assert torch.equal(host, torch.arange(63).reshape(7, 9).to(dtype))
        stager.release(host)
    scalar = stager.host_buffer((), torch.int64)
    assert scalar.shape == () and pool.num_lent == 1
    stager.release(scalar)
    assert (pool.num_allocated, pool.num_reused, pool.num_lent) == (1, 5, 0)
    big = stager.host_buffer((1000, 3), torch.float32)  # 12000 bytes: the next class
    assert pool.num_allocated == 2
    stager.release(big)


# -- the transport's path (one rank, no GPU needed) ----------------------------------------------
TRANSPORT = ("import json, logging; logging.basicConfig(level=logging.INFO)\n"
             "from mpi4py import MPI\n"
             "from aioready.cuda.mpi import cuda_mpi_support\n"
             "from aioready.transports.mpi import MPITransport\n"
             "print('CUDA_AWARE', MPITransport(MPI.COMM_WORLD).cuda_aware)\n"
             "print('SUPPORT', json.dumps(cuda_mpi_support()._asdict()))\n")


def _transport(child_env: dict[str, str], value: str | None) -> subprocess.CompletedProcess:
    pytest.importorskip("mpi4py")
    env = {k: v for k, v in child_env.items() if k != cuda_mpi.ENV_CUDA_AWARE}
    if value is not None:
        env[cuda_mpi.ENV_CUDA_AWARE] = value
    return subprocess.run([sys.executable, "-c", TRANSPORT], env=env, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("value, aware, path", [("1", True, "device"), ("0", False, "staged")])
def test_transport_logs_the_path_it_takes(child_env, value, aware, path) -> None:
    out = _transport(child_env, value)
    assert out.returncode == 0, out.stderr
    assert f"CUDA_AWARE {aware}" in out.stdout
    assert f"rank 0/1: CUDA tensors take the {path} path" in out.stderr, out.stderr


def test_transport_takes_the_detected_path(child_env) -> None:
    """Without the override the transport follows detection: staged on the MPICH wheel."""
    out = _transport(child_env, None)
    assert out.returncode == 0, out.stderr
    support = cuda_mpi.CudaMPISupport(**json.loads(out.stdout.split("SUPPORT ", 1)[1]))
    path = cuda_mpi.transfer_path(support)
    assert f"CUDA_AWARE {path == 'device'}" in out.stdout
    assert (f"CUDA tensors take the {path} path" in out.stderr and
            f"({support.method}: {support.detail})" in out.stderr), out.stderr
    if _mpich_wheel() and support.library and support.library.startswith(sys.prefix):
        assert ("CUDA tensors take the staged path, through pooled pinned host buffers "
                "(MPIX_Query_cuda_support: returned 0)") in out.stderr, out.stderr


def test_transport_refuses_a_bad_override(child_env) -> None:
    out = _transport(child_env, "yes")
    assert out.returncode != 0
    assert "ConfigError" in out.stderr
    assert "AIOREADY_MPI_CUDA_AWARE" in out.stderr
    assert "expected 0 or 1, got 'yes'" in out.stderr, out.stderr
    assert "CUDA_AWARE" not in out.stdout


# -- two ranks ---------------------------------------------------------------------------------
def _roundtrip(mode: str, value: str) -> subprocess.CompletedProcess:
    """tests/mpi_scripts/cuda_roundtrip.py MODE on 2 ranks, the CUDA-aware override at VALUE."""
    return run_mpi(2, [str(ROOT / "tests" / "mpi_scripts" / "cuda_roundtrip.py"), mode],
                   timeout=100, env={cuda_mpi.ENV_CUDA_AWARE: value})


@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("value", ["0", "1"])
def test_cpu_tensors_never_take_a_cuda_path(value: str) -> None:
    """Whatever the override says, CPU tensors go as host bytes and arrive intact."""
    out = _roundtrip("cpu", value)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"CPU OK cuda_aware={value == '1'}" in out.stdout, out.stdout


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_staged_path_awaits_copies_and_gives_pinned_buffers_back() -> None:
    """The staged path's control flow without a GPU (fake CUDA tensors, events and copies):
    nothing is sent or delivered before its copy completed, every pinned buffer goes back to
    the pool after its Isend or copy, and the second round reuses the first round's."""
    out = _roundtrip("fake", "0")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "FAKE OK cuda_aware=False" in out.stdout, out.stdout
    assert "sender pools lent=0" in out.stdout and "receiver pools lent=0" in out.stdout


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.timeout(120)
@gpu
def test_staged_cuda_tensors_reuse_and_release_pinned_buffers() -> None:
    """Staged path: CUDA tensors arrive intact, every pinned buffer goes back to its pool."""
    out = _roundtrip("cuda", "0")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "CUDA OK cuda_aware=False" in out.stdout, out.stdout
    assert "sender pools lent=0" in out.stdout and "receiver pools lent=0" in out.stdout


@pytest.mark.gpu
@gpu
async def test_host_stager_round_trip_reuses_its_pinned_buffer() -> None:
    stager = cuda_mpi.HostStager(torch.device("cuda", 0))
    try:
        for _ in range(3):
            x = torch.randn(1 << 20, device="cuda") * 3  # still running when the copy is queued
            ready = torch.cuda.Event()
            ready.record()
            host, done = stager.to_host(x, ready)
            await stager.wait(done)
            assert host.is_pinned() and torch.equal(host, x.cpu())
            back, done = stager.to_device(host)
            await stager.wait(done)
            assert torch.equal(back, x)
            stager.release(host)
        fence = stager.fence(ready)
        await stager.wait(fence)
        assert fence.query()
        pool = stager.pool
        assert (pool.num_allocated, pool.num_reused, pool.num_lent) == (1, 2, 0)
    finally:
        stager.close()


@pytest.mark.gpu
@gpu
def test_mpi_ranks_on_the_gpu_match_the_unsplit_model() -> None:
    """bench/gpu_mpi_check.py: 2 ranks, CUDADevice stages, MPITransport, every case exact."""
    env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1"}
    out = run_mpi(2, [str(ROOT / "bench" / "gpu_mpi_check.py")], timeout=150, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    cases = [json.loads(line[7:]) for line in out.stdout.splitlines()
             if line.startswith("RESULT ")]
    assert len(cases) == 8
    assert all(c["ok"] for c in cases), cases
