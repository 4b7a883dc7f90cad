"""The CuPy NCCL data plane on the GPU (docs/async.md "The GPU data plane"); never run yet.

Usage: mpiexec -n R python3 bench/gpu_nccl_check.py. Each rank drives GPU `rank % count`; rank 0
prints one RESULT line per case, as JSON. Run by bench/gpu_check.py (R = 1, then 2) and by the
gpu-marked test of tests/test_gpu_plane.py (R = 1). Cases:

- ``nccl_self`` (every R): a communicator over all ranks from cuda/nccl.py's NcclPlane; each
  rank sends a tensor to itself inside one NCCL group (ncclSend and ncclRecv to its own rank),
  and `all_reduce_` sums rank-dependent values; the receive's completion is awaited as a CUDA
  event through the completion engine. Checks the CuPy calls (pointers, counts, datatypes,
  streams) on one GPU.
- ``transport`` (R >= 2): MPITransport on the GPU with the plane of AIOREADY_GPU_PLANE (unset:
  automatic); rank 0 sends messages of variable shapes (float32, bfloat16, a None slot, an empty
  tensor) to rank 1, which checks them and sends them back. Ranks sharing one GPU: automatic
  choice stages through the host; an explicit `nccl` shows what NCCL says (it refuses duplicate
  GPUs since 2.5; the result records the error).
- ``tp_dp`` (R >= 2): tp/nccl_collectives.py's `mpi_tp_comm` sums a CUDA tensor and
  dp/nccl_reducer.py's `mpi_grad_reducer` averages CUDA gradients over all ranks, on the plane
  the ranks agree on (NCCL with one GPU per rank; through the host when they share one).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

from aioready.cuda.events import CUDAEventSource  # noqa: E402
from aioready.cuda.nccl import NcclPlane, nccl_missing  # noqa: E402
from aioready.launch import run  # noqa: E402
from aioready.transports.base import Message, MessageKind  # noqa: E402
from aioready.transports.mpi import MPITransport  # noqa: E402

comm = MPI.COMM_WORLD
RANK, SIZE = comm.Get_rank(), comm.Get_size()


def report(case: str, **fields: object) -> None:
    ok = np.zeros(1, np.int64)  # a buffer all-reduce: nothing pickled crosses ranks
    comm.Allreduce(np.array([int(bool(fields.get("ok")))], np.int64), ok, op=MPI.MIN)
    if RANK == 0:
        print("RESULT " + json.dumps({"case": case, "ranks": SIZE, **fields, "ok": bool(ok[0])},
                                     default=str), flush=True)


async def drained(source: CUDAEventSource, stream: torch.cuda.Stream) -> None:
    """Await the work queued on `stream` so far, as a CUDA event (never a synchronize)."""
    done = torch.cuda.Event()
    done.record(stream)
    await asyncio.wait_for(source.add(done, stream.cuda_stream), 60)


async def nccl_self(device: torch.device) -> None:
    from cupy.cuda import nccl
    plane = NcclPlane(comm, device, p2p=False)
    stream = torch.cuda.Stream(device)
    x = torch.arange(1 << 20, dtype=torch.float32, device=device) * (RANK + 1)
    y = torch.empty_like(x)
    stream.wait_stream(torch.cuda.current_stream(device))
    nccl.groupStart()  # a send to oneself completes only together with its receive
    plane.world.send(x.data_ptr(), x.numel(), nccl.NCCL_FLOAT32, RANK, stream.cuda_stream)
    plane.world.recv(y.data_ptr(), y.numel(), nccl.NCCL_FLOAT32, RANK, stream.cuda_stream)
    nccl.groupEnd()
    source = CUDAEventSource(wake="poll")
    await drained(source, stream)
    self_ok = bool(torch.equal(x, y))
    z = torch.full((1000,), float(RANK + 1), dtype=torch.float64, device=device)
    plane.all_reduce_(z)
    await drained(source, torch.cuda.current_stream(device))
    reduce_ok = bool((z == SIZE * (SIZE + 1) / 2).all())
    source.close()
    plane.close()
    report("nccl_self", ok=self_ok and reduce_ok, send_to_self=self_ok, allreduce=reduce_ok)


def payload(m: int, device: torch.device) -> tuple:
    g = torch.Generator().manual_seed(m)
    n = 5 + 37 * m
    return (torch.randn(n, 64, generator=g).to(device), None,
            torch.randn(3, n, generator=g).bfloat16().to(device),
            torch.empty(0, 8, device=device), torch.randn(256, 1024, generator=g).to(device))


def same(a: tuple, b: tuple) -> bool:
    return all((x is None and y is None) or (x is not None and y is not None and
               x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y))
               for x, y in zip(a, b))


async def transport_case(device: torch.device) -> None:
    try:
        t = MPITransport(comm, device=device, gpu_plane=os.environ.get("AIOREADY_GPU_PLANE"))
    except Exception as exc:  # NCCL refusing ranks on one GPU lands here, on every rank
        report("transport", ok=False, error=f"{type(exc).__name__}: {exc}"[:1500])
        return
    got: dict[int, tuple] = {}
    t.open(lambda msg: got.__setitem__(msg.microbatch, msg.tensors))
    peer, count = 1 - RANK, 4
    if RANK < 2:
        if RANK == 0:
            for m in range(count):
                t.send_nowait(peer, Message(0, MessageKind.ACTIVATION, 1, m, payload(m, device)))
        while len(got) < count:
            await asyncio.sleep(0.001)
        if RANK == 1:
            for m in range(count):
                t.send_nowait(peer, Message(0, MessageKind.GRADIENT, 0, m, got[m]))
        await t.wait_sent()
    ok = all(same(got[m], payload(m, device)) for m in range(count)) if RANK < 2 else True
    plane = t.gpu_plane
    comm.Barrier()
    await t.close()
    report("transport", ok=ok, plane=plane, messages=count)


async def tp_dp_case(device: torch.device) -> None:
    from aioready.dp.nccl_reducer import mpi_grad_reducer
    from aioready.tp.nccl_collectives import mpi_tp_comm
    plane = os.environ.get("AIOREADY_GPU_PLANE")
    tp = mpi_tp_comm(comm, device=device, gpu_plane=plane)
    x = torch.full((4096,), float(RANK + 1), dtype=torch.float32, device=device)
    tp.allreduce_tensor_(x)
    lin = torch.nn.Linear(64, 64).to(device)
    for p in lin.parameters():
        p.grad = torch.full_like(p, float(RANK))
    reducer = mpi_grad_reducer(comm, [list(lin.parameters())], gpu_plane=plane)
    reducer.reduce_nowait(0)
    await asyncio.wait_for(reducer.wait_reduced(), 60)
    source = CUDAEventSource(wake="poll")
    await drained(source, torch.cuda.current_stream(device))
    source.close()
    tp_ok = bool((x == SIZE * (SIZE + 1) / 2).all())
    dp_ok = all(bool((p.grad == (SIZE - 1) / 2).all()) for p in lin.parameters())
    kinds = [type(tp.plane).__name__, type(reducer).__name__]
    reducer.close()
    tp.close()
    report("tp_dp", ok=tp_ok and dp_ok, tp=tp_ok, dp=dp_ok, kinds=kinds)


async def main() -> None:
    count = torch.cuda.device_count()
    if not count:
        report("nccl_self", ok=False, error="no CUDA device visible to torch")
        return
    device = torch.device("cuda", RANK % count)
    torch.cuda.set_device(device)
    missing = nccl_missing()
    if missing is not None:
        report("nccl_self", ok=False, error=missing)
        return
    for name, case in (("nccl_self", nccl_self), ("transport", transport_case),
                       ("tp_dp", tp_dp_case)):
        if name != "nccl_self" and SIZE < 2:
            continue
        try:
            await case(device)
        except Exception:
            report(name, ok=False, error=traceback.format_exc()[-1500:])


if __name__ == "__main__":
    run(main())
