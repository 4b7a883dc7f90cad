"""Every hint x mode x split over TorchDistTransport, all ranks in this process: an in-process gloo
world (aioready.testing.gloo), one Pipeline per rank on one event loop, against the unsplit
model. The torchrun launches of tests/test_torchdist.py cover a subset; this covers the matrix
of tests/test_mpi.py at the cost of one process."""

from __future__ import annotations

import asyncio

import pytest
import torch
from test_mpi import cases

from aioready.runtime.pipeline import Pipeline
from aioready.schedulers import HINTS, make_hint
from aioready.testing.gloo import gloo_world
from aioready.testing.helpers import make_mlp_stages, mse_loss, reference_step
from aioready.transports.torchdist import TorchDistTransport

WIDTH, TOL = 16, 1e-10
pytestmark = pytest.mark.timeout(120)
_GROUPS: dict[int, list] = {}


def groups(n: int) -> list:
    """One gloo world per size for the whole module: transports close cleanly, so it is reused."""
    if n not in _GROUPS:
        _GROUPS[n] = gloo_world(n)
    return _GROUPS[n]


def batch(M: int, varlen: bool, seed: int) -> tuple[list, list]:
    gen = torch.Generator().manual_seed(seed)
    lens = [3 + (5 * m) % 7 for m in range(M)] if varlen else [4] * M
    xs = [torch.randn(2, L, WIDTH, generator=gen, dtype=torch.float64) for L in lens]
    ys = [torch.randn(2, L, WIDTH, generator=gen, dtype=torch.float64) for L in lens]
    return xs, ys


async def run_case(n: int, case: str) -> tuple[float, float]:
    hint_name, mode, split, varlen = case.split(":")
    split_b = split == "1"
    S, M = n * HINTS[hint_name].chunks, 2 * n
    hint = make_hint(hint_name, num_stages=S, num_ranks=n, num_microbatches=M,
                     split_backward=split_b)
    full = make_mlp_stages(S, width=WIDTH, seed=5)
    xs, ys = batch(M, varlen == "1", 6)
    transports = [TorchDistTransport(g) for g in groups(n)]
    pipes = [Pipeline([full[s] for s in hint.placement.stages_of(r)], mse_loss, microbatches=M,
                      hint=hint, mode=mode, transport=transports[r], split_backward=split_b)
             for r in range(n)]
    losses = await asyncio.gather(*(p.step(xs, ys) for p in pipes))
    await asyncio.gather(*(t.close() for t in transports))
    for p in pipes:
        p.close()
    ref_loss, ref = reference_step(make_mlp_stages(S, width=WIDTH, seed=5), mse_loss, xs, ys)
    (loss,) = [x for x in losses if x is not None]
    gdiff = max(float((p.grad - q.grad).abs().max()) for s in range(S)
                for p, q in zip(full[s].parameters(), ref[s].parameters()))
    return abs(float(loss) - float(ref_loss)), gdiff


@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.heavy)])  # 4: ~20-40 s
def test_every_hint_mode_split_exact_over_torch_distributed(n: int) -> None:
    async def main() -> list[tuple[str, float, float]]:
        return [(case, *await run_case(n, case)) for case in cases(n)]
    for case, ldiff, gdiff in asyncio.run(main()):
        assert ldiff <= TOL and gdiff <= TOL, (case, ldiff, gdiff)


def test_a_malformed_slot_is_a_protocol_error_naming_the_sender() -> None:
    """Bytes that are not an aioready header reach the receiver's on_failure as ProtocolError,
    with the sending rank; the transport raises it again from its later calls."""
    from aioready.errors import ProtocolError
    from aioready.transports.torchdist import HEADER_TAG

    async def main() -> list[BaseException]:
        a, b = (TorchDistTransport(g) for g in groups(2))
        failures: list[BaseException] = []
        b.open(lambda msg: None, on_failure=failures.append)
        a.open(lambda msg: None)
        junk = torch.zeros(64, dtype=torch.uint8)
        junk[:5] = torch.tensor([40, 0, 0, 0, 0], dtype=torch.uint8)  # 40 bytes of zeros
        groups(2)[0].send([junk], 1, HEADER_TAG).wait()
        while not failures:
            await asyncio.sleep(0.001)
        closed = await asyncio.gather(a.close(), b.close(), return_exceptions=True)
        assert closed[0] is None and closed[1] is failures[0], closed
        return failures
    (failure,) = asyncio.run(main())
    assert isinstance(failure, ProtocolError)
    assert str(failure).startswith("rank 1: header from rank 0 is not an aioready header "
                                   "(expected magic 0xa10d"), str(failure)
