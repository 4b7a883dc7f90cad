"""Import a torch.distributed.pipelining schedule as a hint order.

torch's compute-only IR (`pipeline_order`, or its CSV dump) lists, per rank, actions written
`<stage><TYPE><microbatch>` (`2F5`, `3I0`, `1W7`), composites `(0F7;7B3)OVERLAP_F_B`, and None
or an empty cell for idle (docs/hints.md "Importing torch schedules"). We keep the compute actions
in their order, so the hint rank of a task is its position in the filtered row:
  F -> F, I (input grad) -> B, W -> W, B (full backward) -> B in an unsplit schedule, and B then
  W (adjacent) in a split one; OVERLAP_F_B -> its sub-actions in order;
  SEND_*/RECV_*/UNSHARD/RESHARD/REDUCE_GRAD and idle -> dropped (the runtime sends messages).
Stage -> rank comes from the row a stage appears in; the placement is the one (linear, loop =
interleaved, V) that matches it. Known torch bug: 2.13's Schedule1F1B IR gives the last rank
F1..FM and no F0; we detect it and refuse, or shift those forwards down by one when asked.
Parsing needs no torch; `from_torch_schedule` imports torch inside the function.
"""

from __future__ import annotations

import csv
import re
from pathlib import Path
from typing import Any, Iterable, Sequence

from ..errors import ConfigError, HintError
from ..hints import HintOrder
from ..placement import STYLES, Placement
from ..tasks import Kind, Task

__all__ = ["from_torch_actions", "from_torch_csv", "from_torch_schedule", "from_torch_for_shape"]

_ONE = re.compile(r"^(\d+)(F|I|B|W|UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)"
                  r"(\d*)$")
_MANY = re.compile(r"^\((.*)\)(\w+)$")
_COMPUTE = {"F": Kind.F, "I": Kind.B, "W": Kind.W, "B": None}

Raw = tuple[int, str, int]  # (stage, torch type, microbatch)


def _parse(text: str, rank: int, pos: int) -> list[Raw]:
    """One cell -> its compute actions (empty for comm, FSDP and idle)."""
    text = text.strip()
    if not text or text == "None":
        return []
    many = _MANY.match(text)
    if many:
        if many.group(2) != "OVERLAP_F_B":
            raise HintError(f"torch schedule, rank {rank}, action {pos}: unknown composite",
                            expected="(a;b)OVERLAP_F_B", got=text)
        return [r for part in many.group(1).split(";") for r in _parse(part, rank, pos)]
    one = _ONE.match(text)
    if one is None:
        raise HintError(f"torch schedule, rank {rank}, action {pos}: cannot parse",
                        expected="<stage><F|I|B|W|...><microbatch>, e.g. 2F5", got=repr(text))
    stage, kind, mb = one.groups()
    if kind not in _COMPUTE:
        return []
    if not mb:
        raise HintError(f"torch schedule, rank {rank}, action {pos}: compute without microbatch",
                        expected="e.g. 2F5", got=text)
    return [(int(stage), kind, int(mb))]


def _placement(rows: list[list[Raw]]) -> Placement:
    owner: dict[int, int] = {}
    for rank, row in enumerate(rows):
        for stage, _, _ in row:
            if owner.setdefault(stage, rank) != rank:
                raise HintError("torch schedule runs one stage on two ranks", task=f"stage {stage}",
                                expected="each stage on one rank",
                                got=f"ranks {owner[stage]} and {rank}")
    R, S = len(rows), 1 + max(owner, default=-1)
    if sorted(owner) != list(range(S)):
        raise HintError("torch schedule misses stages", expected=f"stages 0..{S - 1}",
                        got=sorted(owner))
    for style in STYLES:
        try:
            place = Placement(S, R, style)
        except ConfigError:
            continue
        if all(place.rank_of(s) == r for s, r in owner.items()):
            return place
    raise HintError("torch schedule's stage-to-rank map is not linear, loop or V",
                    expected="one of " + ", ".join(STYLES), got=dict(sorted(owner.items())))


def _off_by_one(rows: list[list[Raw]], M: int, fix: bool) -> list[list[Raw]]:
    """torch 2.13 Schedule1F1B: a stage whose forwards are 1..M (no 0) and backwards 0..M-1."""
    out = []
    for rank, row in enumerate(rows):
        for stage in sorted({s for s, _, _ in row}):
            fwd = sorted(m for s, k, m in row if s == stage and k == "F")
            bwd = sorted(m for s, k, m in row if s == stage and k != "F")
            if fwd == list(range(1, M + 1)) and bwd and bwd[0] == 0 and max(bwd) == M - 1:
                if not fix:
                    raise HintError(
                        "torch schedule has torch 2.13's Schedule1F1B off-by-one", rank=rank,
                        task=f"stage {stage}", expected=f"forwards F0..F{M - 1}",
                        got=f"F1..F{M} (no F0)",
                        fix="use aioready's own 1f1b hint, or pass fix_off_by_one=True to "
                        "shift those forwards down by one")
                row = [(s, k, m - 1 if s == stage and k == "F" else m) for s, k, m in row]
        out.append(row)
    return out


