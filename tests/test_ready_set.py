"""ReadySet on its own: pop order in both modes, the entry-only gate and its cap, in-flight
accounting over chunks and backward pieces, statistics, and the errors of misuse."""

from __future__ import annotations

import pytest

from aioready.errors import ConfigError, InternalError
from aioready.ready_set import ReadySet, ReadySetStatistics
from aioready.schedulers import make_hint
from aioready.tasks import Task


def tasks(text: str) -> list[Task]:
    return [Task.parse(word) for word in text.split()]


def ready_set(order: str, *, cap: int, chunks: int = 1, split: bool = False,
              strict: bool = False) -> ReadySet:
    """A ReadySet whose hint rank is the position in `order`."""
    ranked = tasks(order)
    return ReadySet({t: i for i, t in enumerate(ranked)}, cap=cap, num_chunks=chunks,
                    split_backward=split, strict_order=ranked if strict else None)


def push(rs: ReadySet, text: str) -> None:
    for task in tasks(text):
        rs.push(task)


def drain(rs: ReadySet) -> list[str]:
    """Pop until nothing admissible is ready; the popped tasks as text."""
    out = []
    while (task := rs.pop_nowait()) is not None:
        out.append(str(task))
    return out


def pops(rs: ReadySet, text: str = "") -> list[str]:
    """Push the tasks of `text`, then pop until nothing admissible is ready."""
    push(rs, text)
    return drain(rs)


def run_done(rs: ReadySet, text: str) -> None:
    for task in tasks(text):
        rs.done(task)


# -- ready mode ------------------------------------------------------------------------------

def test_ready_mode_pops_by_hint_rank_not_by_push_order() -> None:
    rs = ready_set("F0 F1 B0 F2 B1 B2", cap=8)
    push(rs, "F2 F1 F0")
    assert len(rs) == 3 and [str(t) for t in rs.ready_tasks()] == ["F0", "F1", "F2"]
    assert drain(rs) == ["F0", "F1", "F2"]
    push(rs, "B2 B1 B0")
    assert drain(rs) == ["B0", "B1", "B2"]
    assert rs.pop_nowait() is None and len(rs) == 0


def test_ready_mode_compares_entry_forwards_with_the_other_heap() -> None:
    """F0 ranks before B0 and F1 after it: the two heaps interleave by rank."""
    rs = ready_set("F0 B0 F1 B1", cap=8)
    push(rs, "F1 B1 B0 F0")
    assert drain(rs) == ["F0", "B0", "F1", "B1"]


# -- the entry-only gate ---------------------------------------------------------------------

def test_gate_admits_up_to_the_cap_exactly_then_holds_only_entry_forwards() -> None:
    rs = ready_set("F0 F1 F2 F0c1 F1c1 B0c1 B0 F2c1 B1c1 B1", cap=2, chunks=2)
    push(rs, "F0 F1 F2")
    assert drain(rs) == ["F0", "F1"]  # the second admission reaches the cap exactly
    assert rs.in_flight == 2 and rs.in_flight_microbatches == [0, 1]
    assert len(rs) == 1  # F2 is ready but held back
    # deeper chunks and backward are never gated, even when they rank after the held F2
    push(rs, "F0c1 F1c1 B0c1 B0")
    assert drain(rs) == ["F0c1", "F1c1", "B0c1", "B0"]
    assert rs.in_flight == 2 and len(rs) == 1
    rs.done(Task.parse("B0c1"))
    assert rs.in_flight == 2  # one of microbatch 0's two backward pieces: still in flight
    rs.done(Task.parse("B0"))
    assert rs.in_flight == 1 and rs.in_flight_microbatches == [1]
    assert drain(rs) == ["F2"]  # room again: the held F2 enters
    assert rs.in_flight == 2 and rs.peak_in_flight == 2


def test_cap_of_one_runs_one_microbatch_at_a_time() -> None:
    rs = ready_set("F0 F1 B0 B1", cap=1)
    push(rs, "F0 F1")
    assert drain(rs) == ["F0"]
    push(rs, "B0")
    assert drain(rs) == ["B0"]
    assert drain(rs) == []  # B0 popped, not yet done: microbatch 0 still holds the slot
    rs.done(Task.parse("B0"))
    assert drain(rs) == ["F1"]
    assert rs.peak_in_flight == 1


# -- in-flight accounting --------------------------------------------------------------------

@pytest.mark.parametrize("split, last", [(False, "B"), (True, "W")])
def test_a_microbatch_leaves_after_its_last_backward_piece_on_every_chunk(split: bool,
                                                                         last: str) -> None:
    order = "F0 F0c1 F0c2 B0c2 B0c1 B0 W0c2 W0c1 W0" if split else \
        "F0 F0c1 F0c2 B0c2 B0c1 B0"
    rs = ready_set(order, cap=4, chunks=3, split=split)
    counts = []
    for task in tasks(order):
        rs.push(task)
        assert rs.pop_nowait() == task
        rs.done(task)
        counts.append(rs.in_flight)
    # admitted at F0 (chunk 0) only, released after the third `last` piece and not before
    assert counts == [1] * (len(counts) - 1) + [0]
    assert rs.peak_in_flight == 1
    if split:
        assert counts[tasks(order).index(Task.parse("B0"))] == 1  # B is not the last piece


def test_in_flight_counts_several_microbatches_and_keeps_the_peak() -> None:
    rs = ready_set("F0 F1 F2 B0 B1 B2", cap=3)
    push(rs, "F0 F1 F2")
    assert drain(rs) == ["F0", "F1", "F2"] and rs.in_flight == 3
    push(rs, "B1")
    assert drain(rs) == ["B1"]
    run_done(rs, "F0 F1 F2 B1")  # forwards ending release nothing
    assert rs.in_flight == 2 and rs.in_flight_microbatches == [0, 2]
    push(rs, "B0 B2")
    drain(rs)
    run_done(rs, "B0 B2")
    assert rs.in_flight == 0 and rs.peak_in_flight == 3


