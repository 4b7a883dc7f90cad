"""Some rows of bench/results/policy.md regenerated into the page, the rest kept.

A full `python -m bench.policy --seeds 10` takes about an hour on two cores, most of it in rows
that a change did not touch. `--rows PATTERN --update` reruns only the rows whose label matches
(say, 'auto*' after a change to hint="auto") and this module puts them into the page: in every
table the run produced (one per jitter, and the optimum's), the old rows of the groups it ran
(an S of a jitter's table; an (S, M, jitter) of the optimum's) that match the pattern are
dropped, the new rows go in, and the rows stay in the bench's order. The page's header gains a
line per update naming the rows, the tables, the command, its commit and its running time, so
the one page says which figure came from which run. policy.json is updated the same way.

A table the page does not have, or whose columns differ, is refused: the page would no longer be
one table, so the whole page must be regenerated instead.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

__all__ = ["matches", "merge_page", "merge_json", "update"]

CAME = " came from: "  # what separates an update note's rows from their source


def matches(name: str, patterns: list[str]) -> bool:
    """`name` is one of `patterns`, or starts with one that ends in '*'."""
    return any(name == p or (p.endswith("*") and name.startswith(p[:-1])) for p in patterns)


def _tables(text: str) -> tuple[list[str], dict[str, list[int]]]:
    """The page's lines, and per table (its heading and column header) the indices of its
    rows: the lines that start with '|' after the header's '|---' line."""
    lines = text.split("\n")
    tables: dict[str, list[int]] = {}
    heading, rows = "", None
    for i, line in enumerate(lines):
        if line.startswith("#"):
            heading = line
        if not line.startswith("|"):
            rows = None
        elif rows is not None:
            if not line.startswith("|---"):
                rows.append(i)
        elif i + 1 < len(lines) and lines[i + 1].startswith("|---"):
            table = f"{heading}\n{line}"
            if table in tables:
                raise ValueError(f"two tables {table!r} in one section")
            rows = tables[table] = []
    return lines, tables


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _split(table: str, line: str) -> tuple[str, str]:
    """A row's (group, configuration): the cells before the one named 'configuration'."""
    head = _cells(table.split("\n", 1)[1])
    at = head.index("configuration")
    cells = _cells(line)
    return " | ".join(cells[:at]), cells[at]


def merge_page(page: str, rows: str, patterns: list[str], order: list[str], note: str) -> str:
    """`page` with the rows of every table of `rows` (a page of the same form) in place of its
    rows that match `patterns` in the groups `rows` ran; `order` ranks configurations within a
    group (others after, in their order); `note`: a header line, replacing one of the same
    lead (the text before CAME)."""
    old_lines, old = _tables(page)
    new_lines, new = _tables(rows)
    names = {_split(table, new_lines[i])[1] for table, idx in new.items() for i in idx}
    missing = [p for p in patterns if not any(matches(name, [p]) for name in names)]
    if missing and len(missing) < len(patterns):  # the others' groups would lose these rows
        raise ValueError(f"the rows page has no row matching {missing}: merge it with the "
                         "--rows it was run with")
    replace: dict[str, list[str]] = {}
    for table, idx in new.items():
        if table not in old:
            raise ValueError(f"the page has no table {table!r}: regenerate the whole page")
        # only the rows asked for: a rows run also has the strict baselines of its optimum
        # table, which the page already holds
        fresh = [new_lines[i] for i in idx if matches(_split(table, new_lines[i])[1], patterns)]
        groups = {_split(table, line)[0] for line in fresh}
        kept = [old_lines[i] for i in old[table]
                if not (_split(table, old_lines[i])[0] in groups
                        and matches(_split(table, old_lines[i])[1], patterns))]
        firsts = list(dict.fromkeys(_split(table, line)[0] for line in kept + fresh))
        rank = {name: i for i, name in enumerate(order)}

        def key(item: tuple[int, str], table: str = table) -> tuple[int, int, int]:
            group, name = _split(table, item[1])
            return firsts.index(group), rank.get(name, len(rank)), item[0]
        replace[table] = [line for _, line in sorted(enumerate(kept + fresh), key=key)]
    out: list[str] = []
    done: set[str] = set()
    owner = {i: table for table, idx in old.items() for i in idx}
    for i, line in enumerate(old_lines):
        table = owner.get(i)
        if table in replace:
            if table not in done:
                out.extend(replace[table])
                done.add(table)
            continue
        out.append(line)
    return _with_note("\n".join(out), note)


