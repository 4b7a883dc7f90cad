"""RankRuntime: one rank's part of a step -- receive, arbitrate, execute, send.

Messages are routed by header the moment they arrive (the transport calls `_deliver` on the loop
thread): each one satisfies one need of one task, and a task whose needs are all met is pushed
into the ReadySet and wakes the arbiter. The arbiter runs one task at a time on the device; when
a task ends, its output is sent without waiting (`send_nowait`) and its local successor's need is
satisfied. A step ends on a rank when all its tasks ran and all its sends completed.

Messages of the next step may arrive before this rank finished the current one (a faster peer
started it); they are kept and replayed when that step starts. Anything else that matches no
task is a ProtocolError that stops the step.
"""

from __future__ import annotations

import asyncio
import time
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Protocol, Sequence

from ..arbiter import ReadyQueue, Wakeup, run_arbiter
from ..clock import clock_of
from ..devices.base import Device, TaskInfo
from ..errors import AioreadyError, ConfigError, InternalError, ProtocolError
from ..forecast import COST_UNIT, Forecast
from ..held_bytes import HeldBytes
from ..hints import HintOrder
from ..in_flight import is_entry
from ..memory import Budget, format_bytes
from ..progress import ProgressEngine
from ..ready_set import ReadySet
from ..schedulers.listsched import sequence_at_caps
from ..tasks import Kind, Need, Task, step_needs
from ..telemetry.spans import Span, StepReport
from ..transports.base import Message, MessageKind, Transport
from .mb_order import input_bytes
from .notices import Notices

if TYPE_CHECKING:
    from ..tp.coordination import StepCoordinator

__all__ = ["RankRuntime", "Executor", "MODES", "POLICIES", "reservation_holds"]

MODES = ("ready", "strict")
POLICIES = ("reserve", "greedy", "light", "drain")
"""How `ready` mode chooses (docs/policy.md): `reserve` keeps the hint's next task's place and
backfills around it (forecast.py); `greedy` always runs the best-ranked ready task (the first
rule, kept to measure against); `light` is greedy, except that a clearly lighter microbatch's
forward overtakes a heavy one's (ready_set Note [light first]); `drain` is greedy, except that
once a rank has admitted every microbatch, a weight gradient waits for the gradients announced
to arrive before it would end (ready_set Note [drain])."""

KEEP = object()
"""`reschedule(memory=KEEP)`: the byte budget stays as it is."""

BytesModel = Callable[[int, int, int], tuple[float, float]]
"""(step, stage, microbatch) -> (bytes its F holds for backward, its input's bytes): activation
memory where no tensors exist (the simulator, sim/memory.py)."""



def reservation_holds(hint: HintOrder, caps: Sequence[int]) -> bool:
    """Whether ready mode may reserve for the hint's sequence: it has one, and every rank's cap
    admits it. A rank that cannot follow the sequence (a cap below its peak) runs greedily, and
    a neighbour that waits for the sequence's next task could starve it: then nobody reserves
    (docs/policy.md "Why the reservation cannot deadlock"). Every rank asks about every rank:
    cheap, since the hint memoises its peaks and its completion check."""
    return (len(caps) == hint.num_ranks and hint.runs_to_completion()
            and all(cap >= hint.peak(rank) for rank, cap in enumerate(caps)))


class Executor(Protocol):
    """What the runtime needs from a stage (StageExecutor implements it)."""

    def forward(self, mb: int, inputs: tuple[Any, ...], target: Any = None) -> tuple[Any, ...]: ...

    def backward(self, mb: int, grads: Sequence[Any] | None) -> tuple[Any, ...]: ...

    def backward_input(self, mb: int, grads: Sequence[Any] | None) -> tuple[Any, ...]: ...

    def backward_weight(self, mb: int) -> None: ...


def _noop(*_: Any) -> tuple[Any, ...]:
    return ()


