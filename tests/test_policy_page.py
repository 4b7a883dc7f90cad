"""bench.policy --rows ... --update: exactly the matching rows of the groups it ran are replaced,
in every table, in the bench's order, and the page's header says where they came from."""

from __future__ import annotations

import json

import pytest

from bench.policy_page import CAME, merge_json, merge_page, note_of, update

HEAD = "| S | configuration | 2x: speedup |\n|---|---|---|"
OPT = "| S, M | jitter | configuration | 2x: opt/t |\n|---|---|---|---|"
ORDER = ["ready 1f1b", "auto", "auto, given order", "auto split", "strict 1f1b"]


def _page(cmd: str, sims: dict[str, list[str]], opt: list[str], timing: str) -> str:
    return "\n".join([
        f"Command: `{cmd}`  ", "Machine: 2 cores; load average 1.00 at the end  ",
        "Date: 2026-11-30 14:14 UTC, commit abc1234", "", "intro", "",
        *(line for jitter, rows in sims.items() for line in (f"### {jitter}", "", HEAD, *rows,
                                                             "")),
        "## Against the offline optimum (bench/optimum.py)", "", OPT, *opt, "",
        f"Running time: {timing}"]) + "\n"


OLD = _page("python -m bench.policy --seeds 10",
            {"lognormal:0.5": ["| 4 | ready 1f1b | 1.0 |", "| 4 | auto | 1.1 |",
                               "| 4 | auto split | 1.2 |", "| 8 | ready 1f1b | 2.0 |",
                               "| 8 | auto | 2.1 |", "| 8 | auto split | 2.2 |"],
             "multimodal:0.3:3": ["| 4 | ready 1f1b | 3.0 |", "| 4 | auto | 3.1 |"]},
            ["| 4, 8 | lognormal:0.5 | auto | 0.9 |",
             "| 4, 8 | lognormal:0.5 | strict 1f1b | 0.8 |",
             "| 4, 8 | multimodal:0.3:3 | auto | 0.7 |"],
            "simulations 984 s")
NEW = _page("python -m bench.policy --rows 'auto*' --stages 8 --jitters lognormal:0.5",
            {"lognormal:0.5": ["| 8 | auto | 5.1 |", "| 8 | auto split | 5.2 |",
                               "| 8 | auto, given order | 5.3 |"]},
            ["| 4, 8 | lognormal:0.5 | auto | 0.95 |",
             "| 4, 8 | lognormal:0.5 | auto, given order | 0.96 |",
             "| 4, 8 | lognormal:0.5 | strict 1f1b | 0.5 |"],  # a baseline: not asked for
            "simulations 12 s (20 points, 2 processes, 24 s of CPU), optimum 3 s")


def test_only_matching_rows_of_the_groups_run_are_replaced_in_order() -> None:
    note = note_of(NEW, ["auto*"])
    out = merge_page(OLD, NEW, ["auto*"], ORDER, note)
    ln = out[out.index("### lognormal"):out.index("### multimodal")]
    assert [line for line in ln.split("\n") if line.startswith("| ") and "---" not in line][1:] \
        == ["| 4 | ready 1f1b | 1.0 |", "| 4 | auto | 1.1 |", "| 4 | auto split | 1.2 |",
            "| 8 | ready 1f1b | 2.0 |", "| 8 | auto | 5.1 |", "| 8 | auto, given order | 5.3 |",
            "| 8 | auto split | 5.2 |"]
    assert "| 4 | auto | 3.1 |" in out  # another jitter's table: not run, kept
    opt = out[out.index("## Against"):]
    assert [line for line in opt.split("\n") if line.startswith("| 4, 8")] == [
        "| 4, 8 | lognormal:0.5 | auto | 0.95 |",
        "| 4, 8 | lognormal:0.5 | auto, given order | 0.96 |",
        "| 4, 8 | lognormal:0.5 | strict 1f1b | 0.8 |",  # not matched: kept
        "| 4, 8 | multimodal:0.3:3 | auto | 0.7 |"]
    head = out.split("\n\n", 1)[0].split("\n")
    assert head[0] == "Command: `python -m bench.policy --seeds 10`  "
    assert head[-1] == note and note.startswith(
        "Rows `auto*` (lognormal:0.5: S = 8; Against the offline optimum: S, M = 4, 8 | "
        "lognormal:0.5) came from: ")
    assert "--rows 'auto*' --stages 8" in note and "24 s of CPU" in note
    assert "Running time: simulations 984 s" in out
    again = merge_page(out, NEW, ["auto*"], ORDER, note)  # a rerun replaces its own note
    assert again == out


def test_a_table_the_page_lacks_is_refused_and_rows_not_asked_for_stay() -> None:
    other = NEW.replace("| S | configuration | 2x: speedup |", "| S | configuration | eff |")
    with pytest.raises(ValueError, match="no table"):
        merge_page(OLD, other, ["auto*"], ORDER, "n")
    only = merge_page(OLD, NEW, ["auto split"], ORDER, "n")  # the other rows stay old
    assert "| 8 | auto | 2.1 |" in only and "| 8 | auto split | 5.2 |" in only
    assert "| 8 | auto | 5.1 |" not in only and "auto, given order" not in only


