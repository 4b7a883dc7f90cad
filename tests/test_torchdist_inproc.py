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


@pytest.mark.parametrize("n, plans", [(2, "1"), (2, "0"),  # "0": AIOREADY_TORCH_PLANS=0
                                      pytest.param(4, "1", marks=pytest.mark.heavy)])  # ~20-80 s
def test_every_hint_mode_split_exact_over_torch_distributed(
        n: int, plans: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOREADY_TORCH_PLANS", plans)
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


def test_inline_payloads_arrive_bit_exact_whatever_their_layout() -> None:
    """Payloads copied into the slot from the tensors' storage (SendSlots.inline): views that
    are not contiguous, an offset into a larger storage, odd lengths (padding), bfloat16,
    tensors that require grad, lazy conjugates and negations, an empty tensor and None arrive
    equal to what was sent; a payload larger than the slot takes the two-transfer path and
    arrives equal too."""
    from aioready.transports.base import Message, MessageKind
    from aioready.transports.torch_groups import cpu_ops

    gen = torch.Generator().manual_seed(3)
    base = torch.randn(6, 10, generator=gen, dtype=torch.float64)
    sent = [
        (base.t(), torch.arange(7, dtype=torch.uint8)),  # not contiguous; 7 bytes: padded
        (base[2:4], torch.randn(5, generator=gen).to(torch.bfloat16)),  # storage offset
        (torch.randn(3, generator=gen, requires_grad=True), None, torch.empty(0, 4)),
        (torch.randint(-9, 9, (3, 5), generator=gen).t(),),
        (torch.randn(40_000, generator=gen, dtype=torch.float64),),  # 320 kB: past the slot
        # lazy views whose memory holds the other sign: a conjugate, and its imaginary part
        (torch.randn(3, generator=gen, dtype=torch.complex64).conj(),
         torch.randn(4, generator=gen, dtype=torch.complex64).conj().imag),
    ]

    async def main() -> list[Message]:
        a, b = (TorchDistTransport(g) for g in groups(2))
        got: list[Message] = []
        b.open(got.append)
        a.open(lambda msg: None)
        for i, tensors in enumerate(sent):
            a.send_nowait(1, Message(0, MessageKind.ACTIVATION, 1, i, tensors))
        while len(got) < len(sent):
            await asyncio.sleep(0.001)
        await asyncio.gather(a.close(), b.close())
        return got

    got = sorted(asyncio.run(main()), key=lambda m: m.microbatch)
    assert [m.microbatch for m in got] == list(range(len(sent)))
    for msg, tensors in zip(got, sent):
        assert len(msg.tensors) == len(tensors), msg
        for out, want in zip(msg.tensors, tensors):
            if want is None:
                assert out is None
                continue
            assert out.dtype == want.dtype and out.shape == want.shape, (out, want)
            assert torch.equal(out, want.detach()), (msg.microbatch, out, want)
    group = groups(2)[0]
    assert cpu_ops(group) is group  # a bare gloo backend is used as it is


@pytest.mark.parametrize("plans", ["1", "0"], ids=["plans", "AIOREADY_TORCH_PLANS=0"])
def test_repeated_layouts_take_the_plans_and_arrive_bit_exact(
        plans: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A layout sent again is framed by its plan (SendSlots.one) and read by the receiver's
    (wire_plans.ReceivePlans): every header field and every value still arrives as sent, also
    when a later tensor of that layout is a lazy negation or not contiguous (no plan: the
    general path resolves it), and when two layouts give slots of one length. With the plans
    switched off nothing takes them and everything arrives the same."""
    monkeypatch.setenv("AIOREADY_TORCH_PLANS", plans)
    from aioready.transports.base import Message, MessageKind

    gen = torch.Generator().manual_seed(11)
    x = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    sent = [
        x, x * 2, -x, torch.randn(6, 4, generator=gen, dtype=torch.float64).t(),
        torch.randn(4, 6, generator=gen, dtype=torch.float64).neg(),  # plain, negated values
        torch.randn(4, 6, generator=gen, dtype=torch.float64)._neg_view(),  # lazy negation
        torch.arange(24, dtype=torch.int64).reshape(6, 4),  # same bytes, other shape
        torch.arange(24, dtype=torch.int64).reshape(6, 4) + 1,
        torch.arange(3, dtype=torch.uint8), torch.arange(3, dtype=torch.uint8) + 7,  # padded
    ]
    kinds = [MessageKind.ACTIVATION, MessageKind.GRADIENT]

    async def main() -> tuple[list[Message], int]:
        a, b = (TorchDistTransport(g) for g in groups(2))
        got: list[Message] = []
        b.open(got.append)
        a.open(lambda msg: None)
        for i, t in enumerate(sent):
            a.send_nowait(1, Message(7 + i, kinds[i % 2], 2 + i, i, (t,), tag=100 + i))
        while len(got) < len(sent):
            await asyncio.sleep(0.001)
        planned = min(0 if b._plans is None else len(b._plans._by_len),
                      sum(p is not None for p in a._slots._plans._plans.values()))
        await asyncio.gather(a.close(), b.close())
        return got, planned

    got, planned = asyncio.run(main())
    if plans == "1":
        assert planned >= 2  # both sides learnt plans, so later messages took them
    else:
        assert planned == 0
    got.sort(key=lambda m: m.microbatch)
    for i, (msg, want) in enumerate(zip(got, sent)):
        assert (msg.step, msg.kind, msg.stage, msg.microbatch, msg.tag, msg.source) == \
            (7 + i, kinds[i % 2], 2 + i, i, 100 + i, 0), msg
        (out,) = msg.tensors
        assert out.dtype == want.dtype and out.shape == want.shape, (i, out, want)
        assert torch.equal(out, want.resolve_neg()), (i, out, want)


def test_cpu_ops_is_the_groups_gloo_backend_where_it_has_one() -> None:
    from aioready.transports.torch_groups import cpu_ops

    class Group:  # what cpu_ops reads of a ProcessGroup
        def __init__(self, backends: dict[str, str]) -> None:
            self.backends = backends

        def _get_backend(self, device: torch.device) -> str:
            return self.backends[device.type]  # KeyError: none for that device, as torch raises

    assert cpu_ops(Group({"cpu": "gloo", "cuda": "nccl"})) == "gloo"
    nccl_only = Group({"cuda": "nccl"})
    assert cpu_ops(nccl_only) is nccl_only
