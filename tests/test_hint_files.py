"""The text form of a hint: every hint round-trips, and bad files get errors that name the file,
the line and what was expected."""

from __future__ import annotations

from pathlib import Path

import pytest

from aioready.cli.hints import describe
from aioready.errors import HintError
from aioready.hints import HintOrder
from aioready.schedulers import HINTS, hint_names, make_hint

GOOD = """# aioready hint mine: stages=2 ranks=2 microbatches=2 placement=linear split_backward=false
F0 F1 B0 B1
F0 B0 F1 B1
"""


def _every_hint() -> list[HintOrder]:
    out = []
    for name in hint_names():
        split = bool(HINTS[name].needs_split)
        out.append(make_hint(name, num_stages=8, num_microbatches=4, split_backward=split))
    return out


@pytest.mark.parametrize("hint", _every_hint(), ids=lambda h: h.name)
def test_round_trip(hint: HintOrder, tmp_path: Path) -> None:
    text = hint.dumps()
    if hint.placement.num_chunks > 1:
        assert "c1" in text.splitlines()[1]
    back = HintOrder.loads(text)
    assert (back.orders, back.placement, back.is_sequence, back.default_caps) == (
        hint.orders, hint.placement, hint.is_sequence, hint.default_caps)
    path = tmp_path / "h.txt"
    path.write_text(text)
    loaded = make_hint(str(path), num_stages=8, num_microbatches=4,
                       split_backward=hint.split_backward)
    assert loaded.strict_order(0) == hint.strict_order(0)  # a rule's sequence is re-derived
    loaded.check_sequence()
    assert describe(loaded)[1].startswith("# rank 0: default cap")


def test_good_file_loads(tmp_path: Path) -> None:
    path = tmp_path / "mine.txt"
    path.write_text(GOOD)
    hint = make_hint(path, num_stages=2, num_microbatches=2)
    assert hint.name == "mine" and hint.default_caps == (2, 1)


BAD = [
    ("unknown task", GOOD.replace("F0 F1 B0 B1", "F0 F1 X0 B1"),
     r"h\.txt, line 2: cannot parse task 'X0'"),
    ("foreign task", GOOD.replace("F0 B0 F1 B1", "F0 B0 F1 B1 F5"),
     r"h\.txt, line 3: .*not part of this step.*got F5"),
    ("duplicate", GOOD.replace("F0 F1 B0 B1", "F0 F1 B0 B1 B0"),
     r"h\.txt, line 2: .*lists a task twice"),
    ("missing", GOOD.replace("F0 B0 F1 B1", "F0 B0 F1"),
     r"h\.txt, line 3: .*misses tasks.*first missing B1"),
    ("rank count", GOOD + "F0 B0 F1 B1\n", r"h\.txt: wrong number of rank lines.*expected 2"),
    ("header field", GOOD.replace("split_backward=false", "split=false"),
     r"h\.txt, line 1: bad header field 'split=false'"),
    ("header value", GOOD.replace("microbatches=2", "microbatches=two"),
     r"h\.txt, line 1: header field microbatches is not an integer"),
    ("empty", "# nothing here\n", r"h\.txt: no rank lines"),
    ("chunk out of range", GOOD.replace("F0 F1 B0 B1", "F0 F1 B0 B1c1"),
     r"h\.txt, line 2: .*not part of this step.*B1c1"),
]


@pytest.mark.parametrize("what,text,error", BAD, ids=[b[0] for b in BAD])
def test_bad_files_get_clear_errors(what: str, text: str, error: str, tmp_path: Path) -> None:
    path = tmp_path / "h.txt"
    path.write_text(text)
    with pytest.raises(HintError, match=error):
        HintOrder.load(path)


def test_file_for_another_shape(tmp_path: Path) -> None:
    path = tmp_path / "h.txt"
    path.write_text(GOOD)
    with pytest.raises(HintError, match="another pipeline shape.*stages=4"):
        make_hint(path, num_stages=4, num_microbatches=2)
    with pytest.raises(HintError, match="cannot read hint file"):
        HintOrder.load(tmp_path)


def test_headerless_file_infers_shape() -> None:
    hint = HintOrder.loads("F0c0 F0c1 B0c1 B0c0\nF0c0 F0c1 B0c1 B0c0\n")
    assert hint.placement.style == "interleaved" and hint.placement.num_stages == 4


def test_cli_prints_hint_caps_and_memory(capsys: pytest.CaptureFixture[str]) -> None:
    from aioready.cli import main
    assert main(["hints", "--stages", "4", "--microbatches", "8", "--hint", "bfw",
                 "--split-backward"]) == 0
    out = capsys.readouterr().out
    assert "kind=rule caps=8,6,4,2" in out
    assert "# strict-mode sequence (derived):" in out
    assert "# rank 3: default cap 2 microbatches in flight -> at most 2 chunk activations" in out
    assert main(["hints", "--stages", "8", "--microbatches", "8", "--hint", "zbv",
                 "--split-backward"]) == 0
    out = capsys.readouterr().out
    assert "F0c0 F1c0" in out and "placement=v" in out
    assert "holds 8 microbatches / 8 chunk activations" in out
    assert main(["hints", "--stages", "4", "--microbatches", "8", "--hint", "nope"]) == 1
    assert "unknown hint" in capsys.readouterr().err