class RankRuntime:
    """The coroutines and per-step state of one rank."""

    def __init__(
        self, *, rank: int, hint: HintOrder, mode: str, cap: int | None,
        executors: Sequence[Executor] | None, device: Device, transport: Transport,
        coordinator: StepCoordinator | None = None, policy: str = "reserve",
        caps: Sequence[int] | None = None, memory: Budget | None = None,
        bytes_model: BytesModel | None = None,
    ) -> None:
        if mode not in MODES:
            raise ConfigError("unknown mode", expected=" | ".join(MODES), got=repr(mode))
        self.rank = rank
        self.hint = hint
        self.mode = mode
        self.placement = hint.placement
        self.stages = self.placement.stages_of(rank)
        self.num_stages = self.placement.num_stages
        self.num_microbatches = hint.num_microbatches
        self.split_backward = hint.split_backward
        # tasks.needs, tabulated once: a step copies the counts, a task's end looks up its heir
        self._needs = step_needs(self.stages, self.num_stages, self.num_microbatches,
                                 self.split_backward)
        # one Task object per task: every dict and set of the step (the ReadySet's priority,
        # order, ready and taken sets, the forecast's expected arrivals) then finds its key by
        # identity, without the generated __eq__ (same keys, same values, same order); looked
        # up by its fields (a tuple's hash and compare are C, a Task's are Python)
        self._canon = {(t.kind, t.microbatch, t.chunk): t for t in self._needs.counts}
        self._heir = {self._own(pred): task for pred, task in self._needs.unblocks.items()}
        self._entries = [self._canon[(Kind.F, m, 0)] for m in range(self.num_microbatches)]
        self._senders = {task: self.placement.rank_of(self.stages[task.chunk] +
                                                      (1 if need is Need.GRAD else -1))
                         for task, need in self._needs.messages.items()}
        # (kind, stage, microbatch) of a message -> the task it feeds: one lookup per message,
        # where _route found the chunk, built the Task and checked it (the checks stay for the
        # messages that miss, to name what is wrong)
        self._inbox = {(MessageKind.ACTIVATION if task.kind is Kind.F else MessageKind.GRADIENT,
                        self.stages[task.chunk], task.microbatch): task for task in self._senders}
        self.forecast: Forecast | None = None
        # activation bytes: measured on real stages, modelled in the simulator, gated by
        # `memory` (held_bytes.py; ready_set Note [byte gate])
        self.memory, self._bytes_model = memory, bytes_model
        self.held: HeldBytes | None = None
        measured = executors is not None and any(getattr(e, "measure", False)
                                                 for e in executors)
        if memory is not None or measured or bytes_model is not None:
            self.held = HeldBytes(memory, peak_count=hint.peak(rank),
                                  num_chunks=len(self.stages),
                                  split_backward=hint.split_backward)
        self._configure(hint, mode, cap, policy, caps)
        if executors is not None and len(executors) != len(self.stages):
            raise ConfigError("wrong number of stage modules for this rank", rank=rank,
                              expected=len(self.stages), got=len(executors))
        self.executors = executors
        self.device = device
        self.transport = transport
        self.coordinator = coordinator  # a TP group's decision stream (aioready.tp.coordination)
        self.step_index = -1
        self._active = False
        self._early: dict[int, list[Message]] = {}
        self._error: BaseException | None = None
        self._wakeup = Wakeup()
        self.reports: list[StepReport] = []
        self._handlers = {Kind.F: self._run_f, Kind.B: self._run_b, Kind.W: self._run_w}
        self._opened = False
        # the transport's notice board (transports/notice_board.py), if it offers one
        self._board: Any = None
        self._now: Callable[[], float] = time.monotonic
        self._engine: ProgressEngine | None = None  # the loop's completion engine, if any
        self.num_events = 0  # messages in, tasks started and ended: the watchdogs' progress count
        self._control_handlers: list[Callable[[Message], None]] = []
        self.running_task: Task | None = None
        self._task_start = 0.0
        # called with a chunk once its last backward piece of the step ended (aioready/dp)
        self.grads_ready: Callable[[int], None] | None = None
        self._final_kind = Kind.W if self.split_backward else Kind.B

    def _configure(self, hint: HintOrder, mode: str, cap: int | None, policy: str,
                   caps: Sequence[int] | None) -> None:
        rank = self.rank
        if policy not in POLICIES:
            raise ConfigError("unknown ready-mode policy", expected=" | ".join(POLICIES),
                              got=repr(policy))
        default_cap = hint.default_caps[rank]  # type: ignore[index]
        cap = default_cap if cap is None else cap
        if cap < 1:
            raise ConfigError("cap must admit at least one microbatch", expected=">= 1",
                              got=cap, rank=rank)
        if mode == "strict":
            hint.check_sequence(only_rank=rank)
            if cap < hint.peak(rank):
                raise ConfigError(
                    f"strict mode cannot run hint {hint.name!r} under this cap", rank=rank,
                    expected=f"cap >= the hint's peak in-flight ({hint.peak(rank)})",
                    got=cap, fix="raise the cap or use mode='ready'")
        self.hint, self.mode, self.cap = hint, mode, cap
        self._policy, self._caps = policy, None if caps is None else list(caps)
        reserving = (mode == "ready" and policy == "reserve" and caps is not None
                     and reservation_holds(hint, caps))
        self.policy = policy if mode == "ready" else "strict"
        light = mode == "ready" and policy == "light"  # needs the carried cost factors
        drain = mode == "ready" and policy == "drain"  # needs notices and durations
        self._reserving, self._light, self._drain = reserving, light, drain
        if not (reserving or light or drain):
            self.forecast = None
        elif self.forecast is None:  # a new hint keeps the durations learnt so far
            self.forecast = Forecast()
        # above the hint's own peaks (a count budget), protect the sequence run at those caps
        raised = (reserving and self.memory is None and caps is not None
                  and any(c > hint.peak(r) for r, c in enumerate(caps)))
        self._reserve_hint = sequence_at_caps(hint, caps) if raised else hint  # type: ignore[arg-type]
        self._hint_peak = self._reserve_hint.peak(rank) if reserving else 0
        if self.held is not None:
            self.held.peak_count = hint.peak(rank)
        self._notices = (Notices(rank, self.placement, self.stages, self._senders)
                         if reserving or drain else None)
        canon = self._own
        self._priority = {canon(task): i for task, i in hint.priority(rank).items()}
        self._strict_order = (tuple(map(canon, hint.strict_order(rank))) if mode == "strict"
                              else None)
        self._reserve_order = (tuple(map(canon, self._reserve_hint.strict_order(rank)))
                               if reserving else None)

    def _own(self, task: Task) -> Task:
        """This runtime's Task object equal to `task`."""
        return self._canon[(task.kind, task.microbatch, task.chunk)]

    def reschedule(self, hint: HintOrder, mode: str, cap: int | None, *,
                   caps: Sequence[int] | None = None, policy: str | None = None,
                   memory: Budget | None | object = KEEP) -> None:
        """Run the next steps under another hint, mode or cap (what hint="auto" switches).

        Between steps only, and to a hint of the same placement and step shape: the tabulated
        needs and senders depend on nothing else, and a step's ReadySet is built at its start.
        `caps` (every rank's) and `policy` decide the reservation as in the constructor; the
        policy stays as it was unless given, and so does the byte budget (`memory`: a Budget,
        or None for none; the ledger of measured bytes is kept either way).
        """
        if self._active:
            raise RuntimeError(f"rank {self.rank}: cannot reschedule during step "
                               f"{self.step_index}")
        if mode not in MODES:
            raise ConfigError("unknown mode", expected=" | ".join(MODES), got=repr(mode))
        mine = (self.placement, self.num_microbatches, self.split_backward)
        if (hint.placement, hint.num_microbatches, hint.split_backward) != mine:
            raise ConfigError(f"hint {hint.name!r} has another placement or step shape",
                              rank=self.rank, expected=f"{mine}", got=f"{hint.placement}, "
                              f"{hint.num_microbatches}, {hint.split_backward}")
        if memory is not KEEP:
            self.memory = memory  # type: ignore[assignment]
            if self.held is not None:
                self.held.budget = memory  # type: ignore[assignment]
        self._configure(hint, mode, cap, self._policy if policy is None else policy, caps)

    # -- per-step state -------------------------------------------------------------------
    def _reset(self, step: int, inputs: Sequence[Any] | None, targets: Sequence[Any] | None
               ) -> None:
        self.step_index = step
        n_chunks = len(self.stages)
        M = self.num_microbatches
        forecast, board = self.forecast, self._board is not None and self._notices is not None
        if board:  # old records go, in C (transports/notice_board.py)
            self._board.read(None, step)
        ready = ReadySet(
            self._priority, cap=self.cap, num_chunks=n_chunks,
            split_backward=self.split_backward, strict_order=self._strict_order,
            reserve_order=self._reserve_order,
            reserve_peak=self._hint_peak,
            fits=(self._read_fits if board else forecast.fits  # type: ignore[union-attr]
                  ) if self._reserving else None, held=self.held,
            lightness=self.forecast.carried if self._light else None,  # type: ignore[union-attr]
            drain=(self._read_clear if board else forecast.clear_of_gradients  # type: ignore
                   ) if self._drain else None,
            entries=M)
        self._ready: ReadyQueue = ready
        if self.coordinator is not None:
            self._ready = self.coordinator.wrap(ready, step=step, mode=self.mode,
                                                wakeup=self._wakeup, fail=self.fail)
        self._missing: dict[Task, int] = dict(self._needs.counts)
        self._backward_left = [M] * n_chunks
        self._ready_at: dict[Task, float] = {}
        self._acts: dict[tuple[int, int], tuple[Any, ...]] = {}
        self._grads: dict[tuple[int, int], tuple[Any, ...]] = {}
        self._targets = targets
        self._loss: Any = None
        self._report = StepReport(step, num_ranks=self.placement.num_ranks)
        self._now = clock_of(asyncio.get_running_loop())
        if self.forecast is not None:
            self.forecast.new_step(self._now)
        if self.held is not None:
            self.held.new_step()
        self._report.start = self._now()
        if self.stages[0] == 0:  # checked before the step is active: the next one can run
            if inputs is None and self.executors is None:
                inputs = [()] * M
            if inputs is None or len(inputs) != M:
                raise ConfigError("the rank holding stage 0 needs the step's microbatches",
                                  rank=self.rank, step=step, expected=f"{M} microbatches",
                                  got=None if inputs is None else len(inputs))
        if self.executors is not None and self.num_stages - 1 in self.stages and \
                (targets is None or len(targets) != M):  # not a StageError from loss_fn later
            raise ConfigError("the rank holding the last stage needs the step's targets",
                              rank=self.rank, step=step, expected=f"{M} microbatches",
                              got=None if targets is None else len(targets),
                              fix="pass targets to step(); a loss_fn that ignores them: "
                              f"a list of {M} Nones")
        self._active = True
        if self.stages[0] == 0:
            assert inputs is not None
            for m, x in enumerate(inputs):
                self._acts[(0, m)] = x if isinstance(x, tuple) else (x,)
                self._note_input(m, self._acts[(0, m)])
                self._satisfy(self._entries[m])
        for msg in self._early.pop(step, []):
            self._route(msg)

    def _satisfy(self, task: Task) -> None:
        left = self._missing[task] - 1
        self._missing[task] = left
        if left == 0:
            self._ready_at[task] = self._now()
            self._ready.push(task)
            self._wakeup.notify()

    # -- messages -------------------------------------------------------------------------
    def add_control_handler(self, handler: Callable[[Message], None]) -> None:
        """Have `handler` see every CONTROL message (heartbeats and peers' errors, faults.py);
        without one, a CONTROL message is a ProtocolError like any unexpected kind."""
        self._control_handlers.append(handler)

    def _deliver(self, msg: Message) -> None:
        if msg.kind is MessageKind.NOTICE:
            self._notice(msg)
            return
        if msg.kind is MessageKind.CONTROL and self._control_handlers:
            for handler in self._control_handlers:  # not progress of the step
                handler(msg)
            return
        self.num_events += 1
        try:
            if msg.kind not in (MessageKind.ACTIVATION, MessageKind.GRADIENT):
                raise ProtocolError("message kind this runtime does not handle", rank=self.rank,
                                    expected="activation or gradient", got=msg.describe())
            if self._active and msg.step == self.step_index:
                self._route(msg)
            elif msg.step == self.step_index + 1:
                self._early.setdefault(msg.step, []).append(msg)
            else:
                raise ProtocolError(
                    "message for a step this rank is not running", rank=self.rank,
                    step=self.step_index, expected=f"step {self.step_index} or "
                    f"{self.step_index + 1}", got=msg.describe())
        except AioreadyError as exc:
            self.fail(exc)

    def _notice(self, msg: Message) -> None:
        """A peer started the task that feeds one of ours (runtime/notices.py). Advisory: one
        for a step this rank is not running (late after the message itself, or early) is
        dropped."""
        self._notice_fields(msg.step, msg.stage, msg.microbatch, msg.tag)

    def _notice_fields(self, step: int, stage: int, microbatch: int, tag: int,
                       at: float | None = None) -> None:
        """`_notice` of the fields alone: what the MPI transport's compiled probe hands over
        (transport.route_notices; docs/hot_path_measurements.md "The notice's read in one C
        call"), and a notice board's record with its sender's start time `at`."""
        if self._notices is None or not self._active or step != self.step_index:
            return
        try:
            task, duration = self._notices.read_fields(step, stage, microbatch, tag,
                                                       self.num_microbatches)
        except ProtocolError as exc:
            self.fail(exc)
            return
        if self._missing.get(task, 0) > 0:  # else its message came first: nothing to expect
            self.forecast.notice(task, duration, at)  # type: ignore[union-attr]
        elif at is not None:  # a board's record read late: the duration still counts
            self.forecast.announced(task, duration)  # type: ignore[union-attr]

    def _board_notice(self, step: int, stage: int, microbatch: int, tag: int,
                      at: float) -> None:
        """A notice board's record (a peer's bytes: checked as a notice's header is)."""
        if at - at != 0.0:  # NaN or infinite (math.isfinite without its call)
            self.fail(ProtocolError("notice dated at a time that is not finite",
                                    rank=self.rank, step=step, expected="a finite time",
                                    got=f"at={at!r} for stage {stage} microbatch {microbatch}"))
            return
        self._notice_fields(step, stage, microbatch, tag, at)

    def fail(self, exc: BaseException) -> None:
        """Stop the running step with `exc` (from a message handler or a watchdog)."""
        if self._error is None:
            self._error = exc
        self._wakeup.fail(exc)

    def _route(self, msg: Message) -> None:
        task = self._inbox.get((msg.kind, msg.stage, msg.microbatch))
        if task is None:
            self._unroutable(msg)
        chunk = task.chunk
        key = (chunk, msg.microbatch)
        store = self._acts if task.kind is Kind.F else self._grads
        if key in store or self._missing.get(task, 0) <= 0:
            raise ProtocolError("duplicate message", rank=self.rank, step=msg.step,
                                task=task, expected="one message per task", got=msg.describe())
        store[key] = msg.tensors
        if chunk == 0 and msg.kind is MessageKind.ACTIVATION:
            self._note_input(msg.microbatch, msg.tensors)
        if self.forecast is not None:
            self.forecast.arrived(task)
            if msg.kind is MessageKind.ACTIVATION and msg.tag:
                self.forecast.carry(msg.microbatch, msg.tag / COST_UNIT)
        self._satisfy(task)

    def _unroutable(self, msg: Message) -> NoReturn:
        """Raise the ProtocolError that says why `msg` feeds no task of this rank."""
        if msg.stage not in self.stages:
            raise ProtocolError("message for a stage this rank does not hold", rank=self.rank,
                                step=msg.step, expected=f"stages {list(self.stages)}",
                                got=msg.describe())
        if not 0 <= msg.microbatch < self.num_microbatches:
            raise ProtocolError("message for an unknown microbatch", rank=self.rank,
                                step=msg.step, expected=f"0..{self.num_microbatches - 1}",
                                got=msg.describe())
        raise ProtocolError("message kind that this stage never receives", rank=self.rank,
                            step=msg.step, expected="activations for stages > 0, gradients "
                            "for stages < last", got=msg.describe())

    # -- the step -------------------------------------------------------------------------
    def open(self) -> None:
        """Open the transport (once; inside the loop, so transports may start their pollers):
        from here on, messages are routed, and those of the next step kept for it."""
        if not self._opened:
            self.transport.open(self._deliver, on_failure=self.fail)
            route = getattr(self.transport, "route_notices", None)  # the MPI transport's
            if route is not None and self._notices is not None:
                route(self._notice_fields)
            self._board = getattr(self.transport, "notice_board", None)
            self._opened = True

    async def run_step(self, step: int, inputs: Sequence[Any] | None = None,
                       targets: Sequence[Any] | None = None) -> Any:
        """Run this rank's tasks of `step`; return the loss on the last stage, else None."""
        if self._active:
            raise RuntimeError(f"rank {self.rank}: step {self.step_index} is still running")
        self._error = None
        self.open()
        self._reset(step, inputs, targets)
        try:
            engine = self._engine = ProgressEngine.existing()
            await run_arbiter(self._ready, self._execute, self._wakeup, len(self._missing),
                              self._check, None if engine is None else engine.set_waiting)
            if self._board is not None and self._notices is not None:
                self._board.read(None, step + 1)  # this step's unread records go
            await self.transport.wait_sent()
            if self.coordinator is not None:
                await self.coordinator.wait_sent()
        except AioreadyError as exc:
            exc.locate(rank=self.rank, step=step)
            raise
        except Exception as exc:
            raise InternalError(f"unexpected {type(exc).__name__} in the runtime: {exc}; "
                                "please file a bug", rank=self.rank, step=step) from exc
        finally:
            self._active = False
        self._report.end = self._now()
        self._report.peak_in_flight[self.rank] = self._ready.peak_in_flight
        if self.held is not None:
            self._report.peak_activation_bytes[self.rank] = int(self.held.peak)
        self.reports.append(self._report)
        return self._loss

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def _read_board(self) -> None:
        """Read the notice board's records of this step where the forecast is consulted, so
        that it sees every record posted before (transports/notice_board.py Note [no ring, read
        where consulted]); a bad record aborts the step there."""
        self._board.read(self._board_notice, self.step_index)
        if self._error is not None:
            raise self._error

    def _read_fits(self, candidate: Task, reserved: Task) -> bool:
        """`Forecast.fits` after reading the board."""
        self._read_board()
        return self.forecast.fits(candidate, reserved)  # type: ignore[union-attr]

    def _read_clear(self, candidate: Task) -> bool:
        """`Forecast.clear_of_gradients` after reading the board."""
        self._read_board()
        return self.forecast.clear_of_gradients(candidate)  # type: ignore[union-attr]

    async def _execute(self, task: Task) -> None:
        stage = self.stages[task.chunk]
        info = TaskInfo(self.step_index, self.rank, stage, task.chunk, task.microbatch,
                        task.kind)
        forecast = self.forecast
        start = self._now()
        if self._notices is not None:  # tell the rank this task feeds that it starts now
            if self._board is None:
                sent = self._notices.announce(task, forecast, self.step_index)  # type: ignore
                if sent is not None:
                    self.transport.send_nowait(*sent)
            else:
                self._post_notice(task, start)
        self.num_events += 1
        self.running_task = task
        self._task_start = start
        if self.held is not None and is_entry(task):
            self.held.admit(task.microbatch)
        await self._handlers[task.kind](task, stage, info)
        self.running_task = None
        self.num_events += 1
        end = self._now()
        if forecast is not None and task.kind is not Kind.F:
            forecast.observe(task, end - start)
        self._report.spans.append(Span(self.rank, stage, task.chunk, task.microbatch, task.kind,
                                       self._ready_at.pop(task, start), start, end))
        self._ready.done(task)
        if self.held is not None:
            self.held.release(task)
        if task.kind is self._final_kind and self.grads_ready is not None:
            self._backward_left[task.chunk] -= 1
            if not self._backward_left[task.chunk]:
                self.grads_ready(task.chunk)
        heir = self._heir.get(task)
        if heir is not None:
            self._satisfy(heir)
        if self._engine is not None:  # the next decision sees what arrived during the task
            self._engine.task_ended()

    def _post_notice(self, task: Task, start: float) -> None:
        """The notice of `task`, started at `start`, on the transport's notice board, or a
        Message where its ring is full (runtime/notices.py)."""
        notices, board = self._notices, self._board
        fields = notices.fields(task, self.forecast)  # type: ignore[union-attr,arg-type]
        if fields is None:
            return
        peer, stage, tag = fields
        if not board.post(peer, self.step_index, stage, task.microbatch, tag, start):
            self.transport.send_nowait(peer, notices.message(  # type: ignore[union-attr]
                self.step_index, stage, task.microbatch, tag))
        # (no doorbell for a posted one: the receiver reads it at its next decision)

    def _measure_forward(self, task: Task) -> int:
        """Record a forward's duration; return the cost factor its activation carries on."""
        forecast = self.forecast
        if forecast is None:
            return 0
        factor = forecast.forward_ended(task, self._now() - self._task_start)
        tag = round(factor * COST_UNIT)  # min(2**32 - 1, max(1, tag)): forecast Note [no min/max]
        return 1 if tag < 1 else 2**32 - 1 if tag > 2**32 - 1 else tag

    def _note_input(self, microbatch: int, tensors: tuple[Any, ...]) -> None:
        """The entry F's input arrived: its size scales the microbatch's predicted bytes."""
        if self.held is None:
            return
        if self._bytes_model is not None:
            size = self._bytes_model(self.step_index, self.stages[0], microbatch)[1]
        else:  # tensors (or arrays) say their size; anything else holds no activation memory
            size = int(input_bytes(tensors))  # the size the microbatch order reads too
        self.held.inputs(microbatch, size)

    def _measure_bytes(self, task: Task, stage: int) -> None:
        """After an F: the bytes it keeps for backward (measured by the stage, or modelled)."""
        if self.held is None:
            return
        if self._bytes_model is not None:
            nbytes = self._bytes_model(self.step_index, stage, task.microbatch)[0]
        else:
            executor = None if self.executors is None else self.executors[task.chunk]
            measure = getattr(executor, "held_bytes", None)
            if measure is None:  # nothing measures: the gate admits only into an empty rank
                return
            nbytes = measure(task.microbatch)
            if nbytes is None:
                return
            self._report.activation_bytes[(stage, task.microbatch)] = (
                float(nbytes), self.held.input_of(task.microbatch))
        self.held.measured(task.microbatch, task.chunk, nbytes)

    def _fn(self, chunk: int, name: str) -> Callable[..., Any]:
        if self.executors is None:
            return _noop
        return getattr(self.executors[chunk], name)  # type: ignore[no-any-return]

    async def _run_f(self, task: Task, stage: int, info: TaskInfo) -> None:
        inputs = self._acts.pop((task.chunk, task.microbatch))
        last = stage == self.num_stages - 1
        target = self._targets[task.microbatch] if last and self._targets is not None else None
        out = await self.device.run(info, partial(self._fn(task.chunk, "forward"),
                                                  task.microbatch, inputs, target))
        factor = self._measure_forward(task)
        self._measure_bytes(task, stage)
        if last:
            if out:
                self._loss = out[0] if self._loss is None else self._loss + out[0]
        else:
            self._send(MessageKind.ACTIVATION, stage + 1, task.microbatch, out, factor)

    async def _run_b(self, task: Task, stage: int, info: TaskInfo) -> None:
        grads = self._grads.pop((task.chunk, task.microbatch), None)
        name = "backward_input" if self.split_backward else "backward"
        out = await self.device.run(info, partial(self._fn(task.chunk, name),
                                                  task.microbatch, grads))
        if stage > 0:
            self._send(MessageKind.GRADIENT, stage - 1, task.microbatch, out)

    async def _run_w(self, task: Task, stage: int, info: TaskInfo) -> None:
        await self.device.run(info, partial(self._fn(task.chunk, "backward_weight"),
                                            task.microbatch))

    def _send(self, kind: MessageKind, stage: int, mb: int, tensors: tuple[Any, ...],
              tag: int = 0) -> None:
        msg = Message(self.step_index, kind, stage, mb, tuple(tensors or ()), tag, self.rank)
        self.transport.send_nowait(self.placement.rank_of(stage), msg)

    # -- introspection --------------------------------------------------------------------
    def live(self) -> dict[str, Any]:
        """What a live view reads, from any thread (telemetry/dashboard.py): the running (else
        last) step's report so far, whether a step runs, its ready tasks, microbatches in
        flight and cap, and the task on the device."""
        ready = getattr(self, "_ready", None)
        return {"report": getattr(self, "_report", None), "active": self._active,
                "ready": len(ready) if hasattr(ready, "__len__") else None,
                "in_flight": None if ready is None else ready.in_flight, "cap": self.cap,
                "running": None if self.running_task is None else str(self.running_task)}

    def pending_receives(self) -> list[tuple[Task, int]]:
        """Tasks still waiting on a message, with the rank that must send it (best first)."""
        if not self._active:
            return []
        out = []
        for task, sender in self._senders.items():
            store = self._acts if task.kind is Kind.F else self._grads
            if self._missing[task] > 0 and (task.chunk, task.microbatch) not in store:
                out.append((task, sender))
        priority = self.hint.priority(self.rank)
        return sorted(out, key=lambda tr: priority[tr[0]])

    def dump(self) -> str:
        """A one-screen summary of where this rank stands (for stall and fault reports)."""
        if not self._active:
            return f"rank {self.rank}: idle after step {self.step_index}"
        waiting = sorted(str(t) for t, n in self._missing.items() if n > 0)
        done = {Task(Kind(s.kind), s.microbatch, s.chunk) for s in self._report.spans}
        order = self.hint.orders[self.rank]
        pos = next((i for i, t in enumerate(order) if t not in done), len(order))
        recv = [f"{t}<-rank {r}" for t, r in self.pending_receives()]
        return (f"rank {self.rank} step {self.step_index} ({self.mode}): running "
                f"{self.running_task or '-'}, ready "
                f"{[str(t) for t in self._ready.ready_tasks()]}, in flight "
                f"{self._ready.in_flight}/{self.cap} microbatches "
                f"{self._ready.in_flight_microbatches}{self._bytes_held()}, done {len(done)}/{len(self._missing)}, "
                f"hint position {pos}/{len(order)} (next {order[pos] if pos < len(order) else '-'}"
                f", {self._holds()}), pending receives {len(recv)} "
                f"{recv[:8]}, waiting on {len(waiting)} tasks (first {waiting[:6]})")

    def _bytes_held(self) -> str:
        held = self.held
        if held is None or self.memory is None:
            return ""
        budget = held.budget_bytes()
        return (f" holding {format_bytes(held.held)} of "
                f"{'-' if budget is None else format_bytes(budget)} ({self.memory})")

    def _holds(self) -> str:
        """What the queue holds the device for: the strict next task, or the reserved one."""
        reserved = getattr(self._ready, "reserved", None)
        if reserved is not None:
            return f"reserved for {reserved}"
        return f"strict next {self._ready.next_in_order}"

    def __repr__(self) -> str:
        return f"<RankRuntime rank={self.rank} mode={self.mode} cap={self.cap} stages={self.stages}>"
