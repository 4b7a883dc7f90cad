"""Section citations into the repository's docs resolve.

Code, tests, benchmarks and the docs themselves cite a section as a docs file followed by its
title in double quotes (in code: the docs path; inside docs/: a relative markdown link). A page
that is split or a section that is renamed silently breaks such a citation, and a reader then
finds no section to read; this test finds every citation and asserts that the file exists and
has a heading with that title (or whose lead clause is that title).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SCANNED = ("aioready", "bench", "tests", "examples", "docs")
SUFFIXES = {".py", ".md", ".txt", ".toml", ".cfg", ".sh", ".c", ".pyx", ".ini", ".yml", ".yaml"}
TOP_FILES = ("README.md", "Makefile", "pyproject.toml")

TITLE = r'"([A-Za-z`][^"\n]{0,150})"'
# What may stand between the file and its title: a closing backtick, a comma, an opening
# parenthesis, spaces.
BETWEEN = r"`?[,(\s]*"
MORE = re.compile(r'(?:,\s*|\s+and\s+)' + TITLE)
IN_CODE = re.compile(r"docs/([A-Za-z0-9_]+\.md)" + BETWEEN + TITLE)
IN_DOCS = re.compile(r"\[[A-Za-z0-9_./]+\]\(([A-Za-z0-9_]+\.md)\)" + BETWEEN + TITLE)


def sources() -> list[Path]:
    """Every text file that may cite a section (this test's own text excepted)."""
    found = [ROOT / name for name in TOP_FILES if (ROOT / name).is_file()]
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*")):
            if path.is_file() and path.suffix in SUFFIXES and path != Path(__file__).resolve():
                found.append(path)
    return found


def flatten(text: str) -> str:
    """One line of prose: a citation may wrap across lines of a docstring, a comment or a
    paragraph, and a string literal may escape its quotes."""
    text = text.replace('\\"', '"')
    return re.sub(r"[ \t]*\n[ \t]*(?:#+[ \t]*)?", " ", text)


def citations(path: Path) -> list[tuple[str, str]]:
    """(docs file name, title) for every citation in `path`."""
    text = flatten(path.read_text(encoding="utf-8", errors="replace"))
    patterns = [IN_CODE] + ([IN_DOCS] if path.parent == DOCS else [])
    found = []
    for pattern in patterns:
        for match in pattern.finditer(text):
            name, first = match.group(1), match.group(2)
            found.append((name, first))
            pos = match.end()
            while more := MORE.match(text, pos):
                found.append((name, more.group(1)))
                pos = more.end()
    return found


def headings(name: str) -> set[str]:
    """The titles of every heading of docs/<name>, whitespace collapsed."""
    lines = (DOCS / name).read_text(encoding="utf-8").splitlines()
    return {" ".join(line.lstrip("#").split()) for line in lines if re.match(r"#{1,6} ", line)}


def names(title: str, heading: str) -> bool:
    """A citation names a heading by its whole title or by its lead clause: the title up to a
    comma, a colon or a parenthesis ("A task's end" for "A task's end: one precise wake-up")."""
    rest = heading[len(title):] if heading.startswith(title) else None
    return rest is not None and (rest == "" or rest[0] in ",:;" or rest.startswith(" ("))


def all_citations() -> list[tuple[str, str, str]]:
    return [(str(path.relative_to(ROOT)), name, " ".join(title.split()))
            for path in sources() for name, title in citations(path)]


def test_the_scanner_reads_the_forms_in_use(tmp_path: Path) -> None:
    """Each form the repository writes is read: wrapped across comment lines, after a backtick
    or a parenthesis, escaped in a string, several titles after one file; a file named without a
    title is no citation."""
    sample = tmp_path / "sample.py"
    sample.write_text('# see (docs/policy.md "The microbatch\n# order") and '
                      'docs/async.md` "Spin,\n# park, back off"\n'
                      'x = "(docs/policy.md \\"Memory budgets\\")"\n'
                      '"""docs/hot_path.md ("A task\'s end", "Not done yet")."""\n'
                      'y = "docs/policy.md)."  # no title\n', encoding="utf-8")
    assert citations(sample) == [("policy.md", "The microbatch order"),
                                 ("async.md", "Spin, park, back off"),
                                 ("policy.md", "Memory budgets"),
                                 ("hot_path.md", "A task's end"),
                                 ("hot_path.md", "Not done yet")]


def test_a_title_names_a_heading_or_its_lead_clause() -> None:
    assert names("A task's end", "A task's end: one precise wake-up")
    assert names("What a choice costs", "What a choice costs, and where it goes")
    assert names("The CPU device's quiet path", "The CPU device's quiet path (S=4)")
    assert names("Memory budgets", "Memory budgets")
    assert not names("Memory", "Memory budgets")
    assert not names("Memory budgets", "Memory")


def test_citations_are_found() -> None:
    """The scan is not vacuous: the repository cites sections of several docs files."""
    found = all_citations()
    assert len(found) > 50
    assert {"policy.md", "policy_measurements.md", "architecture.md", "hints.md"} <= {
        name for _, name, _ in found}


@pytest.mark.parametrize("name", sorted({name for _, name, _ in all_citations()}))
def test_every_cited_section_exists(name: str) -> None:
    """Every citation into docs/<name> names a file that exists and a heading it has."""
    assert (DOCS / name).is_file(), f"docs/{name} is cited but does not exist: " + ", ".join(
        sorted({src for src, cited, _ in all_citations() if cited == name}))
    titles = headings(name)
    broken = sorted({f'{src}: docs/{name} "{title}"' for src, cited, title in all_citations()
                     if cited == name and not any(names(title, h) for h in titles)})
    assert not broken, (f"expected a heading of docs/{name} for each citation; got none for:\n"
                        + "\n".join(broken))