def test_update_merges_the_json_and_names_the_source(tmp_path) -> None:
    (tmp_path / "policy.md").write_text(OLD)
    (tmp_path / "rows.md").write_text(NEW)
    old = {"command": "x", "simulated": {"lognormal:0.5@8": {"auto|2x": 1, "ready 1f1b|2x": 2}},
           "optimum": {"4@8@lognormal:0.5": [{"rows": {"auto|2x": 1, "strict 1f1b|default": 2},
                                              "optima": {"k": 1}}]}}
    (tmp_path / "policy.json").write_text(json.dumps(old))
    (tmp_path / "rows.json").write_text(json.dumps(
        {"simulated": {"lognormal:0.5@8": {"auto|2x": 9}},
         "optimum": {"4@8@lognormal:0.5": [{"rows": {"auto|2x": 9}, "optima": {"j": 9}}]}}))
    note = update(tmp_path, "rows", ["auto*"], ORDER)
    data = json.loads((tmp_path / "policy.json").read_text())
    assert data["simulated"]["lognormal:0.5@8"] == {"auto|2x": 9, "ready 1f1b|2x": 2}
    unit = data["optimum"]["4@8@lognormal:0.5"][0]
    assert unit["rows"] == {"auto|2x": 9, "strict 1f1b|default": 2}
    assert unit["optima"] == {"k": 1, "j": 9}
    assert data["updates"] == [note] and CAME in note
    assert merge_json(data, {}, note)["updates"] == [note]
    assert (tmp_path / "policy.md").read_text().split("\n\n", 1)[0].endswith(note)


def test_the_bench_merges_a_rows_page_by_its_flags(tmp_path, monkeypatch) -> None:
    import bench.policy as policy
    monkeypatch.setattr(policy, "RESULTS", tmp_path)
    (tmp_path / "policy.md").write_text(OLD)
    (tmp_path / "policy.json").write_text("{}")
    (tmp_path / "rows.md").write_text(NEW)
    (tmp_path / "rows.json").write_text("{}")
    policy.main(["--rows", "auto*", "--merge", "rows"])
    page = (tmp_path / "policy.md").read_text()
    assert "| 8 | auto | 5.1 |" in page and "| 4 | auto | 1.1 |" in page
    with pytest.raises(SystemExit):
        policy.main(["--update"])  # which rows: --rows is needed


def test_an_empty_table_of_the_run_changes_nothing_there() -> None:
    bare = NEW.split("## Against")[0] + "## Against the offline optimum (bench/optimum.py)\n\n" \
        + OPT + "\n\nRunning time: simulations 1 s\n"
    note = note_of(bare, ["auto*"])
    assert "optimum" not in note.split(CAME)[0]
    out = merge_page(OLD, bare, ["auto*"], ORDER, note)
    assert out.split("## Against")[1] == OLD.split("## Against")[1]


def test_a_rerun_over_more_groups_replaces_the_earlier_note_and_keeps_others() -> None:
    """The earlier update's rows (S=8) are all among the later one's (S=4 and 8): its note
    would name figures the page no longer holds. A note of other rows stays."""
    wider = NEW.replace("| 8 | auto | 5.1 |", "| 4 | auto | 4.1 |\n| 8 | auto | 5.1 |")
    first, second = note_of(NEW, ["auto*"]), note_of(wider, ["auto*"])
    other = note_of(NEW, ["ready*"])  # no rows matched, but a note of its own patterns
    assert first != second
    page = merge_page(OLD, NEW, ["auto*"], ORDER, first)
    page = merge_page(page, NEW, ["ready*"], ORDER, other)
    page = merge_page(page, wider, ["auto*"], ORDER, second)
    head = page.split("\n\n", 1)[0]
    assert first not in head and second in head and other in head
    assert head.count(CAME) == 2
    data = merge_json(merge_json({"updates": []}, {}, first), {}, second)
    assert data["updates"] == [second]
    narrower = merge_page(page, NEW, ["auto*"], ORDER, first)  # S=4's rows still from `second`
    assert second in narrower.split("\n\n", 1)[0]


def test_a_pattern_the_rows_page_never_ran_is_refused() -> None:
    """Merging with a pattern that matches none of the page's rows would delete those rows of
    the groups it ran and put none back: refused, naming the pattern."""
    with pytest.raises(ValueError, match="auto split, held-out"):
        merge_page(OLD, NEW, ["auto*", "auto split, held-out"], ORDER, note_of(NEW, ["auto*"]))
    assert "| 8 | auto split | 2.2 |" not in merge_page(OLD, NEW, ["auto*"], ORDER,
                                                        note_of(NEW, ["auto*"]))