def test_strict_walk_of_a_hint_peaks_at_the_hints_own_default_cap() -> None:
    """Run each rank's 1F1B sequence in order: the ReadySet's peak is the cap the hint derives
    (hints.peak_in_flight), a separate walk over the same rule."""
    hint = make_hint("1f1b", num_stages=4, num_microbatches=8)
    for rank in range(4):
        order = hint.strict_order(rank)
        rs = ReadySet(hint.priority(rank), cap=8, num_chunks=1, split_backward=False,
                      strict_order=order)
        for task in order:
            rs.push(task)
            assert rs.pop_nowait() == task
            rs.done(task)
        assert rs.peak_in_flight == hint.default_caps[rank] == 4 - rank
        assert rs.in_flight == 0


# -- strict mode -----------------------------------------------------------------------------

def test_strict_mode_waits_for_the_next_task_in_order_even_when_others_are_ready() -> None:
    rs = ready_set("F0 F1 B0 F2 B1 B2", cap=8, strict=True)
    push(rs, "F1 F2")
    assert rs.next_in_order == Task.parse("F0")
    assert drain(rs) == []  # F1 and F2 ready, F0 not: nothing runs
    push(rs, "F0")
    assert drain(rs) == ["F0", "F1"]  # F2 is ready but B0 comes first
    assert rs.next_in_order == Task.parse("B0") and len(rs) == 1
    push(rs, "B1")
    assert drain(rs) == []
    push(rs, "B0")
    assert drain(rs) == ["B0", "F2", "B1"]
    push(rs, "B2")
    assert drain(rs) == ["B2"]
    assert rs.next_in_order is None and rs.pop_nowait() is None


def test_strict_mode_holds_the_entry_forward_at_the_cap() -> None:
    rs = ready_set("F0 B0 F1 B1", cap=1, strict=True)
    push(rs, "F0 F1")
    assert drain(rs) == ["F0"]
    push(rs, "B0")
    assert drain(rs) == ["B0"]
    assert drain(rs) == [] and rs.next_in_order == Task.parse("F1")  # B0 ran, not yet done
    assert rs.statistics() == ReadySetStatistics(num_ready=1, num_gated=1, in_flight=1,
                                                 peak_in_flight=1, cap=1)
    rs.done(Task.parse("B0"))
    assert drain(rs) == ["F1"] and rs.in_flight == 1


# -- statistics and repr ---------------------------------------------------------------------

def test_statistics_and_repr_in_ready_mode() -> None:
    rs = ready_set("F0 F1 F2 B0", cap=1)
    assert rs.statistics() == ReadySetStatistics(0, 0, 0, 0, 1)
    assert repr(rs) == "<ReadySet ready ready=0 gated=0 in_flight=0/1>"
    push(rs, "F0 F1 F2")
    assert rs.statistics() == ReadySetStatistics(3, 0, 0, 0, 1)  # under the cap: none gated
    drain(rs)
    push(rs, "B0")
    assert rs.statistics() == ReadySetStatistics(3, 2, 1, 1, 1)
    assert repr(rs) == "<ReadySet ready ready=3 gated=2 in_flight=1/1>"
    assert rs.cap == 1


def test_statistics_and_repr_in_strict_mode() -> None:
    rs = ready_set("F0 F1 F0c1 B0c1 B0 B1", cap=1, chunks=2, strict=True)
    push(rs, "F0 F1")
    drain(rs)
    push(rs, "F0c1")
    assert rs.statistics() == ReadySetStatistics(2, 1, 1, 1, 1)  # only F1 counts as gated
    assert repr(rs) == "<ReadySet strict ready=2 gated=1 in_flight=1/1>"


# -- misuse ----------------------------------------------------------------------------------

@pytest.mark.parametrize("split, piece", [(False, "B5"), (True, "W5")])
def test_last_backward_piece_of_a_never_admitted_microbatch_is_an_internal_error(
        split: bool, piece: str) -> None:
    rs = ready_set("F0 B0", cap=2, split=split)
    with pytest.raises(InternalError, match=f"task {piece}: backward piece of a microbatch "
                                            "that was never admitted"):
        rs.done(Task.parse(piece))
    assert rs.in_flight == 0


def test_done_for_a_piece_that_is_not_the_last_changes_nothing() -> None:
    rs = ready_set("F0 B0 W0", cap=2, split=True)
    run_done(rs, "F5 B5")  # neither is a split step's last piece: no bookkeeping at all
    assert rs.in_flight == 0 and rs.in_flight_microbatches == []


@pytest.mark.parametrize("cap", [0, -3])
def test_a_cap_below_one_is_a_config_error(cap: int) -> None:
    with pytest.raises(ConfigError, match=rf"cap must admit at least one microbatch "
                                          rf"\(expected >= 1, got {cap}\)"):
        ready_set("F0 B0", cap=cap)


def test_fresh_in_flight_keeps_the_rule_not_the_count() -> None:
    rs = ready_set("F0 F0c1 W0c1 W0", cap=2, chunks=2, split=True)
    push(rs, "F0")
    drain(rs)
    fresh = rs.flight.fresh()
    assert fresh.count == 0 and fresh.peak == 0
    fresh.admit(7)
    fresh.release(Task.parse("B7"))  # split rule: B is not the last piece
    fresh.release(Task.parse("W7c1"))
    assert fresh.count == 1  # two chunks: one W piece left
    fresh.release(Task.parse("W7"))
    assert fresh.count == 0 and rs.in_flight == 1
