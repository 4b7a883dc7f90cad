"""HintOrder: a per-rank ranking of that rank's tasks, used by the arbiter as a hint.

Two kinds of hint reduce to the same value (docs/hints.md "Orders and priority rules"): an *order*
(rank = position in a list: 1F1B, ZB-H1, an imported torch order) and a *priority rule* (rank
computed from the task: BF, BFW). Both are stored as one list per rank, sorted by rank. An order is
also a valid sequence to run in `strict` mode; a rule is not (its sorted list ignores
dependencies), so `is_sequence` is False for rules and strict mode refuses them unless the
scheduler derived a sequence for them.

The default cap of a rank is the hint's own peak in-flight count on that rank: its strict order
walked in sequence under in_flight.InFlight, the rule the arbiter and the step metrics count by
(a microbatch enters at the F of the rank's entry chunk and leaves when its last local backward
piece is done).

Note [hint text form]: a header comment, then one line of tasks per rank.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Hashable, Iterable, Sequence, TypeVar

from .errors import ConfigError, HintError
from .in_flight import peak_in_flight
from .placement import Placement
from .tasks import Kind, Need, Task, all_tasks, needs

__all__ = ["HintOrder", "peak_in_flight", "peak_chunk_activations", "first_dependency_violation"]

T = TypeVar("T")


def peak_chunk_activations(order: Sequence[Task], *, split_backward: bool) -> int:
    """Largest number of (chunk, microbatch) activations held on a rank that runs `order`.

    A chunk's activation of a microbatch is held from its F until its last backward piece (B
    unsplit, W split). This is the memory measure of multi-chunk hints (docs/hints.md "Default
    caps").
    """
    last_kind = Kind.W if split_backward else Kind.B
    now = peak = 0
    for task in order:
        if task.kind is Kind.F:
            now += 1
            peak = max(peak, now)
        elif task.kind is last_kind:
            now -= 1
    return peak


def first_dependency_violation(
    order: Sequence[Task], placement: Placement, rank: int, split_backward: bool
) -> Task | None:
    """The first task of `order` that comes before a local task it needs, or None.

    Only dependencies between tasks of the same rank are checked: F(s) after F(s-1) when both
    stages are local (V placement), B after its F and after the local B of the next stage, W after
    its B.
    """
    stages = placement.stages_of(rank)
    last = placement.num_stages - 1
    seen: set[Task] = set()
    for task in order:
        stage = stages[task.chunk]
        pred, _ = needs(task, is_last_stage=stage == last)
        local: list[Task] = [pred] if pred is not None else []
        if task.kind is Kind.F and stage > 0 and placement.rank_of(stage - 1) == rank:
            local.append(Task(Kind.F, task.microbatch, placement.chunk_of(stage - 1)))
        if task.kind is Kind.B and stage < last and placement.rank_of(stage + 1) == rank:
            local.append(Task(Kind.B, task.microbatch, placement.chunk_of(stage + 1)))
        if any(dep not in seen for dep in local):
            return task
        seen.add(task)
    return None


def _sequences_complete(hint: "HintOrder") -> bool:
    """Run every rank's strict sequence with unit steps (module note: what a task needs)."""
    placement, last = hint.placement, hint.placement.num_stages - 1
    orders = [hint.strict_order(r) for r in range(hint.num_ranks)]
    pos = [0] * len(orders)
    done: set[tuple[int, Kind, int]] = set()  # (stage, kind, microbatch)
    waiting: dict[tuple[int, Kind, int], list[int]] = {}
    runnable = list(range(len(orders)))
    while runnable:
        rank = runnable.pop()
        stages = placement.stages_of(rank)
        order = orders[rank]
        while pos[rank] < len(order):
            task = order[pos[rank]]
            stage = stages[task.chunk]
            pred, need = needs(task, is_last_stage=stage == last)  # the one dependency rule
            deps = [] if pred is None else [(stage, pred.kind, task.microbatch)]
            if need is Need.INPUT and stage > 0:
                deps.append((stage - 1, Kind.F, task.microbatch))
            elif need is Need.GRAD:
                deps.append((stage + 1, Kind.B, task.microbatch))
            missing = next((d for d in deps if d not in done), None)
            if missing is not None:
                waiting.setdefault(missing, []).append(rank)
                break
            key = (stage, task.kind, task.microbatch)
            done.add(key)
            runnable.extend(waiting.pop(key, ()))
            pos[rank] += 1
    return all(p == len(o) for p, o in zip(pos, orders))


@dataclass(frozen=True, slots=True)
class HintOrder:
    """One ranking per rank; `orders[r][i]` has hint rank i on rank r.

    `sequence`, when given, is the order strict mode follows for a priority rule (one derived by
    running the rule, see schedulers/listsched.py); for an order hint strict mode follows `orders`.
    """

    name: str
    placement: Placement
    num_microbatches: int
    split_backward: bool
    orders: tuple[tuple[Task, ...], ...]
    is_sequence: bool = True
    default_caps: tuple[int, ...] | None = None
    source: str = ""
    sequence: tuple[tuple[Task, ...], ...] | None = None
    _priority: tuple[dict[Task, int], ...] = field(init=False, repr=False, compare=False)
    _memo: dict[Hashable, Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_memo", {})
        orders = tuple(tuple(o) for o in self.orders)
        object.__setattr__(self, "orders", orders)
        self._validate_tasks(orders, "")
        if self.sequence is not None:
            seq = tuple(tuple(o) for o in self.sequence)
            object.__setattr__(self, "sequence", seq)
            self._validate_tasks(seq, " (strict sequence)")
        object.__setattr__(
            self, "_priority", tuple({t: i for i, t in enumerate(o)} for o in orders)
        )
        if self.default_caps is None:
            caps = tuple(
                self.peak(r) if self.is_sequence or self.sequence is not None
                else self.num_microbatches
                for r in range(len(orders))
            )
            object.__setattr__(self, "default_caps", caps)
        else:
            caps = tuple(int(c) for c in self.default_caps)
            if len(caps) != len(orders) or min(caps) < 1:
                raise HintError(f"hint {self.name!r} has bad default caps",
                                expected=f"{len(orders)} caps >= 1", got=list(caps))
            object.__setattr__(self, "default_caps", caps)

    def _validate_tasks(self, orders: tuple[tuple[Task, ...], ...], what: str) -> None:
        R = self.placement.num_ranks
        if len(orders) != R:
            raise HintError(
                f"hint {self.name!r}{what} has the wrong number of ranks",
                expected=R, got=len(orders),
            )
        expected = set(
            all_tasks(self.placement.num_chunks, self.num_microbatches, self.split_backward)
        )
        for rank, order in enumerate(orders):
            seen: set[Task] = set()
            for task in order:
                if task in seen:
                    raise HintError(f"hint {self.name!r}{what} lists a task twice",
                                    rank=rank, task=task, expected="each task once", got="twice")
                if task not in expected:
                    raise HintError(
                        f"hint {self.name!r}{what} lists a task that is not part of this step",
                        rank=rank, task=task,
                        expected=f"tasks of {self.placement.num_chunks} chunk(s), "
                        f"{self.num_microbatches} microbatches, "
                        f"{'split' if self.split_backward else 'unsplit'} backward",
                        got=str(task),
                    )
                seen.add(task)
            if len(seen) != len(expected):
                missing = sorted(expected - seen)
                raise HintError(
                    f"hint {self.name!r}{what} misses tasks", rank=rank,
                    expected=f"{len(expected)} tasks",
                    got=f"{len(seen)}; first missing {missing[0]}",
                )

    @property
    def num_ranks(self) -> int:
        return self.placement.num_ranks

    def priority(self, rank: int) -> dict[Task, int]:
        """Task -> hint rank (smaller runs first) on `rank`."""
        return self._priority[rank]

    def strict_order(self, rank: int) -> tuple[Task, ...]:
        """The sequence strict mode runs on `rank`: the order itself, or a rule's derived one."""
        if self.sequence is not None:
            return self.sequence[rank]
        return self.orders[rank]

    def memoised(self, key: Hashable, compute: Callable[[], T]) -> T:
        """`compute()`, once per hint and `key`: what is derived from a hint and shared by all
        its ranks in one process (the simulator runs them all) is derived once."""
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]  # type: ignore[no-any-return]

    def peak(self, rank: int) -> int:
        """Peak in-flight microbatches of this rank when its strict order runs in sequence.
        Memoised: every rank asks for every rank's peak (rank.reservation_holds), O(R^2)."""
        if "peaks" not in self._memo:
            self._memo["peaks"] = tuple(
                peak_in_flight(self.strict_order(r), num_chunks=self.placement.num_chunks,
                               split_backward=self.split_backward)
                for r in range(self.num_ranks))
        return self._memo["peaks"][rank]

    def peak_chunk_activations(self, rank: int) -> int:
        """Peak (chunk, microbatch) activations held on `rank` under its strict order."""
        return peak_chunk_activations(self.strict_order(rank),
                                      split_backward=self.split_backward)

    def check_sequence(self, only_rank: int | None = None) -> None:
        """Refuse an order that breaks a local dependency (what strict mode needs).

        `only_rank` checks that rank alone: each RankRuntime checks its own, so a pipeline of R
        ranks costs O(R) checks, not O(R^2) (minutes at R=128).
        """
        if not self.is_sequence and self.sequence is None:
            raise HintError(
                f"hint {self.name!r} is a priority rule, not a sequence",
                expected="an order hint for strict mode", got="a priority rule",
                fix="use mode='ready', an order hint such as 1f1b, or a rule from make_hint "
                "(which derives a sequence for strict mode)",
            )
        for rank in range(self.num_ranks):
            if only_rank is not None and rank != only_rank:
                continue
            order = self.strict_order(rank)
            bad = first_dependency_violation(order, self.placement, rank, self.split_backward)
            if bad is not None:
                raise HintError(
                    f"hint {self.name!r} runs a task before a local task it needs",
                    rank=rank, task=bad, expected="dependencies in order",
                    got=f"{bad} too early",
                )

    def runs_to_completion(self) -> bool:
        """Whether every rank following its strict sequence, all at once, finishes the step:
        no local dependency out of order and no wait that goes round the ranks. (A rank's own
        check cannot see a cycle through its peers; ready mode reserves only for sequences that
        pass, rank.reservation_holds.) O(tasks), computed once per hint."""
        if "runs" not in self._memo:
            self._memo["runs"] = self.is_sequence or self.sequence is not None
            if self._memo["runs"]:
                self._memo["runs"] = _sequences_complete(self)
        return self._memo["runs"]

    def dumps(self) -> str:
        """The plain text form (see the module's note): a header comment, then one line per rank."""
        return _dumps(self)

    @classmethod
    def loads(cls, text: str, *, name: str = "file", placement: str | None = None) -> "HintOrder":
        """Parse the text form; errors name the file and the line."""
        return _loads(text, name=name, placement=placement)

    @classmethod
    def load(cls, path: str | Path, **kw: object) -> "HintOrder":
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8-sig")
        except OSError as exc:
            raise HintError(f"cannot read hint file {str(p)!r}", expected="a readable text file",
                            got=type(exc).__name__) from None
        except UnicodeDecodeError as exc:
            raise HintError(f"hint file {str(p)!r} is not UTF-8 text", expected="a UTF-8 "
                            "text file", got=f"byte {exc.object[exc.start]:#04x} at offset "
                            f"{exc.start}") from None
        return cls.loads(text, name=str(p), **kw)  # type: ignore[arg-type]

    @classmethod
    def from_orders(
        cls, name: str, placement: Placement, num_microbatches: int, split_backward: bool,
        orders: Iterable[Iterable[Task]], **kw: object,
    ) -> "HintOrder":
        return cls(name, placement, num_microbatches, split_backward,
                   tuple(tuple(o) for o in orders), **kw)  # type: ignore[arg-type]


_HEADER = re.compile(r"^#\s*aioready hint\s+([^:\s]+)\s*:(.*)$")
_KEYS = ("stages", "ranks", "microbatches", "placement", "split_backward", "kind", "caps")


def _dumps(hint: HintOrder) -> str:
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


def _loads(text: str, *, name: str = "file", placement: str | None = None) -> HintOrder:
    """Parse the text form; raise HintError naming the file, the line and what is wrong."""
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
