"""Tensors through MPITransport (2 ranks): values, dtypes and shapes arrive intact.

Usage: mpiexec -n 2 python cuda_roundtrip.py [cuda|fake|cpu]. Rank 0 sends tensors (small ones
that would travel inline on the CPU, large ones, a None slot, bfloat16, a non-contiguous view)
in two rounds with a barrier between them; rank 1 receives them and compares with the same
tensors rebuilt from the seed. Prints the path (CUDA-aware or staged) and OK.

- `cuda` (the default): CUDA tensors, received onto the CUDA device. On the staged path every
  pinned buffer must be back in its pool at the end, and the second round must reuse the
  first round's.
- `fake`: the same checks without a GPU (see `install_fake_cuda`), on the staged path only:
  the transport's own control flow is real, the copies are stand-ins.
- `cpu`: CPU tensors, which never take a CUDA path whatever AIOREADY_MPI_CUDA_AWARE says.
"""

import asyncio
import logging
import sys

import torch
from mpi4py import MPI

from aioready.cuda.mpi import HostStager, PinnedPool
from aioready.launch import run, say
from aioready.transports import mpi as transport_mpi
from aioready.transports.base import Message, MessageKind
from aioready.transports.mpi import MPITransport

SHAPES = [((3,), torch.float32), ((2, 5), torch.float64), ((1024, 1024), torch.float32),
          ((7, 9), torch.bfloat16), ((4096, 33), torch.float16), ((), torch.int64)]
ROUNDS = [(0, 1), (2, 3)]  # microbatches; the second round may reuse the first's buffers
MICROBATCHES = 4


class FakeCudaTensor(torch.Tensor):
    """A CPU tensor that says it is on CUDA (the transport branches on `is_cuda`)."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


class FakeEvent:
    """Completes on its third query, and only then does the copy it stands for (`work`): a
    transport that used a buffer before awaiting its event would send or deliver zeros."""

    def __init__(self, *args: object, work: object = None, **kwargs: object) -> None:
        self.recorded = False
        self.queries = 0
        self.work = work

    def record(self, stream: object = None) -> None:
        self.recorded = True

    def query(self) -> bool:
        assert self.recorded, "an event was awaited that was never recorded"
        self.queries += 1
        if self.queries == 3 and self.work is not None:
            self.work()
        return self.queries >= 3


class FakeStream:
    cuda_stream = 0xF00

    def wait_event(self, event: FakeEvent) -> None:
        assert event.recorded, "a stream waits for an event that was never recorded"


class FakeStager(HostStager):
    """HostStager's pool and lending, over ordinary memory. Copies wait in a queue, the fake
    stream, and run in order when an event recorded after them completes."""

    def __init__(self, device: object = None, **kwargs: object) -> None:
        self._torch = torch
        self.device = torch.device("cuda", 0)
        self.wake = "poll"
        self.pool = PinnedPool(lambda n: torch.empty(n, dtype=torch.uint8),
                               key=lambda t: t.data_ptr())
        self._source = None
        self.stream = FakeStream()  # type: ignore[misc]
        self._queue: list = []

    def to_host(self, t: torch.Tensor, ready: object = None) -> tuple:
        self.stream.wait_event(ready)
        host = self.host_buffer(t.shape, t.dtype)
        host.zero_()
        return host, self._done(lambda: host.copy_(t.as_subclass(torch.Tensor)))

    def to_device(self, host: torch.Tensor, out: object = None) -> tuple:
        out = torch.zeros_like(host)
        return out.as_subclass(FakeCudaTensor), self._done(lambda: out.copy_(host))

    def _done(self, work: object) -> FakeEvent:
        self._queue.append(work)
        done = FakeEvent(work=lambda: self._run_until(work))
        done.record(self.stream)
        return done

    def _run_until(self, work: object) -> None:
        while any(w is work for w in self._queue):
            self._queue.pop(0)()


def install_fake_cuda() -> None:
    """`fake` mode: torch.cuda's events and streams, and the transport's HostStager, replaced
    by CPU stand-ins; messages carry FakeCudaTensors."""
    torch.cuda.Event = FakeEvent  # type: ignore[misc, assignment]
    torch.cuda.current_stream = lambda device=None: FakeStream()  # type: ignore[assignment]
    transport_mpi.HostStager = FakeStager  # type: ignore[misc]


def payload(m: int, mode: str) -> tuple:
    gen = torch.Generator().manual_seed(m)
    out = []
    for shape, dtype in SHAPES:
        out.append((torch.randn(shape, generator=gen) * 100).to(dtype))
    out.append(None)
    out.append(torch.arange(64, dtype=torch.float32).reshape(8, 8).t())  # a view
    if mode == "cuda":
        return tuple(None if t is None else t.to("cuda") for t in out)
    if mode == "fake":
        return tuple(None if t is None else t.as_subclass(FakeCudaTensor) for t in out)
    return tuple(out)


def check_pools(t: MPITransport, side: str) -> None:
    """Every pinned buffer went back to its pool; the second round reused them."""
    pools = {id(s.pool): s.pool for s in t._stagers.values()}
    assert pools, f"{side}: no staging pool was used"
    for pool in pools.values():
        assert pool.num_lent == 0, f"{side}: {pool.num_lent} pinned buffers never released"
        assert pool.num_reused > 0, f"{side}: pinned buffers were never reused"
    say(f"{side} pools lent=0 allocated={sum(p.num_allocated for p in pools.values())} "
        f"reused={sum(p.num_reused for p in pools.values())}")


async def main(mode: str) -> None:
    logging.basicConfig(level=logging.INFO)
    if mode == "fake":
        install_fake_cuda()
    comm = MPI.COMM_WORLD
    t = MPITransport(comm, device=None if mode == "cpu" else "cuda")
    got: dict[int, tuple] = {}
    t.open(lambda msg: got.__setitem__(msg.microbatch, msg.tensors))
    staged = mode != "cpu" and not t.cuda_aware
    assert staged or mode != "fake", "fake mode runs the staged path only: set the override to 0"
    for microbatches in ROUNDS:
        if t.rank == 0:
            for m in microbatches:
                t.send_nowait(1, Message(0, MessageKind.ACTIVATION, 1, m, payload(m, mode)))
            await t.wait_sent()
        else:
            while not all(m in got for m in microbatches):
                await asyncio.sleep(0.001)
        comm.Barrier()  # every buffer of this round is back in its pool
    if t.rank == 0:
        if staged:
            check_pools(t, "sender")
    else:
        assert len(got) == MICROBATCHES, sorted(got)
        for m in range(MICROBATCHES):
            want = payload(m, mode)
            for a, b in zip(got[m], want):
                if b is None:
                    assert a is None
                    continue
                assert a.is_cuda == (mode != "cpu") and a.dtype == b.dtype and \
                    a.shape == b.shape, (a, b)
                if mode == "fake":
                    a, b = a.as_subclass(torch.Tensor), b.as_subclass(torch.Tensor)
                assert torch.equal(a, b), f"microbatch {m}: values differ"
        if staged:
            check_pools(t, "receiver")
        if mode == "cpu":
            assert not t._stagers, "CPU tensors went through a CUDA staging path"
        say(f"{mode.upper()} OK cuda_aware={t.cuda_aware}")
    comm.Barrier()
    await t.close()


if __name__ == "__main__":
    run(main(sys.argv[1] if len(sys.argv) > 1 else "cuda"))
