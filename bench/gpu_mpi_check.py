"""MPI ranks on the GPU: exactness of a pipeline over MPITransport with CUDADevice stages.

Usage: mpiexec -n R python3 bench/gpu_mpi_check.py. Every rank holds one stage of a float64 MLP
on GPU `rank % device_count` (its own stream), activations and gradients cross ranks through
MPITransport (CUDA-aware MPI, or pinned host staging when the library is not), and each rank
compares its gradients with the unsplit model run on the same GPU. Rank 0 prints one RESULT line
per case, as JSON. Run by bench/gpu_check.py; needs mpi4py and a GPU.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

from aioready.devices.cuda import CUDADevice  # noqa: E402
from aioready.launch import run  # noqa: E402
from aioready.runtime.pipeline import Pipeline  # noqa: E402
from aioready.testing.helpers import make_mlp_stages, mse_loss, reference_step  # noqa: E402
from aioready.transports.mpi import MPITransport  # noqa: E402


def max_all(comm: MPI.Comm, value: float) -> float:
    out = np.zeros(1)
    comm.Allreduce(np.array([value]), out, op=MPI.MAX)
    return float(out[0])


async def case(comm: MPI.Comm, mode: str, split: bool, width: int, M: int) -> dict:
    rank, size = comm.Get_rank(), comm.Get_size()
    gpu = torch.cuda.is_available()  # without one, the same check on CPU (to test the script)
    dev = torch.device("cuda", rank % torch.cuda.device_count()) if gpu else torch.device("cpu")
    full = [s.to(dev) for s in make_mlp_stages(size, width=width, seed=7)]
    gen = torch.Generator().manual_seed(8)
    lens = [3 + (5 * m) % 7 for m in range(M)]  # variable-length microbatches
    xs = [torch.randn(2, L, width, generator=gen, dtype=torch.float64).to(dev) for L in lens]
    ys = [torch.randn(2, L, width, generator=gen, dtype=torch.float64).to(dev) for L in lens]
    transport = MPITransport(comm, device=dev if gpu else None)
    pipe = Pipeline([full[rank]], mse_loss, microbatches=M, mode=mode, transport=transport,
                    split_backward=split,
                    device=(lambda r: CUDADevice(r)) if gpu else "cpu")
    comm.Barrier()
    t0 = time.perf_counter()
    loss = await pipe.step(xs, ys)
    if gpu:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    await transport.close()
    pipe.close()
    ref_loss, ref = reference_step(make_mlp_stages(size, width=width, seed=7), mse_loss,
                                   [x.cpu() for x in xs], [y.cpu() for y in ys])
    gdiff = max((float((p.grad.cpu() - q.grad).abs().max())
                 for p, q in zip(full[rank].parameters(), ref[rank].parameters())), default=0.0)
    ldiff = abs(float(loss) - float(ref_loss)) if loss is not None else 0.0
    return {"ranks": size, "mode": mode, "split_backward": split, "width": width,
            "cuda_aware": transport.cuda_aware, "loss_diff": max_all(comm, ldiff),
            "grad_diff": max_all(comm, gdiff), "wall_s": max_all(comm, wall)}


async def main() -> None:
    comm = MPI.COMM_WORLD
    for width in (16, 2048):  # 2048: payloads past the inline size, through the staged path
        for mode in ("strict", "ready"):
            for split in (False, True):
                res = await case(comm, mode, split, width, 2 * comm.Get_size())
                res["ok"] = res["loss_diff"] <= 1e-10 and res["grad_diff"] <= 1e-10
                if comm.Get_rank() == 0:
                    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    run(main())
