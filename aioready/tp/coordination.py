"""Tensor-parallel coordination: the TP group's leader chooses, the members follow.

Members of one TP group issue collectives inside every task, and collectives match purely by
issue order (docs/architecture.md "Tensor-parallel coordination"), so all members must run the same
task sequence. In `ready` mode the group's leader (TP rank 0) arbitrates on its own ReadySet and
announces each choice -- step, task kind, microbatch, chunk and a sequence number, one small header
and no payload -- to the other members without waiting (`send_nowait` on a transport over the TP
group). A member never chooses: its chooser offers the leader's next decided task, and only once
that task is ready locally (its inputs may still be in flight: they come, because the upstream
group ran the producing task collectively; docs/hints.md "Why ready mode cannot deadlock").

In `strict` mode every member follows the hint by itself, so `wrap` hands back the ReadySet
unchanged and no decision is sent (unless `follow_in_strict=True`, a benchmark control that
measures the pure cost of coordination on the strict order).

Note [decision wire format]: a decision is a Message of kind DECISION with `stage` = the chunk,
`microbatch`, and `tag` = seq * 4 + kind. The sequence number restarts at 0 each step; the
follower checks it, so a lost, duplicated or reordered decision is a CoordinationError, never a
silent divergence.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Protocol

from ..arbiter import ReadyQueue, Wakeup
from ..errors import AioreadyError, CoordinationError, ProtocolError
from ..ready_set import InFlightReport, ReadySet, ReadySetStatistics
from ..tasks import Kind, Task
from ..transports.base import Message, MessageKind, Transport

__all__ = ["Coordinator", "StepCoordinator", "CoordinatorStatistics", "encode_decision",
           "decode_decision"]

Fail = Callable[[BaseException], None]


class StepCoordinator(Protocol):
    """What RankRuntime needs from a coordinator: a ReadyQueue per step, a flush at its end."""

    def wrap(self, ready: ReadySet, *, step: int, mode: str, wakeup: Wakeup,
             fail: Fail) -> ReadyQueue: ...

    async def wait_sent(self) -> None: ...


@dataclass(frozen=True, slots=True)
class CoordinatorStatistics:
    is_leader: bool
    num_decisions_sent: int  # messages: one per decision per follower
    num_decisions_received: int


def encode_decision(step: int, seq: int, task: Task) -> Message:
    """The DECISION message for the `seq`-th task of `step` (Note [decision wire format])."""
    return Message(step, MessageKind.DECISION, task.chunk, task.microbatch,
                   tag=seq * 4 + int(task.kind))


def decode_decision(msg: Message) -> tuple[int, Task]:
    """(seq, task) of a DECISION message; ProtocolError if it is not a well-formed decision."""
    if msg.kind is not MessageKind.DECISION or msg.tensors:
        raise ProtocolError("the TP channel carries decisions only",
                            expected="a DECISION message with no payload", got=msg.describe())
    try:
        kind = Kind(msg.tag % 4)
    except ValueError:
        raise ProtocolError("decision with an unknown task kind", step=msg.step,
                            expected=[k.value for k in Kind], got=msg.tag % 4) from None
    return msg.tag // 4, Task(kind, msg.microbatch, msg.stage)


class Coordinator:
    """One rank's end of its TP group's decision stream; TP rank 0 (transport rank 0) leads.

    `transport` connects the members of one TP group (an InprocWorld in tests, MPITransport over
    the TP communicator under MPI). Pass the same Coordinator to the rank's RankRuntime.
    With `record=True` each decision's send (leader) or arrival (member) time is kept in
    `times` as (step, seq, time.monotonic()), and a member keeps in `waits`, per task, how long
    it sat idle with that task ready locally, waiting only for the decision: arrival minus the
    later of "ready here" and "previous task ended" (bench/tp.py reads both).
    """

    def __init__(self, transport: Transport, *, record: bool = False,
                 hot_wait_s: float = 0.0, follow_in_strict: bool = False) -> None:
        self.transport = transport
        self.follow_in_strict = follow_in_strict
        self.record = record
        self.hot_wait_s = hot_wait_s
        self.times: list[tuple[int, int, float]] = []
        self.waits: list[float] = []
        self.is_leader = transport.rank == 0
        self._opened = False
        self._step = -1
        self._follower: _FollowerReadySet | None = None
        self._queues: dict[int, deque[Task]] = {}
        self._arrivals: dict[tuple[int, Task], float] = {}
        self._next_seq: dict[int, int] = {}
        self._fail: Fail | None = None
        self._early_error: BaseException | None = None
        self.num_decisions_sent = 0
        self.num_decisions_received = 0

    def wrap(self, ready: ReadySet, *, step: int, mode: str, wakeup: Wakeup,
             fail: Fail) -> ReadyQueue:
        """The ready queue for `step`: the leader's ReadySet that announces, or a follower's.

        In strict mode, `ready` itself: every member follows the hint, nothing is sent.
        """
        if mode == "strict" and not self.follow_in_strict:
            return ready
        if not self._opened:  # inside the running loop: transports may start pollers here
            self.transport.open(self._deliver, on_failure=self.fail)
            self._opened = True
        self._step = step
        self._fail = fail
        for old in [s for s in self._queues if s < step]:
            del self._queues[old]
            self._next_seq.pop(old, None)
        if self.is_leader:
            return _LeaderReadySet(ready, self, step)
        self._follower = _FollowerReadySet(ready, self._queue(step), wakeup, step,
                                           self.transport.rank,
                                           self._arrivals if self.record else None, self.waits,
                                           self._expect if self.hot_wait_s > 0 else None)
        if self._early_error is not None:
            fail(self._early_error)
        return self._follower

    def _queue(self, step: int) -> deque[Task]:
        return self._queues.setdefault(step, deque())

    def _expect(self) -> None:
        """A member waits for a decision: keep the completion engine polling hot a while."""
        from ..progress import ProgressEngine
        ProgressEngine.for_loop().stay_hot(self.hot_wait_s)

    def announce(self, step: int, seq: int, task: Task) -> None:
        """Send the `seq`-th decision of `step` to every member, without waiting."""
        if self.record:
            self.times.append((step, seq, time.monotonic()))
        msg = encode_decision(step, seq, task)
        for dest in range(1, self.transport.world_size):
            self.transport.send_nowait(dest, msg)
            self.num_decisions_sent += 1

    def _deliver(self, msg: Message) -> None:
        try:
            seq, task = decode_decision(msg)
            if self.is_leader:
                raise CoordinationError("the TP leader (TP member 0) received a decision",
                                        step=msg.step, task=task, expected="none (it decides)",
                                        got=f"decision {seq} from a member")
            if not self._step <= msg.step <= self._step + 1:
                raise CoordinationError(f"decision for a step TP member {self.transport.rank} is "
                                        "not running", step=self._step, task=task,
                                        expected=f"step {self._step} or {self._step + 1}",
                                        got=f"step {msg.step}")
            want = self._next_seq.get(msg.step, 0)
            if seq != want:
                raise CoordinationError(f"decision out of sequence at TP member "
                                        f"{self.transport.rank}", step=msg.step, task=task, expected=f"decision {want}",
                                        got=f"decision {seq}")
            self._next_seq[msg.step] = want + 1
            self.num_decisions_received += 1
            if self.record:
                now = time.monotonic()
                self.times.append((msg.step, seq, now))
                self._arrivals[(msg.step, task)] = now
            self._queue(msg.step).append(task)
            if self._follower is not None and msg.step == self._step:
                self._follower.wakeup.notify()
        except AioreadyError as exc:
            self.fail(exc)

    def fail(self, exc: BaseException) -> None:
        """Stop the running step with `exc` (the transport calls this on receive errors)."""
        if self._fail is not None:
            self._fail(exc)
        else:
            self._early_error = exc

    async def wait_sent(self) -> None:
        """Wait until every decision announced so far has left this rank."""
        await self.transport.wait_sent()

    def statistics(self) -> CoordinatorStatistics:
        return CoordinatorStatistics(self.is_leader, self.num_decisions_sent,
                                     self.num_decisions_received)

    def __repr__(self) -> str:
        role = "leader" if self.is_leader else f"member {self.transport.rank}"
        return (f"<Coordinator {role} of {self.transport.world_size} sent="
                f"{self.num_decisions_sent} received={self.num_decisions_received}>")


class _LeaderReadySet(InFlightReport):
    """The leader's ReadySet as a ReadyQueue; every pop is announced before the task runs."""

    __slots__ = ("_inner", "_coord", "_step", "_seq", "flight", "_cap")

    def __init__(self, inner: ReadySet, coord: Coordinator, step: int) -> None:
        self._inner = inner
        self.flight = inner.flight  # the same count object: reports read the leader's own
        self._cap = inner.cap
        self._coord = coord
        self._step = step
        self._seq = 0

    def pop_nowait(self) -> Task | None:
        task = self._inner.pop_nowait()
        if task is not None:
            self._coord.announce(self._step, self._seq, task)
            self._seq += 1
        return task

    def push(self, task: Task) -> None:
        self._inner.push(task)

    def done(self, task: Task) -> None:
        self._inner.done(task)

    def ready_tasks(self) -> list[Task]:
        return self._inner.ready_tasks()

    def statistics(self) -> ReadySetStatistics:
        return self._inner.statistics()

    @property
    def next_in_order(self) -> Task | None:
        return self._inner.next_in_order

    def __len__(self) -> int:
        return len(self._inner)


