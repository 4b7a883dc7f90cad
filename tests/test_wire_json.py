"""The bench harness's results cross ranks as JSON in buffers (bench/wire_json.py), not pickles:
what a record holds comes back equal (floats exact, None, NaN, nested lists), and the modules
that gather results call no pickling collective. Several ranks: tests/test_bench_e2e.py runs
the harness over mpiexec on both sides."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from bench.wire_json import all_gather_json_torch, bcast_int, gather_json, reduce_sum_float

RECORD = [[0.1, 1 / 3, 2.5e-7], None, [1, 2, 3], 0.30000000000000004, [[4, 3], [2, 1]],
          float("nan")]


def _same(a, b) -> bool:
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    return a == b and type(a) is type(b)


def test_mpi_collectives_round_trip_a_record_exactly():
    from mpi4py import MPI
    comm = MPI.COMM_SELF
    got = gather_json(comm, RECORD)
    assert got is not None and len(got) == 1 and _same(got[0], RECORD)
    assert bcast_int(comm, 48213) == 48213
    assert reduce_sum_float(comm, 0.1) == 0.1


def test_torch_all_gather_round_trips_a_record_exactly():
    import torch.distributed as dist
    if dist.is_initialized():
        pytest.fail("a process group is already initialised in this test process")
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        got = all_gather_json_torch(RECORD)
    finally:
        dist.destroy_process_group()
    assert len(got) == 1 and _same(got[0], RECORD)


def test_the_harness_gathers_nothing_by_pickle():
    pickling = re.compile(r"\.(gather|bcast|reduce|allgather|scatter|send|recv)\(|_object\(")
    for name in ("e2e_worker.py", "e2e_torch.py"):
        text = (Path(__file__).parent.parent / "bench" / name).read_text()
        assert not pickling.search(text), f"bench/{name}: {pickling.search(text).group(0)}"
