"""NoticeBoard: the reserving policy's notices between ranks of one host, in shared memory.

A notice ("I started the task that feeds yours, expect it in d", runtime/notices.py) sent as an
MPI message cost ~10 us to send and ~33 us to receive, cold, plus a doorbell ring to a parked
receiver: most of what the reserving policy cost beyond strict mode (docs/hot_path.md "Notices
through a shared-memory board"). Here it is a 24-byte record written into a ring of a shared
mapping: for each ordered pair (src, dst) of ranks, a single-producer single-consumer ring of
256 records (step, stage, microbatch, tag: u32 each; `at`: the sender's time.monotonic() when the
task started, f64), its head and tail counters on their own cache lines, in C (native/_mpifast.c
`board_post`, `board_read`). A full ring refuses the record (`post` answers False): the caller
sends the notice over MPI as before. Made with the MPI transport, collectively, where the
doorbell's bytes are (shared_file.py), on every rank or on none; without the compiled helper
there is no board. `AIOREADY_NOTICE_BOARD=0`: no board, notices over MPI.

Note [no ring, read where consulted]: a notice over MPI never woke the arbiter (the runtime's
notice handler only updates the forecast); the doorbell rang for it only so that a parked loop
would read it soon, because its expected arrival was dated by the receiver's clock when it was
read. A board record carries the sender's start time, and CLOCK_MONOTONIC is one clock for
every process of a Linux host, so its date does not depend on when it is read: the receiver
reads the board only where the forecast is consulted, in the ReadySet's `fits` and `drain`
callbacks (RankRuntime `_read_fits`, `_read_clear`), each read just before its consultation.
Every record posted before a consultation is seen by it (the sender's release store of the
head before the reader's acquire load), which is what reading before every decision gave and
one better: a record posted between a decision's start and its consultation (by another
process) is seen too. The forecast's state at a consultation is the one reading before every
decision would leave, but for one thing: a record read after its task's message came sets no
expected arrival either way (`arrived` has cleared it, or the `_missing` guard skips it), yet it
now sets the feeder's last announced duration (Forecast.announced), which reading before each
decision did only when a decision happened to fall between the post and the message. Now that
duration is always the last one announced before the consultation, not a race's pick. Records
are read for one step: those of earlier steps are dropped in C without a call (at a step's start
and end, and at any read), those of a later step (a peer ahead) stay for it, where reading
before every decision dropped them or not by the same race. A step's unread records go at its
end; a ring full before then refuses, and the notice goes over MPI (correct, slower).
"""

from __future__ import annotations

import mmap
import os
import sys
from types import ModuleType
from typing import Any, Callable

import numpy as np

from ..errors import ProtocolError
from .shared_file import job_name, map_on_every_rank, unmap

__all__ = ["NoticeBoard", "notice_board", "board_switch", "SLOTS", "MAX_RANKS"]

SLOTS = 256
"""Records a ring holds unread (native/_mpifast.c BOARD_SLOTS): a step's records wait there
until a consultation reads them or the step ends, and a rank that never consults its forecast
(the reserving 1F1B's first and last) gets about M a step from a neighbour; at 64 slots a step
of 128 microbatches filled half its notices into MPI messages (tests/test_notice_board_reads.py
counts them)."""

MAX_RANKS = 64
"""No board for more ranks: rings grow as the square of the ranks (6.3 kB each: 0.4 MB of
/dev/shm at 8 ranks, 26 MB at 64)."""

OnRecord = Callable[[int, int, int, int, float], None]


class NoticeBoard:
    """One rank's view of the board: `post` into its rings to peers, `read` of theirs to it."""

    __slots__ = ("_module", "_map", "_view", "_base", "_slot", "_first", "_count", "_me",
                 "num_posted", "num_full", "num_read", "num_skipped")

    def __init__(self, module: ModuleType, shared: mmap.mmap, slots: dict[int, int],
                 me: int) -> None:
        """`slots`: world rank -> index among the local ranks (shared_file.map_on_every_rank)."""
        self._module = module
        self._map: mmap.mmap | None = shared
        self._view = np.frombuffer(shared, np.uint8)  # holds the mapping while its address is used
        self._base: int | None = self._view.ctypes.data
        count = len(slots)
        mine = slots[me]
        # ring of (src, dst) = src * count + dst: a post goes to mine * count + theirs
        self._slot = {rank: mine * count + i for rank, i in slots.items() if rank != me}
        self._first, self._count = mine, count  # reads rings mine, mine + count, ...
        self._me = me
        self.num_posted = self.num_full = self.num_read = self.num_skipped = 0

    def post(self, dest: int, step: int, stage: int, microbatch: int, tag: int,
             at: float) -> bool:
        """Write a notice for `dest`; False (nothing written) when its ring is full, `dest` is
        not a local rank or the board is closed: send it over MPI then."""
        ring = self._slot.get(dest)
        if ring is None or self._base is None:
            return False
        if self._module.board_post(self._base, ring, step, stage, microbatch, tag, at):
            self.num_posted += 1
            return True
        self.num_full += 1
        return False

    def read(self, on_record: OnRecord | None, step: int) -> int:
        """Hand every unread record of `step` for this rank to on_record(step, stage,
        microbatch, tag, at), oldest first per sender; how many. Records of earlier steps are
        dropped in C without a call (`num_skipped`), those of later steps stay for them; with
        on_record None the records of `step` stay too (what a step's start and end discard).
        What on_record raises propagates (the record that raised is consumed, the rest stay
        for the next read); counters that say more records than a ring holds (a peer's bytes)
        raise ProtocolError."""
        if self._base is None:
            return 0
        try:
            got, skipped = self._module.board_read(self._base, self._first, self._count,
                                                   self._count, step, on_record)
        except OverflowError as exc:  # a peer wrote counters that no ring can hold
            raise ProtocolError("notice board ring out of bounds", rank=self._me,
                                expected=f"at most {SLOTS} records unread", got=str(exc)
                                ) from None
        self.num_read += got
        self.num_skipped += skipped
        return got

    def close(self) -> None:
        """Local: no other rank takes part; later posts answer False, reads 0."""
        self._base = None
        self._view = np.zeros(0, np.uint8)
        unmap(self._map)
        self._map = None


def board_bytes(module: ModuleType, ranks: int) -> int:
    """The size of a board for `ranks` local ranks: a ring per ordered pair."""
    return ranks * ranks * module.board_ring_bytes()


def board_switch() -> bool:
    """AIOREADY_NOTICE_BOARD (on unless 0): it decides a collective set-up, so the MPI
    transport checks that every rank has the same value before using it."""
    return os.environ.get("AIOREADY_NOTICE_BOARD", "1") != "0"


def notice_board(MPI: Any, world: Any, module: ModuleType | None) -> NoticeBoard | None:
    """A board for `world` (collective: every rank calls it) when every rank is on this Linux
    host and has the compiled helper `module`, they are at most MAX_RANKS, and
    AIOREADY_NOTICE_BOARD is not 0; else None."""
    if not board_switch() or not sys.platform.startswith("linux") or \
            world.Get_size() > MAX_RANKS:
        return None
    name = job_name(world)
    shared = map_on_every_rank(
        MPI, world, f"/dev/shm/aioready-{name}-board",
        lambda n: board_bytes(module, n) if module is not None else 1,
        lambda: module is not None and hasattr(module, "board_post"))
    if shared is None:
        return None
    assert module is not None
    return NoticeBoard(module, shared[0], shared[1], world.Get_rank())