class _FollowerReadySet(InFlightReport):
    """A member's ReadyQueue; it offers only the leader's next decision, once that is ready.

    In-flight counting uses the leader's rule (ready_set.InFlight) for reports; the cap is the
    leader's to enforce, so none is applied here.
    """

    __slots__ = ("_ready", "_decided", "wakeup", "_step", "_rank", "_cap", "flight", "_done",
                 "_pushed", "_arrivals", "_waits", "_expect", "_idle_since")

    def __init__(self, like: ReadySet, decided: deque[Task], wakeup: Wakeup, step: int,
                 rank: int, arrivals: dict[tuple[int, Task], float] | None,
                 waits: list[float], expect: Callable[[], None] | None) -> None:
        self._expect = expect
        self._idle_since = time.monotonic()
        self._arrivals = arrivals
        self._waits = waits
        self._pushed: dict[Task, float] = {}
        self._ready: set[Task] = set()
        self._decided = decided
        self.wakeup = wakeup
        self._step = step
        self._rank = rank
        self._cap = like.cap
        # the same in-flight rule as the leader's ReadySet (test_coordination checks the peaks)
        self.flight = like.flight.fresh()
        self._done: set[Task] = set()

    def push(self, task: Task) -> None:
        self._ready.add(task)
        if self._arrivals is not None:
            self._pushed[task] = time.monotonic()

    def pop_nowait(self) -> Task | None:
        if not self._decided:
            if self._expect is not None:
                self._expect()
            return None
        task = self._decided[0]
        if task in self._done:
            raise CoordinationError(f"the leader decided a task TP member {self._rank} already "
                                    "ran", step=self._step, task=task,
                                    expected="each task decided once", got="a repeat")
        if task not in self._ready:
            return None  # its input is still in flight; the push that delivers it wakes us
        self._decided.popleft()
        self._ready.remove(task)
        self._done.add(task)
        if self._arrivals is not None:
            arrived = self._arrivals.pop((self._step, task), 0.0)
            since = max(self._pushed.pop(task), self._idle_since)
            self._waits.append(max(0.0, arrived - since))
        self.flight.start(task)
        return task

    def done(self, task: Task) -> None:
        if self._arrivals is not None:
            self._idle_since = time.monotonic()
        self.flight.release(task)

    def ready_tasks(self) -> list[Task]:
        return sorted(self._ready)

    def statistics(self) -> ReadySetStatistics:
        return ReadySetStatistics(len(self._ready), 0, self.flight.count, self.flight.peak,
                                  self._cap)

    @property
    def next_in_order(self) -> Task | None:
        """The leader's next decision (for stall dumps: what this member waits for)."""
        return self._decided[0] if self._decided else None

    def __len__(self) -> int:
        return len(self._ready)
