"""The plain text form of a hint: a header comment, then one line of tasks per rank.

    # aioready hint 1f1b: stages=4 ranks=4 microbatches=8 placement=linear split_backward=false
    F0 F1 F2 F3 B0 F4 B1 ...
    ...

Tasks are written as in tasks.py (`F3`, `B0`, `W7`); when ranks hold several chunks every task
carries its chunk (`F3c0`, `B0c1`). A priority rule is written as its ranking, with `kind=rule`
and its default caps (`caps=4,3,2,1`) in the header: a rule's cap is documented, not derivable.
The header is optional (shape is then inferred from the tasks: microbatches = largest index + 1,
split backward when any W appears, linear or interleaved placement from the chunk count), but
with it a file is checked against what it claims. Every error names the file and the line.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from .errors import ConfigError, HintError
from .placement import Placement
from .tasks import Kind, Task

if TYPE_CHECKING:
    from .hints import HintOrder

__all__ = ["dumps", "loads"]

_HEADER = re.compile(r"^#\s*aioready hint\s+([^:\s]+)\s*:(.*)$")
_KEYS = ("stages", "ranks", "microbatches", "placement", "split_backward", "kind", "caps")


def dumps(hint: "HintOrder") -> str:
    p = hint.placement
    multi = p.num_chunks > 1
    head = (f"# aioready hint {hint.name}: stages={p.num_stages} ranks={p.num_ranks} "
            f"microbatches={hint.num_microbatches} placement={p.style} "
            f"split_backward={str(hint.split_backward).lower()}")
    if not hint.is_sequence:
        head += f" kind=rule caps={','.join(map(str, hint.default_caps or ()))}"
    lines = [head]
    for order in hint.orders:
        lines.append(" ".join(t.text(show_chunk=multi) for t in order))
    return "\n".join(lines) + "\n"


def _header(line: str, where: str) -> tuple[str, dict[str, str]]:
    match = _HEADER.match(line)
    assert match is not None
    fields: dict[str, str] = {}
    for word in match.group(2).split():
        key, eq, value = word.partition("=")
        if not eq or key not in _KEYS:
            raise HintError(f"{where}: bad header field {word!r}",
                            expected=f"key=value with key in {', '.join(_KEYS)}", got=word)
        fields[key] = value
    return match.group(1), fields


def _int(fields: dict[str, str], key: str, where: str) -> int | None:
    if key not in fields:
        return None
    try:
        value = int(fields[key])
    except ValueError:
        raise HintError(f"{where}: header field {key} is not an integer",
                        expected="a positive integer", got=fields[key]) from None
    if value < 1:
        raise HintError(f"{where}: header field {key} must be positive",
                        expected=">= 1", got=value)
    return value


def _rows(text: str, name: str) -> tuple[list[tuple[int, list[Task]]], int, str, dict[str, str]]:
    rows: list[tuple[int, list[Task]]] = []
    header_line, hint_name, fields = 0, name, {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            if _HEADER.match(line):
                if header_line:
                    raise HintError(f"{name}, line {lineno}: a second header",
                                    expected="one '# aioready hint' line",
                                    got=f"another after line {header_line}")
                header_line = lineno
                hint_name, fields = _header(line, f"{name}, line {lineno}")
            continue
        tasks = []
        for word in line.split():
            try:
                tasks.append(Task.parse(word))
            except HintError as exc:
                raise HintError(f"{name}, line {lineno}: cannot parse task {word!r}",
                                expected=exc.expected, got=exc.got) from None
        rows.append((lineno, tasks))
    return rows, header_line, hint_name, fields


def loads(text: str, *, name: str = "file", placement: str | None = None) -> "HintOrder":
    """Parse the text form; raise HintError naming the file, the line and what is wrong."""
    from .hints import HintOrder
    rows, header_line, hint_name, fields = _rows(text, name)
    where = f"{name}, line {header_line}" if header_line else name
    if not rows:
        raise HintError(f"{name}: no rank lines", expected="one line of tasks per rank",
                        got="nothing")
    ranks = _int(fields, "ranks", where)
    if ranks is not None and ranks != len(rows):
        raise HintError(f"{name}: wrong number of rank lines", expected=f"{ranks} (header "
                        f"ranks={ranks})", got=f"{len(rows)} (lines {rows[0][0]}..{rows[-1][0]})")
    every = [t for _, ts in rows for t in ts]
    chunks = 1 + max(t.chunk for t in every)
    stages = _int(fields, "stages", where) or len(rows) * chunks
    mbs = _int(fields, "microbatches", where) or 1 + max(t.microbatch for t in every)
    split_text = fields.get("split_backward")
    if split_text not in (None, "true", "false"):
        raise HintError(f"{where}: bad split_backward", expected="true or false", got=split_text)
    split = split_text == "true" if split_text else any(t.kind is Kind.W for t in every)
    style = placement or fields.get("placement") or ("linear" if chunks == 1 else "interleaved")
    kind = fields.get("kind", "order")
    if kind not in ("order", "rule"):
        raise HintError(f"{where}: bad kind", expected="order or rule", got=kind)
    caps = None
    if "caps" in fields:
        try:
            caps = tuple(int(c) for c in fields["caps"].split(","))
        except ValueError:
            raise HintError(f"{where}: bad caps", expected="integers like 4,3,2,1",
                            got=fields["caps"]) from None
    try:
        place = Placement(stages, len(rows), style)
    except ConfigError as exc:
        raise HintError(f"{where}: the rank lines do not fit a placement: {exc}",
                        expected=f"{stages} stages on {len(rows)} ranks ({style})",
                        got=f"{len(rows)} rank lines") from None
    try:
        return HintOrder(hint_name, place, mbs, split, tuple(tuple(ts) for _, ts in rows),
                         is_sequence=kind == "order", default_caps=caps, source=name)
    except HintError as exc:
        line = rows[exc.rank][0] if exc.rank is not None and exc.rank < len(rows) else None
        at = f"{name}, line {line}" if line else name
        raise HintError(f"{at}: {exc.what}", rank=exc.rank, task=exc.task,
                        expected=exc.expected, got=exc.got) from None
