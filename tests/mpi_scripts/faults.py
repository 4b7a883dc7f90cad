"""A rank receives a bad message; the job must end with a clear error within seconds.

Usage: mpiexec -n 2 python tests/mpi_scripts/faults.py malformed|unexpected|none
Rank 1 runs stage 1 of a 2-stage simulated pipeline (no torch); rank 0 is a raw sender that
sends a garbage header (malformed), a well-formed activation for a microbatch that does not
exist (unexpected), or the right messages (none: the control run, which must succeed).
"""

import asyncio
import sys

from mpi4py import MPI

from aioready.launch import run, say
from aioready.runtime.pipeline import Pipeline
from aioready.transports.base import Message, MessageKind
from aioready.transports.mpi import MPITransport

M = 4


async def sender(transport: MPITransport, what: str) -> None:
    got: list[Message] = []
    # the gradients only: a reserving receiver also sends advisory notices (forecast.py)
    transport.open(lambda msg: msg.kind is MessageKind.GRADIENT and got.append(msg))
    if what == "malformed":
        transport._hdr.Send(b"definitely not an aioready header", dest=1, tag=0)
    elif what == "unexpected":
        transport.send_nowait(1, Message(0, MessageKind.ACTIVATION, 1, 99))
    for m in range(M):
        transport.send_nowait(1, Message(0, MessageKind.ACTIVATION, 1, m))
    await transport.wait_sent()
    while len(got) < M:  # the gradients of the receiver's B tasks
        await asyncio.sleep(0.01)
    say("SENDER got", sorted(g.microbatch for g in got))
    await transport.close()


async def receiver(transport: MPITransport) -> None:
    pipe = Pipeline([None], None, microbatches=M, hint="1f1b", mode="ready",
                    transport=transport, device="cpu")
    await pipe.step()
    await transport.close()
    say("RECEIVER ran", [f"{s.kind.name}{s.microbatch}" for s in pipe.last_step.spans])


async def main() -> None:
    transport = MPITransport()
    if transport.rank == 0:
        await sender(transport, sys.argv[1])
    else:
        await receiver(transport)


if __name__ == "__main__":
    run(main())
