"""The hint library without torch: literal orders (docs/hints.md "Reference orders", R=4, M=8),
documented peaks, validation over the whole grid, rule caps and the derived strict sequences."""

from __future__ import annotations

import pytest

from aioready.errors import HintError
from aioready.placement import Placement
from aioready.schedulers import HINTS, make_hint
from aioready.schedulers.listsched import list_schedule
from aioready.schedulers.rules import rule_caps
from aioready.tasks import Kind, Task

# docs/hints.md "Reference orders", copied verbatim (I = our B). Multi-chunk rows use torch's
# <stage><type><mb>.
LITERAL = {
    ("gpipe", False): ["F0 F1 F2 F3 F4 F5 F6 F7 B0 B1 B2 B3 B4 B5 B6 B7"] * 4,
    ("1f1b", False): [
        "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7",
        "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7",
        "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7",
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7"],
    ("interleaved-1f1b", False): [
        "0F0 0F1 0F2 0F3 4F0 4F1 4F2 4F3 0F4 0F5 0F6 4B0 0F7 4B1 4F4 4B2 4F5 4B3 4F6 0B0 4F7 0B1 0B2 0B3 4B4 4B5 4B6 4B7 0B4 0B5 0B6 0B7",  # noqa: E501
        "1F0 1F1 1F2 1F3 5F0 5F1 5F2 5F3 1F4 5B0 1F5 5B1 1F6 5B2 1F7 5B3 5F4 1B0 5F5 1B1 5F6 1B2 5F7 1B3 5B4 5B5 5B6 5B7 1B4 1B5 1B6 1B7",  # noqa: E501
        "2F0 2F1 2F2 2F3 6F0 6F1 6F2 6B0 6F3 6B1 2F4 6B2 2F5 6B3 2F6 2B0 2F7 2B1 6F4 2B2 6F5 2B3 6F6 6B4 6F7 6B5 6B6 6B7 2B4 2B5 2B6 2B7",  # noqa: E501
        "3F0 3F1 3F2 3F3 7F0 7B0 7F1 7B1 7F2 7B2 7F3 7B3 3F4 3B0 3F5 3B1 3F6 3B2 3F7 3B3 7F4 7B4 7F5 7B5 7F6 7B6 7F7 7B7 3B4 3B5 3B6 3B7"],  # noqa: E501
    ("zb-h1", True): [
        "F0 F1 F2 F3 I0 W0 F4 I1 W1 F5 I2 W2 F6 I3 W3 F7 I4 W4 I5 W5 I6 W6 I7 W7",
        "F0 F1 F2 I0 F3 I1 W0 F4 I2 W1 F5 I3 W2 F6 I4 W3 F7 I5 W4 I6 W5 I7 W6 W7",
        "F0 F1 I0 F2 I1 F3 I2 W0 F4 I3 W1 F5 I4 W2 F6 I5 W3 F7 I6 W4 I7 W5 W6 W7",
        "F0 I0 F1 I1 F2 I2 F3 I3 W0 F4 I4 W1 F5 I5 W2 F6 I6 W3 F7 I7 W4 W5 W6 W7"],
    ("zb-h2", True): [
        "F0 F1 F2 F3 F4 F5 F6 I0 W0 F7 I1 W1 I2 W2 I3 W3 I4 W4 I5 W5 I6 W6 I7 W7",
        "F0 F1 F2 F3 F4 F5 F6 I0 W0 I1 W1 I2 F7 I3 W2 I4 W3 I5 W4 I6 W5 W6 I7 W7",
        "F0 F1 F2 F3 I0 F4 I1 F5 I2 F6 I3 W0 I4 F7 I5 W1 I6 W2 W3 I7 W4 W5 W6 W7",
        "F0 I0 F1 I1 F2 I2 F3 I3 F4 I4 F5 I5 F6 I6 W0 F7 I7 W1 W2 W3 W4 W5 W6 W7"],
    ("zbv", True): [
        "0F0 0F1 0F2 0F3 0F4 0F5 0F6 7F0 7I0 7W0 7F1 7I1 7W1 7F2 7I2 7W2 7F3 7I3 7W3 0F7 0I0 0W0 7F4 7I4 7W4 0I1 0W1 7F5 7I5 7W5 0I2 0W2 7F6 7I6 7W6 0I3 0W3 7F7 7I7 7W7 0I4 0W4 0I5 0W5 0I6 0W6 0I7 0W7",  # noqa: E501
        "1F0 1F1 1F2 1F3 1F4 6F0 1F5 6F1 6I0 6W0 6F2 6I1 6W1 6F3 6I2 6W2 1F6 1I0 1W0 6F4 6I3 6W3 1F7 1I1 1W1 6F5 6I4 6W4 1I2 1W2 6F6 6I5 6W5 1I3 1W3 6F7 6I6 6W6 1I4 6I7 1I5 1W4 1I6 1W5 1I7 1W6 6W7 1W7",  # noqa: E501
        "2F0 2F1 2F2 5F0 2F3 5F1 2F4 5F2 5I0 5W0 5F3 5I1 5W1 2F5 2I0 2W0 5F4 5I2 5W2 2F6 2I1 2W1 5F5 5I3 5W3 2F7 2I2 2W2 5F6 5I4 5W4 2I3 2W3 5F7 5I5 5W5 2I4 5I6 2I5 5I7 2I6 2W4 2I7 2W5 5W6 5W7 2W6 2W7",  # noqa: E501
        "3F0 4F0 3F1 4F1 3F2 4F2 3F3 4F3 4I0 4W0 3F4 3I0 3W0 4F4 4I1 4W1 3F5 3I1 3W1 4F5 4I2 4W2 3F6 3I2 3W2 4F6 4I3 4W3 3F7 3I3 3W3 4F7 4I4 4W4 3I4 4I5 3I5 4I6 3I6 4I7 3I7 3W4 4W5 4W6 4W7 3W5 3W6 3W7"],  # noqa: E501
}

STAGES = {"linear": 4, "interleaved": 8, "v": 8}


def _task(word: str, place: Placement) -> Task:
    kind = {"F": Kind.F, "I": Kind.B, "B": Kind.B, "W": Kind.W}
    if word[0].isdigit():  # torch notation: stage, type, microbatch
        stage, letter, mb = int(word[0]), word[1], int(word[2:])
        return Task(kind[letter], mb, place.chunk_of(stage))
    return Task(kind[word[0]], int(word[1:]))


@pytest.mark.parametrize("name,split", sorted(LITERAL), ids=lambda x: str(x))
def test_literal_orders_r4_m8(name: str, split: bool) -> None:
    spec = HINTS[name]
    hint = make_hint(name, num_stages=STAGES[spec.style], num_microbatches=8,
                     split_backward=split)
    want = [tuple(_task(w, hint.placement) for w in row.split()) for row in LITERAL[name, split]]
    for rank in range(4):
        assert hint.orders[rank] == want[rank], f"{name} rank {rank}"


def test_bf_derives_1f1b_and_ranks_backward_first() -> None:
    bf = make_hint("bf", num_stages=4, num_microbatches=8)
    assert not bf.is_sequence
    assert bf.sequence == make_hint("1f1b", num_stages=4, num_microbatches=8).orders
    assert bf.orders[0][:2] == (Task(Kind.B, 0), Task(Kind.B, 1))
    bfw = make_hint("bfw", num_stages=4, num_microbatches=8, split_backward=True)
    kinds = [t.kind for t in bfw.orders[0]]
    assert kinds == [Kind.B] * 8 + [Kind.F] * 8 + [Kind.W] * 8


def _documented_peaks(name: str, R: int, M: int) -> tuple[list[int] | None, list[int]] | None:
    """(microbatches or None, chunk activations) per rank: docs/hints.md "Default caps" formulas.

    Interleaved: 2(R-1-r) + (v-1)*round + 1 chunk activations (Megatron's warmup + 1; the
    documented form has round = R), capped at v*M; its microbatch peak is documented only for
    R=4, M=8 (8,8,7,5). ZBV: 2R chunk activations and 2R-r microbatches, for M >= 2R-1.
    """
    v = 2
    if name == "gpipe":
        return [M] * R, [M] * R
    if name == "1f1b":
        p = [min(M, R - r) for r in range(R)]
        return p, p
    if name == "zb-h1":
        return [min(M, R)] * R, [min(M, R)] * R
    if name == "interleaved-1f1b":
        per_round = M // max(1, M // R)
        acts = [min(v * M, 2 * (R - 1 - r) + (v - 1) * per_round + 1) for r in range(R)]
        return ([8, 8, 7, 5] if (R, M) == (4, 8) else None), acts
    if name == "zbv" and M >= 2 * R - 1:
        return [min(M, 2 * R - r) for r in range(R)], [min(v * M, 2 * R)] * R
    return None


PEAK_CASES = [(n, s, R, M) for n, s in [("gpipe", False), ("1f1b", False), ("1f1b", True),
                                       ("zb-h1", True), ("interleaved-1f1b", False),
                                       ("zbv", True)]
              for R in (1, 2, 4) for M in (1, 4, 8, 16) if _documented_peaks(n, R, M)]


@pytest.mark.parametrize("name,split,R,M", PEAK_CASES)
def test_peaks_match_documented(name: str, split: bool, R: int, M: int) -> None:
    v = 1 if HINTS[name].style == "linear" else 2
    hint = make_hint(name, num_stages=R * v, num_microbatches=M, split_backward=split)
    mbs_doc, acts_doc = _documented_peaks(name, R, M)  # type: ignore[misc]
    assert [hint.peak_chunk_activations(r) for r in range(R)] == acts_doc
    mbs = [hint.peak(r) for r in range(R)]
    if mbs_doc is not None:
        assert mbs == mbs_doc
    assert list(hint.default_caps or ()) == mbs


def test_zb_h2_peak_is_2r_minus_1() -> None:
    hint = make_hint("zb-h2", num_stages=4, num_microbatches=8, split_backward=True)
    assert [hint.peak(r) for r in range(4)] == [7, 7, 7, 7]


def test_rule_caps_documented() -> None:
    lin = Placement(4, 4, "linear")
    assert rule_caps(lin, 8, "bf") == (4, 3, 2, 1)
    assert rule_caps(lin, 8, "bfw") == (8, 6, 4, 2)
    assert rule_caps(lin, 3, "bfw") == (3, 3, 3, 2)
    v = Placement(8, 4, "v")
    assert rule_caps(v, 8, "bf") == (8, 7, 6, 5)  # = ZBV's own microbatch peaks
    hint = make_hint("bf", num_stages=8, num_microbatches=8, placement="v")
    assert hint.default_caps == (8, 7, 6, 5) and hint.placement.style == "v"
    hint.check_sequence()


def test_rule_strict_sequence_respects_its_cap() -> None:
    hint = make_hint("bfw", num_stages=4, num_microbatches=16, split_backward=True)
    caps = hint.default_caps or ()
    assert all(hint.peak(r) <= caps[r] for r in range(4))
    again = list_schedule(hint.placement, 16, True, hint.orders, caps)
    assert again.orders == hint.sequence


def test_rule_is_not_a_sequence_without_derivation() -> None:
    hint = make_hint("bf", num_stages=4, num_microbatches=4)
    from dataclasses import replace
    bare = replace(hint, sequence=None)
    with pytest.raises(HintError, match="priority rule"):
        bare.check_sequence()


def test_make_hint_errors() -> None:
    with pytest.raises(HintError, match="unknown hint.*zb-h1"):
        make_hint("zb-h9", num_stages=4, num_microbatches=8)
    with pytest.raises(HintError, match="needs split_backward=True"):
        make_hint("zbv", num_stages=8, num_microbatches=8)
    with pytest.raises(HintError, match="own placement"):
        make_hint("1f1b", num_stages=4, num_microbatches=8, placement="v")
    with pytest.raises(HintError, match="cannot place 5 stages"):
        make_hint("zbv", num_stages=5, num_microbatches=8, split_backward=True)
    with pytest.raises(HintError, match="equal rounds"):
        make_hint("interleaved-1f1b", num_stages=8, num_microbatches=9)


def test_strict_check_names_rank_and_first_bad_task() -> None:
    from aioready.hints import HintOrder
    good = make_hint("1f1b", num_stages=2, num_microbatches=2)
    rows = [list(o) for o in good.orders]
    rows[1] = [Task(Kind.B, 0), Task(Kind.F, 0), Task(Kind.F, 1), Task(Kind.B, 1)]
    bad = HintOrder("mine", good.placement, 2, False, rows)
    with pytest.raises(HintError, match=r"rank 1, task B0: .*before a local task"):
        bad.check_sequence()
