"""Failure detection across ranks: heartbeats, a peer timeout, and error broadcast.

Two ways a rank learns that a peer is gone, both without waking the arbiter:
- Error broadcast. A rank whose step fails (its stage raised, it lost a peer, it stalled) sends a
  CONTROL message with the error text to every peer before it stops. A peer that receives it stops
  its own step at once with StageError (the remote stage raised) or PeerLostError (anything
  else), quoting the text, so the job ends with the message of the rank that failed.
- Heartbeats. Every `peer_timeout / 4` seconds each rank sends a tiny CONTROL message to every
  peer (a loop timer, independent of the arbiter). During a step, a peer this rank waits on (a
  pending receive comes from it) that sent nothing for `peer_timeout` seconds is declared lost:
  PeerLostError names it, the step and the tasks waiting on it. Only awaited peers are checked,
  so a peer that finished its part of the step early and left is never blamed. A rank that died
  without a word (SIGKILL) or stopped answering (SIGSTOP, a hung driver) is thus detected in
  1x to 1.25x the timeout; under MPICH's mpiexec a killed rank usually takes the job down first.
- Job-wide waits. Outside a step a rank also waits on its peers: the start barrier, the report
  gather, the final reduce, a transport's close. `watch(awaitable, what)` runs such a wait under
  the same timeout, against every peer (all take part in a collective): a peer silent for
  `peer_timeout` ends it with PeerLostError naming the peer and the wait, and a peer's error
  broadcast ends it at once. Heartbeats start with the first watch or step (`start`), so a rank
  that stops before its first step is caught too.

CONTROL messages carry their meaning in the header (tag: heartbeat or error kind) and an error's
text as a uint8 tensor, never a pickle; who sent one is the message's `source`, which the
receiving transport sets. The monitor sees them through `runtime.add_control_handler`.
Configuration, in order: the `peer_timeout=` argument, AIOREADY_PEER_TIMEOUT, then 30 s; None, 0
or "off" disables.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any, Awaitable, TypeVar

from ..errors import PeerLostError, ProtocolError, StageError
from ..transports.base import Message, MessageKind
from ..transports.header import MAX_CONTROL_BYTES
from .watchdog import StepGuard

__all__ = ["PeerMonitor", "PEER_TIMEOUT_S", "HEARTBEAT", "STAGE_FAILED", "RANK_FAILED",
           "MAX_ERROR_BYTES"]

PEER_TIMEOUT_S = 30.0
HEARTBEAT, STAGE_FAILED, RANK_FAILED = 1, 2, 3
MAX_ERROR_BYTES = MAX_CONTROL_BYTES - 256  # the receiver's decoder refuses more; room to seal
FLUSH_S = 1.0  # how long a failing rank waits for its error broadcast to leave

log = logging.getLogger(__name__)
T = TypeVar("T")


class PeerMonitor:
    """Heartbeats to every peer, the peer timeout, and error broadcast for one rank."""

    def __init__(self, runtime: Any, guard: StepGuard, timeout: float | None) -> None:
        self.runtime = runtime
        self.transport = runtime.transport
        self.guard = guard
        self.timeout = timeout
        self.rank = runtime.rank
        self.world_size = self.transport.world_size
        self.peers = [r for r in range(self.world_size) if r != self.rank]
        self._last_seen: dict[int, float] = {}
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0
        self._remote_error: BaseException | None = None
        self._broadcast_done = False
        self.job_guard = StepGuard()  # runs the job-wide waits of `watch`
        self._watching = ""
        runtime.add_control_handler(self._on_control)
        guard.on_start.append(self._arm)
        guard.on_error.append(self.broadcast_error)
        self.job_guard.on_error.append(self.broadcast_error)

    # -- heartbeats and the peer timeout ---------------------------------------------------
    def _arm(self, step: int) -> None:
        """At each step start: a fresh timeout for every peer; start the heartbeat timer."""
        if self._remote_error is not None:  # a peer failed between steps: it is gone
            self.guard.abort(self._remote_error)
            return
        self._broadcast_done = False
        if self.timeout is None:
            return
        now = asyncio.get_running_loop().time()
        self._last_seen = {r: now for r in self.peers}
        self.start()

    def start(self) -> None:
        """Start the heartbeats (once, on the running loop): the first a quarter timeout later,
        once peers are open. Peers not heard from yet count as seen now."""
        if self.timeout is None or self._handle is not None:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        for r in self.peers:
            self._last_seen.setdefault(r, now)
        self._schedule(loop)

    async def watch(self, awaitable: Awaitable[T], what: str) -> T:
        """Await a job-wide wait (`what`: "the start barrier", ...) under the peer timeout,
        against every peer; a peer's error broadcast ends it too (see the module note)."""
        if self._remote_error is not None:
            raise self._remote_error
        self.start()
        now = asyncio.get_running_loop().time()
        self._last_seen = {r: max(self._last_seen.get(r, now), now - self._grace()) for r in
                           self.peers}
        self._watching = what
        self._broadcast_done = False
        try:
            return await self.job_guard.run(awaitable, max(self.runtime.step_index, 0))
        finally:
            self._watching = ""

    def _grace(self) -> float:
        """A peer silent before a wait began is lost a timeout after its last word, but never
        sooner than a quarter timeout into the wait (its beat may be on the way)."""
        return 0.75 * self.timeout if self.timeout is not None else 0.0

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        interval = self.timeout / 4  # type: ignore[operator]
        self._due = loop.time() + interval
        self._handle = loop.call_at(self._due, self._tick)

    def _beat(self) -> None:
        step = max(self.runtime.step_index, 0)
        for peer in self.peers:
            self._send(peer, Message(step, MessageKind.CONTROL, 0, 0, (), HEARTBEAT))

    def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        if now - self._due > self.timeout / 8:  # type: ignore[operator]
            # this loop was blocked: peers' heartbeats may be queued unread; start afresh
            self._last_seen = {r: now for r in self.peers}
        self._beat()
        if self.guard.running:
            self._check(now)
        elif self.job_guard.running:
            self._check_all(now)
        self._schedule(loop)

    def _check(self, now: float) -> None:
        waits: dict[int, list[str]] = {}
        for task, src in self.runtime.pending_receives():
            waits.setdefault(src, []).append(str(task))
        for peer, tasks in waits.items():
            silent = now - self._last_seen.get(peer, now)
            if silent >= self.timeout:  # type: ignore[operator]
                error = PeerLostError(
                    f"peer rank {peer} of {self.world_size} sent nothing for {silent:.3g} s "
                    f"(peer_timeout={self.timeout:g} s): it died or stopped answering; this rank "
                    f"waits on it for {', '.join(tasks[:6])}", rank=self.rank,
                    step=self.runtime.step_index, task=tasks[0], lost_rank=peer,
                    fix="see that rank's log; raise peer_timeout (AIOREADY_PEER_TIMEOUT) if "
                        "it is just slow")
                self.guard.abort(error)
                return

    def _check_all(self, now: float) -> None:
        for peer in self.peers:
            silent = now - self._last_seen.get(peer, now)
            if silent >= self.timeout:  # type: ignore[operator]
                self.job_guard.abort(PeerLostError(
                    f"peer rank {peer} of {self.world_size} sent nothing for {silent:.3g} s "
                    f"(peer_timeout={self.timeout:g} s) during {self._watching}: it died or "
                    "stopped answering", rank=self.rank,
                    step=self.runtime.step_index if self.runtime.step_index >= 0 else None,
                    lost_rank=peer, fix="see that rank's log; raise peer_timeout "
                    "(AIOREADY_PEER_TIMEOUT) if it is just slow"))
                return

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    # -- errors ------------------------------------------------------------------------------
    def _send(self, peer: int, msg: Message) -> None:
        try:
            self.transport.send_nowait(peer, msg)
        except Exception:  # best effort: a dead peer may refuse; the timeout still catches it
            pass

    def broadcast_error(self, exc: BaseException) -> None:
        """Tell every peer this rank's step failed (once; errors that came from a peer are not
        sent back)."""
        if self._broadcast_done or isinstance(exc, (StageError, PeerLostError)) and exc.remote:
            return
        self._broadcast_done = True
        import torch
        code = STAGE_FAILED if isinstance(exc, StageError) else RANK_FAILED
        text = (f"rank {self.rank} of {self.world_size} on {socket.gethostname()}: "
                f"{type(exc).__name__}: {exc}")
        log.error("%s", text)  # said here first: a peer's MPI_Abort may end this process soon
        data = text.encode("utf-8", "replace")[:MAX_ERROR_BYTES]
        payload = torch.tensor(list(data), dtype=torch.uint8)
        step = max(self.runtime.step_index, 0)
        for peer in self.peers:
            self._send(peer, Message(step, MessageKind.CONTROL, 0, 0, (payload,), code))

    async def flush(self) -> None:
        """After this rank's own failure: give the error broadcast up to FLUSH_S to leave."""
        if not self._broadcast_done or self._remote_error is not None:
            return
        try:
            await asyncio.wait_for(self.transport.wait_sent(), FLUSH_S)
        except BaseException as exc:  # a dead peer's sends may never complete: move on
            if isinstance(exc, asyncio.CancelledError) and asyncio.current_task().cancelling():
                raise

    def _on_control(self, msg: Message) -> None:
        src = msg.source
        if src is None:
            raise ProtocolError("control message without its sender", rank=self.rank,
                                expected="a source set by the transport", got=msg.describe())
        loop = asyncio.get_running_loop()
        self._last_seen[src] = loop.time()
        if msg.tag not in (HEARTBEAT, STAGE_FAILED, RANK_FAILED):
            raise ProtocolError(f"control message from rank {src} with an unknown tag",
                                rank=self.rank, expected=[HEARTBEAT, STAGE_FAILED, RANK_FAILED],
                                got=msg.describe())
        if msg.tag == HEARTBEAT or self._remote_error is not None:
            return
        text = _text(msg, self.rank)
        waits = [str(t) for t, r in self.runtime.pending_receives()]
        cls = StageError if msg.tag == STAGE_FAILED else PeerLostError
        error = cls(f"peer failed: {text}", rank=self.rank, step=msg.step,
                    task=waits[0] if waits else None, lost_rank=src, remote=True)
        self._remote_error = error
        self.guard.abort(error)
        self.job_guard.abort(error)


def _text(msg: Message, rank: int) -> str:
    """A peer's error text: at most MAX_ERROR_BYTES of uint8, decoded leniently."""
    if not msg.tensors or msg.tensors[0] is None:
        return "(no text)"
    data = msg.tensors[0]
    if str(getattr(data, "dtype", "")) != "torch.uint8" or data.dim() != 1 \
            or data.numel() > MAX_ERROR_BYTES:
        raise ProtocolError(f"error text from rank {msg.source} is malformed", rank=rank,
                            expected=f"<= {MAX_ERROR_BYTES} bytes as a 1-d uint8 tensor",
                            got=msg.describe())
    return bytes(data.tolist()).decode("utf-8", "replace")
