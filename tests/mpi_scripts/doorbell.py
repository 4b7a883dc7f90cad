"""A parked rank is woken by its peer's doorbell (transports/doorbell.py).

Usage: mpiexec -n 2 python tests/mpi_scripts/doorbell.py
Rank 1 waits (its engine told that its arbiter waits) for three messages that rank 0 sends 0.2 s
apart, long enough for rank 1 to leave its spin window and park. Rank 1 prints one RESULT line:
the messages it got, its engine's doorbell parks, how many times rank 0 rang, and how many
rings delivered their message in the ring's callback.
"""

import asyncio
import time

import numpy as np
import torch
from mpi4py import MPI

from aioready.launch import run
from aioready.progress import ProgressEngine
from aioready.transports.base import Message, MessageKind
from aioready.transports.mpi import MPITransport


async def main() -> None:
    comm = MPI.COMM_WORLD
    transport = MPITransport(comm)
    loop = asyncio.get_running_loop()
    got: list[int] = []
    done = loop.create_future()

    def deliver(msg: Message) -> None:
        got.append(int(msg.tensors[0][0]))
        if len(got) == 3:
            done.set_result(None)

    transport.open(deliver)
    engine = ProgressEngine.for_loop()
    comm.Barrier()
    if comm.Get_rank() == 0:
        for i in range(3):
            time.sleep(0.2)
            transport.send_nowait(1, Message(0, MessageKind.ACTIVATION, 1, i,
                                             (torch.tensor([i + 10]),)))
            await transport.wait_sent()
    else:
        engine.set_waiting(True)
        await asyncio.wait_for(done, 30)
    bell = getattr(transport, "_bell", None)
    rung = np.array([0 if bell is None else bell.num_rung], np.int64)
    comm.Bcast(rung, root=0)
    if comm.Get_rank() == 1:
        print(f"RESULT got={','.join(map(str, got))} doorbell_parks="
              f"{engine.num_doorbell_parks} rung={int(rung[0])} "
              f"ring_polls={engine.num_ring_polls}", flush=True)
    await transport.close()


if __name__ == "__main__":
    run(main())
