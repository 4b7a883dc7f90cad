"""Run under mpiexec -n N: each rank makes known spans, rank 0 gathers and prints them as JSON."""

import asyncio
import json
import math

from mpi4py import MPI

from aioready.tasks import Kind
from aioready.telemetry.gather import gather_reports
from aioready.telemetry.spans import Span, StepReport


def report(step: int, rank: int, n: int) -> StepReport:
    spans = [Span(rank, rank, 0, m, kind, step + 0.1 * m, step + 0.1 * m + 0.01 * rank,
                  step + 0.1 * m + 0.05) for m in range(3) for kind in (Kind.F, Kind.B)]
    rep = StepReport(step, spans, start=step + 0.001 * (n - 1 - rank),
                     end=step + 1 + 0.001 * rank, num_ranks=n)
    rep.peak_in_flight[rank] = 3 - rank
    return rep


async def main() -> None:
    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    reports = [report(step, rank, n) for step in range(3)]
    # step 2 diverged: its NaN loss must arrive as NaN, not as "no loss"
    losses = [(float(step) + 0.5 if step < 2 else math.nan) if rank == n - 1 else None
              for step in range(3)]
    out = await gather_reports(reports, comm, losses=losses)
    if rank == 0:
        assert out is not None
        print(json.dumps([{"step": r.step, "start": r.start, "end": r.end,
                           "loss": loss if loss is None or math.isfinite(loss) else repr(loss),
                           "peaks": r.peak_in_flight, "num_ranks": r.num_ranks,
                           "spans": [[s.rank, s.stage, s.chunk, s.microbatch, int(s.kind),
                                      s.ready, s.start, s.end] for s in r.spans]}
                          for r, loss in out]))
    else:
        assert out is None


asyncio.run(main())
