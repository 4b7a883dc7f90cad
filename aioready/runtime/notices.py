"""Notices: the reserving policy's one message, "I started the task that feeds yours".

A rank that starts a task whose output goes to another rank (an F to the next stage, a B's input
gradient to the previous one) tells that rank when to expect it, so the receiver's forecast
(aioready/forecast.py) knows whether its reserved task is near. A notice is header only: the
receiver's stage and microbatch, and a tag holding the expected duration in millionths of the
clock's unit (forecast.encode_duration) with NOTICE_B set when it feeds a B. Notices are advisory:
one for a step the receiver is not running is dropped, and none is needed for correctness.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from ..errors import ProtocolError
from ..forecast import Forecast, decode_duration, encode_duration
from ..placement import Placement
from ..tasks import Kind, Task
from ..transports.base import Message, MessageKind

__all__ = ["Notices", "NOTICE_B"]

NOTICE_B = 1 << 31
"""The tag bit of a notice that feeds a B (clear: it feeds an F)."""


class Notices:
    """Whom one rank tells when its tasks start, and what a peer's notice means there."""

    __slots__ = ("rank", "stages", "_targets", "_chunk_of", "_tasks")

    def __init__(self, rank: int, placement: Placement, stages: Sequence[int],
                 fed: Iterable[Task] = ()) -> None:
        """`fed`: the runtime's own Task objects of the tasks a message feeds, named in
        advance, so that a notice's lookup finds them (and is a dict hit from the first one)."""
        self.rank = rank
        self.stages = tuple(stages)
        self._chunk_of = {stage: chunk for chunk, stage in reversed(list(enumerate(stages)))}
        # (chunk, kind) -> (peer rank, the peer's stage, tag bit): outputs that leave the rank
        self._targets: dict[tuple[int, Kind], tuple[int, int, int]] = {}
        # (stage, microbatch, NOTICE_B bit) -> the Task a notice names, once checked: one
        # lookup per notice (a notice per task that feeds a peer) instead of a new Task
        self._tasks: dict[tuple[int, int, int], Task] = {
            (self.stages[t.chunk], t.microbatch, NOTICE_B if t.kind is Kind.B else 0): t
            for t in fed}
        last = placement.num_stages - 1
        for chunk, stage in enumerate(self.stages):
            if stage < last and placement.rank_of(stage + 1) != rank:
                self._targets[(chunk, Kind.F)] = (placement.rank_of(stage + 1), stage + 1, 0)
            if stage > 0 and placement.rank_of(stage - 1) != rank:
                self._targets[(chunk, Kind.B)] = (placement.rank_of(stage - 1), stage - 1,
                                                  NOTICE_B)

    def announce(self, task: Task, forecast: Forecast, step: int) -> tuple[int, Message] | None:
        """(peer, notice) for `task` starting now, or None (its output stays here, or there is
        no estimate yet). The duration sent is the early side of the estimate: a feeder that
        runs short must not find the receiver busy. The notice names this rank as its source
        (the in-process transport then delivers it as it is, docs/hot_path_measurements.md)."""
        fields = self.fields(task, forecast)
        if fields is None:
            return None
        peer, stage, tag = fields
        return peer, Message(step, MessageKind.NOTICE, stage, task.microbatch, (), tag,
                             self.rank)  # (not `message`: one call less a notice)

    def message(self, step: int, stage: int, microbatch: int, tag: int) -> Message:
        """The notice as a Message from this rank (`fields` of it with the step)."""
        return Message(step, MessageKind.NOTICE, stage, microbatch, (), tag, self.rank)

    def fields(self, task: Task, forecast: Forecast) -> tuple[int, int, int] | None:
        """`announce` without a Message: (peer, the peer's stage, tag), what a notice board's
        record holds (transports/notice_board.py) with the step, microbatch and start time."""
        target = self._targets.get((task.chunk, task.kind))
        if target is None:
            return None
        duration = forecast.early_estimate(task)
        if duration is None:
            return None
        peer, stage, bit = target
        tag = encode_duration(duration)  # at most NOTICE_B - 1 (forecast Note [no min/max])
        return peer, stage, (tag if tag < NOTICE_B else NOTICE_B - 1) | bit

    def read(self, msg: Message, num_microbatches: int) -> tuple[Task, float]:
        """The local task a peer's notice is about, and the duration it announced."""
        return self.read_fields(msg.step, msg.stage, msg.microbatch, msg.tag, num_microbatches)

    def read_fields(self, step: int, stage: int, microbatch: int, tag: int,
                    num_microbatches: int) -> tuple[Task, float]:
        """`read` of a notice's fields as the compiled probe hands them (no Message)."""
        task = self._tasks.get((stage, microbatch, tag & NOTICE_B))
        if task is None:
            chunk = self._chunk_of.get(stage)
            if chunk is None or not 0 <= microbatch < num_microbatches:
                got = f"notice for stage {stage} microbatch {microbatch} step {step}"
                raise ProtocolError("notice for a task this rank does not hold",
                                    rank=self.rank, step=step,
                                    expected=f"stages {list(self.stages)}", got=got)
            task = self._tasks[(stage, microbatch, tag & NOTICE_B)] = Task(
                Kind.B if tag & NOTICE_B else Kind.F, microbatch, chunk)
        return task, decode_duration(tag & ~NOTICE_B)