def from_torch_actions(
    rows: Sequence[Iterable[Any]], *, num_microbatches: int | None = None, name: str = "torch",
    fix_off_by_one: bool = False,
) -> HintOrder:
    """A HintOrder from per-rank torch actions (`_Action`, their text, or None for idle)."""
    parsed = [[raw for pos, cell in enumerate(row)
               for raw in _parse("" if cell is None else str(cell), rank, pos)]
              for rank, row in enumerate(rows)]
    if not parsed or not any(parsed):
        raise HintError("torch schedule has no compute actions", expected="one row per rank",
                        got=f"{len(parsed)} rows")
    M = num_microbatches
    if M is None:
        fwd = [m for row in parsed for _, k, m in row if k == "F"]
        bwd = [m for row in parsed for _, k, m in row if k != "F"]
        M = 1 + max(bwd or fwd)
    parsed = _off_by_one(parsed, M, fix_off_by_one)
    place = _placement(parsed)
    split = any(k in ("I", "W") for row in parsed for _, k, _ in row)
    orders = []
    for row in parsed:
        order: list[Task] = []
        for stage, kind, mb in row:
            chunk = place.chunk_of(stage)
            mapped = _COMPUTE[kind]
            if mapped is None:
                order.append(Task(Kind.B, mb, chunk))
                if split:
                    order.append(Task(Kind.W, mb, chunk))
            else:
                order.append(Task(mapped, mb, chunk))
        orders.append(tuple(order))
    try:
        return HintOrder(name, place, M, split, tuple(orders), source=f"torch {name}")
    except HintError as exc:
        raise HintError(f"torch schedule {name!r} does not map to a hint: {exc.what}",
                        rank=exc.rank, task=exc.task, expected=exc.expected, got=exc.got,
                        fix="a stage mixing full B with I/W for one microbatch, or I without "
                        "its W, cannot be imported") from None


def from_torch_csv(path: str | Path, *, num_microbatches: int | None = None,
                   fix_off_by_one: bool = False) -> HintOrder:
    """Import torch's `_dump_csv(..., format="compute_only")` file (row = rank)."""
    p = Path(path)
    with p.open(newline="") as fh:
        rows = [row for row in csv.reader(fh)]
    return from_torch_actions(rows, num_microbatches=num_microbatches, name=p.stem,
                              fix_off_by_one=fix_off_by_one)


def from_torch_schedule(schedule: str, num_ranks: int, num_microbatches: int,
                        num_stages_per_rank: int | None = None, *,
                        fix_off_by_one: bool = False) -> HintOrder:
    """Generate torch's order with its schedule visualizer (no process group) and import it."""
    try:
        from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    except ImportError as exc:
        raise HintError("importing a torch schedule needs torch.distributed.pipelining",
                        expected="torch >= 2.6 with distributed support",
                        got=str(exc)) from None
    rows = get_schedule_ops(schedule, num_ranks, num_microbatches, num_stages_per_rank)
    return from_torch_actions(rows, num_microbatches=num_microbatches, name=schedule,
                              fix_off_by_one=fix_off_by_one)


def from_torch_for_shape(schedule: str, *, num_stages: int, num_ranks: int | None,
                         num_microbatches: int, split_backward: bool) -> HintOrder:
    """`make_hint("torch:<Schedule>", ...)`: torch's order for this pipeline shape."""
    if num_ranks is None:
        from torch.distributed.pipelining.schedules import (
            PipelineScheduleSingle,
            get_schedule_class,
        )
        single = issubclass(get_schedule_class(schedule), PipelineScheduleSingle)
        num_ranks = num_stages if single else num_stages // 2
    if num_ranks < 1 or num_stages % num_ranks:
        raise HintError(f"torch schedule {schedule!r} cannot place {num_stages} stages",
                        expected="a multiple of the ranks", got=f"{num_ranks} ranks")
    hint = from_torch_schedule(schedule, num_ranks, num_microbatches, num_stages // num_ranks)
    if hint.split_backward != split_backward:
        raise HintError(f"torch schedule {schedule!r} needs split_backward="
                        f"{hint.split_backward}", expected=f"split_backward={hint.split_backward}",
                        got=f"split_backward={split_backward}")
    return hint
