"""Plans for several tensors and None slots (wire_plans.MultiPlans, ReceivePlans(none_slots=)):
the bytes of the general encoder, the messages of the general decoder, what they were not made
for left to the general path, and with the switch off the lone-tensor plans alone."""

from __future__ import annotations

import pytest
import torch
from conftest import EXACT_2, requires_mpi, switched
from test_wire_plans import general, learned, same_as_general

from aioready.transports.base import Message, MessageKind
from aioready.transports.wire import WireCodec
from aioready.transports.wire_plans import ReceivePlans, SendPlans

MULTI_TOKENS = {multi: EXACT_2.need(*switched({"AIOREADY_MPI_FAST": "1",
                                              "AIOREADY_MPI_PLANS_MULTI": multi,
                                              "AIOREADY_NATIVE_RECV_MULTI": "0"}, "multi"))[0]
                for multi in ("1", "0")}

LAYOUTS = {
    "activation-and-tags": lambda s: (torch.randn(2, 16, 32) + s, torch.arange(2) + s),
    "gradient-and-none": lambda s: (torch.randn(2, 16, 32) + s, None),
    "none-first": lambda s: (None, torch.randn(3, 5, dtype=torch.float64) + s),
    "header-only": lambda s: (),
    "three-and-a-scalar": lambda s: (torch.tensor(s > 0), torch.randn(7) + s,
                                     torch.tensor(2.5 + s, dtype=torch.float16)),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_multi_plans_write_and_read_what_the_general_path_does(name: str) -> None:
    codec = WireCodec()
    send, receive = SendPlans(codec, 1 << 16), ReceivePlans()
    for step in range(3):  # the first message teaches the receiver, the next ones use its plan
        tensors = LAYOUTS[name](step)
        msg = Message(step, MessageKind.GRADIENT, 2, 5 + step, tensors, tag=9)
        buf = same_as_general(codec, msg, send.encode(msg))
        got = receive.message(buf, 4)
        if step == 0:
            assert got is None  # nothing learned yet
            learned(codec, receive, buf)
            continue
        assert got == Message(step, MessageKind.GRADIENT, 2, 5 + step, got.tensors, 9, 4)
        assert len(got.tensors) == len(tensors)
        for a, b in zip(got.tensors, tensors):
            assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b))


def test_with_the_switch_off_only_lone_tensors_have_plans() -> None:
    codec = WireCodec()
    send, receive = SendPlans(codec, 1 << 16, multi=False), ReceivePlans(none_slots=False)
    msg = Message(0, MessageKind.GRADIENT, 2, 5, LAYOUTS["gradient-and-none"](0))
    assert send.encode(msg) is None
    buf = general(codec, msg)
    learned(codec, receive, buf)
    assert receive.message(buf, 0) is None  # a None slot: the general decoder
    on = ReceivePlans(none_slots=True)
    learned(codec, on, buf)
    assert on.message(buf, 0) is not None


def test_the_multi_plan_declines_what_it_was_not_made_for() -> None:
    send = SendPlans(WireCodec(), 1 << 10)
    m = lambda *ts: Message(0, MessageKind.ACTIVATION, 1, 0, ts)  # noqa: E731
    base = torch.randn(6, 5)
    assert send.encode(m(base, base)) is not None
    for msg in (m(None, None), m(base, base.t()), m(base, torch.zeros(0)),
                m(base, torch.zeros(1 << 8)), m(base, base.to_sparse()), m(base, "text"),
                m(base, torch.randn(3)._neg_view()), m(base, torch.zeros(2, dtype=torch.cfloat))):
        assert send.encode(msg) is None, msg.tensors
    assert send.encode(m(base, base.t().contiguous())) is not None




@pytest.mark.mpi
@requires_mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("multi", ["1", "0"], ids=["multi-plans", "switch-off"])
def test_several_tensors_and_none_slots_there_and_back_over_mpi(multi: str) -> None:
    """Rank 0 sends messages of several tensors and None slots, rank 1 echoes each: the same
    values, dtypes, shapes and None slots come back; the receive plans took the messages with a
    None slot only with the switch on."""
    # the Python receive plans are what this counts: the compiled helper's C views of the same
    # plans (AIOREADY_NATIVE_RECV_MULTI) have their own test in test_mpi_native.py
    token = MULTI_TOKENS[multi]
    line = EXACT_2.results([token])[token]  # one launch other modules share
    fields = dict(kv.split("=", 1) for kv in line.split())
    assert fields["bad"] == "0", line
    assert (int(fields["taken"]) > 0) if multi == "1" else fields["taken"] == "0", line
