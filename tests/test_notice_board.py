"""The notice board (aioready/transports/notice_board.py, docs/hot_path.md "Notices through a
shared-memory board"): its rings in C keep each sender's records in order, refuse a record when
full (the notice then goes as a Message), and serve several senders; a runtime posts its notices
there dated by the task's start, reads them where its forecast is consulted (the rest dropped
at the step's end), checks them as a notice's header is checked, ignores one whose message came
first but for its duration; an in-process pipeline whose endpoints share a board equals the
unsplit model with every notice on the board; a sealed transport offers no board."""

from __future__ import annotations

import math
import mmap
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

import aioready
from aioready.errors import ProtocolError
from aioready.runtime.notices import NOTICE_B
from aioready.tasks import Kind, Task
from aioready.testing.helpers import make_mlp_stages, max_grad_diff, mse_loss, reference_step
from aioready.transports import native
from aioready.transports.base import WrappedTransport
from aioready.transports.notice_board import (
    MAX_RANKS,
    SLOTS,
    NoticeBoard,
    board_bytes,
    notice_board,
)
from aioready.transports.secure import SecureTransport

TOL = 1e-10


@pytest.fixture(autouse=True)
def _helper_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The board needs the compiled helper, also in a run with the fast paths switched off."""
    monkeypatch.setenv("AIOREADY_MPI_NATIVE", "1")


def boards(n: int) -> list[NoticeBoard]:
    """The views of n ranks (world ranks 0..n-1) of one board in an anonymous mapping."""
    module = native.load()
    assert module is not None, native.status()  # make test builds it
    shared = mmap.mmap(-1, board_bytes(module, n))
    slots = {r: r for r in range(n)}
    return [NoticeBoard(module, shared, slots, r) for r in range(n)]


def records(board: NoticeBoard, step: int = 0) -> list[tuple[Any, ...]]:
    got: list[tuple[Any, ...]] = []
    board.read(lambda *fields: got.append(fields), step)
    return got


def test_records_arrive_in_order_with_their_fields() -> None:
    b0, b1 = boards(2)
    sent = [(3, 1, m, (NOTICE_B if m % 2 else 0) | (1000 + m), 12.5 + m / 3) for m in range(5)]
    for fields in sent:
        assert b0.post(1, *fields)
    assert records(b0, 3) == []  # nothing for rank 0
    assert records(b1, 3) == sent
    assert records(b1, 3) == []  # read once
    assert (b0.num_posted, b1.num_read) == (5, 5)
    assert not b0.post(1, 1 << 32, 0, 0, 0, 0.0)  # a field the record cannot hold: MPI's way
    assert not b0.post(7, 0, 0, 0, 0, 0.0)  # not a local rank
    assert not b0.post(0, 0, 0, 0, 0, 0.0)  # itself: no ring


def test_a_full_ring_refuses_until_read() -> None:
    b0, b1 = boards(2)
    for m in range(SLOTS):
        assert b0.post(1, 0, 1, m, 0, 0.0)
    assert not b0.post(1, 0, 1, SLOTS, 0, 0.0)
    assert b0.num_full == 1
    assert [r[2] for r in records(b1)] == list(range(SLOTS))
    assert b0.post(1, 0, 1, SLOTS, 0, 0.0)  # room again; the ring wraps around
    assert [r[2] for r in records(b1)] == [SLOTS]


def test_several_senders_and_a_reader_that_raises() -> None:
    b0, b1, b2 = boards(3)
    assert b0.post(1, 0, 1, 0, 0, 1.0) and b2.post(1, 0, 1, 1, 0, 2.0)
    assert b2.post(1, 0, 1, 2, 0, 3.0) and b1.post(0, 0, 0, 9, 0, 4.0)
    assert sorted(r[2] for r in records(b1)) == [0, 1, 2]
    assert [r[2] for r in records(b0)] == [9] and records(b2) == []
    assert b0.post(1, 0, 1, 5, 0, 0.0) and b0.post(1, 0, 1, 6, 0, 0.0)

    def boom(*fields: Any) -> None:
        raise ValueError(fields[2])

    with pytest.raises(ValueError, match="5"):
        b1.read(boom, 0)
    assert [r[2] for r in records(b1)] == [6]  # the one that raised is consumed, not the rest
    b1.close()
    assert b1.read(boom, 0) == 0 and not b1.post(0, 0, 0, 0, 0, 0.0)


def test_counters_out_of_bounds_are_a_protocol_error() -> None:
    """A ring's head is a peer's word: one that claims more records than the ring holds is
    refused, not read around the ring."""
    b0, b1 = boards(2)
    assert b0.post(1, 0, 1, 0, 0, 0.0)
    ring = b0._slot[1]
    head = ring * board_bytes(native.load(), 1)  # the ring's first bytes: its head
    b0._view[head:head + 8] = np.frombuffer((SLOTS + 5).to_bytes(8, "little"), np.uint8)
    with pytest.raises(ProtocolError, match="out of bounds"):
        b1.read(lambda *fields: None, 0)


@pytest.mark.parametrize("size,switch", [(2, "0"), (MAX_RANKS + 1, "1")])
def test_no_board_without_a_collective_where_it_is_off_or_too_large(
        monkeypatch: pytest.MonkeyPatch, size: int, switch: str) -> None:
    """The switch off, or more ranks than MAX_RANKS: None on every rank before any collective
    (a world whose collectives raise)."""
    monkeypatch.setenv("AIOREADY_NOTICE_BOARD", switch)

    def collective(*_: Any) -> None:
        raise AssertionError("a collective was called")

    world = SimpleNamespace(Get_size=lambda: size, Get_rank=lambda: 0, Bcast=collective,
                            Split_type=collective)
    assert notice_board(SimpleNamespace(), world, native.load()) is None


class FullBoard:
    """A board whose every ring is full: each notice falls back to a Message."""

    def __init__(self) -> None:
        self.num_refused = 0

    def post(self, *fields: Any) -> bool:
        self.num_refused += 1
        return False

    def read(self, on_record: Any, step: int) -> int:
        return 0


def pipeline(S: int, M: int, board: str = "board", **kwargs: Any
             ) -> tuple[aioready.Pipeline, list[Any]]:
    """`board`: "board" (one shared board), "full" (FullBoard each), "none"."""
    pipe = aioready.Pipeline(make_mlp_stages(S, seed=S), mse_loss, microbatches=M, **kwargs)
    shared: list[Any] = boards(S) if board != "full" else [FullBoard() for _ in range(S)]
    for rt in pipe.runtimes:
        if board != "none":
            rt.transport.notice_board = shared[rt.rank]  # type: ignore[attr-defined]
    return pipe, shared


def batch(M: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return ([torch.randn(3, 16, generator=gen, dtype=torch.float64) for _ in range(M)],
            [torch.randn(3, 16, generator=gen, dtype=torch.float64) for _ in range(M)])


@pytest.mark.parametrize("board", ["board", "full", "none"])
@pytest.mark.parametrize("hint,split,policy", [("1f1b", False, "reserve"),
                                               ("1f1b", True, "drain")])
async def test_a_pipeline_with_a_board_equals_the_unsplit_model(hint: str, split: bool,
                                                                policy: str, board: str) -> None:
    """Endpoints that share a board: every notice posted there (no NOTICE message), each read,
    the loss and gradients those of the unsplit model; without one, or with every ring full,
    notices are Messages."""
    S, M, steps = 3, 6, 2
    pipe, shared = pipeline(S, M, board, hint=hint, mode="ready", policy=policy,
                            split_backward=split)
    xs, ys = batch(M)
    sent_before = [rt.transport.num_sent for rt in pipe.runtimes]
    for _ in range(steps):
        for rt in pipe.runtimes:
            for p in rt.executors[0].module.parameters():  # type: ignore[index]
                p.grad = None
        loss = await pipe.step(xs, ys)
    pipe.close()
    data = 2 * (S - 1) * M * steps  # activations and gradients
    messages = sum(rt.transport.num_sent for rt in pipe.runtimes) - sum(sent_before)
    if board == "full":  # each refused notice went as a Message
        refused = sum(b.num_refused for b in shared)
        assert refused > 0 and messages == data + refused
    else:
        posted = sum(b.num_posted for b in shared)
        assert sum(b.num_full for b in shared) == 0
        read, skipped = (sum(b.num_read for b in shared), sum(b.num_skipped for b in shared))
        assert read + skipped == posted  # read where consulted, the rest dropped at step ends
        if board == "board":  # no notice went as a Message; the drain consults the forecast
            assert posted > 0 and messages == data and (read > 0 or policy != "drain")
        else:
            assert posted == 0 and messages > data
    stages = make_mlp_stages(S, seed=S)
    ref_loss, ref = reference_step(stages, mse_loss, xs, ys)
    assert abs(float(loss) - float(ref_loss)) <= TOL
    assert max_grad_diff([rt.executors[0].module for rt in pipe.runtimes], ref) <= TOL


def runtime_of(pipe: aioready.Pipeline, rank: int) -> Any:
    rt = pipe.runtimes[rank]
    rt.step_index, rt._active = 4, True
    rt.failed = []
    rt.fail = rt.failed.append
    return rt


def test_board_records_are_checked_dated_by_the_sender_and_stale_ones_ignored() -> None:
    pipe, _ = pipeline(3, 4, hint="1f1b", mode="ready")
    rt = runtime_of(pipe, 1)
    rt.forecast.new_step(lambda: 100.0)
    f2 = rt._own(Task(Kind.F, 2, 0))
    rt._missing = {f2: 1, rt._own(Task(Kind.B, 1, 0)): 0}
    rt._board_notice(4, 1, 2, 2_000_000, 90.0)  # F2 of stage 1, 2 s from 90.0
    assert rt.forecast.earliest_arrival(f2) == 92.0  # the sender's date, not the reading's
    rt._board_notice(4, 1, 1, NOTICE_B | 5_000_000, 95.0)  # B1 arrived already: ignored
    assert rt.forecast._expected.keys() == {f2}
    assert rt.forecast._feeder[(0, Kind.B)] == 5.0  # but for its feeder's duration (read late)
    rt._board_notice(3, 1, 3, 1, 90.0)  # another step's: dropped
    assert rt.failed == []
    for fields in ((4, 0, 0, 1, 1.0), (4, 1, 9, 1, 1.0), (4, 1, 3, 1, math.nan),
                   (4, 1, 3, 1, math.inf)):
        rt._board_notice(*fields)
    assert [type(e) for e in rt.failed] == [ProtocolError] * 4, rt.failed
    assert "not finite" in str(rt.failed[2]) and "does not hold" in str(rt.failed[0])
    pipe.close()


def test_a_sealed_transport_offers_no_board() -> None:
    """SecureTransport wraps the MPI transport (a WrappedTransport): notices through it are
    sealed Messages, never records of a board the inner transport has."""
    inner = SimpleNamespace(notice_board=boards(2)[0], rank=0, world_size=2)
    sealed = SecureTransport(inner, key=bytes(range(32)), session=b"board")  # type: ignore
    assert isinstance(sealed, WrappedTransport)
    assert getattr(sealed, "notice_board", None) is None