def _covered(line: str, note: str) -> bool:
    """`line` is an update note whose rows `note`'s update replaced everywhere: the same
    patterns, and every group of every table it names is named by `note` too (a rerun of the
    same rows over more sizes leaves nothing on the page from the earlier run)."""
    if CAME not in line:
        return False
    old, new = _lead(line.split(CAME, 1)[0]), _lead(note.split(CAME, 1)[0])
    return old is not None and new is not None and old[0] == new[0] and old[1] <= new[1]


def _lead(lead: str) -> tuple[str, set[tuple[str, str]]] | None:
    """A note's lead ("Rows `p` (table: head = g; g; table: head = g)") as its patterns and
    its (table, group) pairs; None for a lead of another form."""
    found = re.fullmatch(r"Rows (.*?) \((.*)\)", lead)
    if found is None:
        return None
    pairs, table = set(), None
    for item in found.group(2).split("; "):
        if ": " in item and " = " in item:  # a table starts: "name: head = first group"
            table, _, rest = item.rpartition(" = ")
            item = rest
        if table is None:
            return None
        pairs.add((table, item))
    return found.group(1), pairs


def _with_note(page: str, note: str) -> str:
    """The page with `note` among the header lines (before the first blank line), in place of
    the notes whose rows it replaced (`_covered`)."""
    head, _, body = page.partition("\n\n")
    lines = [line for line in head.split("\n") if not _covered(line.rstrip(), note)]
    lines = [line if line.endswith("  ") else line + "  " for line in lines]
    return "\n".join([*lines, note]) + "\n\n" + body


def merge_json(data: dict[str, Any], rows: dict[str, Any], note: str) -> dict[str, Any]:
    """policy.json with `rows`' figures in place of its own (per point, per row name; per
    optimum case and seed) and `note` in its list of updates."""
    for point, found in rows.get("simulated", {}).items():
        data.setdefault("simulated", {}).setdefault(point, {}).update(found)
    for case, units in rows.get("optimum", {}).items():
        mine = data.setdefault("optimum", {}).setdefault(case, [])
        for i, unit in enumerate(units):
            if i < len(mine):
                mine[i]["rows"].update(unit["rows"])
                mine[i]["optima"].update(unit["optima"])
            else:
                mine.append(unit)
    data["updates"] = [u for u in data.get("updates", []) if not _covered(u, note)] + [note]
    return data


def note_of(rows_page: str, patterns: list[str]) -> str:
    """The header line for an update: which rows, of which tables, from which command and
    commit, how long it took (from the rows page's own header and last line)."""
    field: Callable[[str], str] = lambda name: next(
        (line.split(":", 1)[1].strip().rstrip() for line in rows_page.split("\n")
         if line.startswith(name + ":")), "?")
    lines, tables = _tables(rows_page)
    where = []
    for table, idx in tables.items():
        name = table.split("\n")[0].lstrip("# ").split(" (")[0]
        groups = dict.fromkeys(_split(table, lines[i])[0] for i in idx
                               if matches(_split(table, lines[i])[1], patterns))
        head = _cells(table.split("\n")[1])[0]
        if groups:  # a table the run left empty (say, --opt-cases none) got no rows
            where.append(f"{name}: {head} = {'; '.join(groups)}")
    timing = re.search(r"^Running time: (.*)$", rows_page, re.M)
    return (f"Rows {', '.join(f'`{p}`' for p in patterns)} ({'; '.join(where)})"
            f"{CAME}{field('Command')}, "
            f"{field('Date')}; {field('Machine').split('; ', 1)[-1]}; "
            f"{timing.group(1) if timing else 'running time unknown'}")


def update(results: Path, rows_name: str, patterns: list[str], order: list[str],
           page_name: str = "policy") -> str:
    """Merge bench/results/<rows_name>.md and .json into <page_name>.md and .json."""
    rows_page = (results / f"{rows_name}.md").read_text()
    note = note_of(rows_page, patterns)
    page = results / f"{page_name}.md"
    page.write_text(merge_page(page.read_text(), rows_page, patterns, order, note))
    data_path = results / f"{page_name}.json"
    data = merge_json(json.loads(data_path.read_text()),
                      json.loads((results / f"{rows_name}.json").read_text()), note)
    data_path.write_text(json.dumps(data, indent=1) + "\n")
    return note
