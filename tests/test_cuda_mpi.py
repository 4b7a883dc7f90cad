"""CUDA-aware MPI detection (runs on CPU: the MPICH wheel is not CUDA-aware) and buffer checks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, run_mpi

from aioready.cuda import mpi as cuda_mpi
from aioready.errors import ConfigError


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


def test_detection_on_the_loaded_mpi(child_env) -> None:
    pytest.importorskip("mpi4py")
    out = subprocess.run([sys.executable, "-c", DETECT], env=child_env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["method"] in ("MPIX_Query_cuda_support", "mpi_memory_alloc_kinds", "none")
    if got["method"] == "MPIX_Query_cuda_support":
        assert got["library"] and "libmpi" in got["library"]
        assert isinstance(got["aware"], bool)


def test_env_override_and_its_bad_value(monkeypatch) -> None:
    monkeypatch.setenv("AIOREADY_MPI_CUDA_AWARE", "1")
    got = cuda_mpi.cuda_mpi_support(refresh=True)
    assert got.aware is True and got.method == "env"
    assert cuda_mpi.transfer_path(got) == "device"
    monkeypatch.setenv("AIOREADY_MPI_CUDA_AWARE", "yes")
    with pytest.raises(ConfigError, match="0 or 1"):
        cuda_mpi.cuda_mpi_support(refresh=True)
    monkeypatch.setattr(cuda_mpi, "_cached", None)


def test_device_buffer_needs_contiguous_data() -> None:
    t = torch.ones(4, 4, requires_grad=True)
    buf = cuda_mpi.mpi_device_buffer(t)
    assert not buf.requires_grad and buf.data_ptr() == t.data_ptr()
    with pytest.raises(ConfigError, match="contiguous"):
        cuda_mpi.mpi_device_buffer(torch.ones(4, 4).t())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible to torch")
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
