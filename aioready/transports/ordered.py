"""Per-peer order for a data plane that has no tags and no probe (NCCL).

NCCL matches a peer's sends and receives by the order they are posted, and receives must say
how many bytes they take. So a receiver may post a payload receive only once it knows the
message's sizes (its header, which travels over MPI) and only in the order the peer sent: the
payloads of messages A then B from one peer must be received A then B, whatever order their
headers were decoded in. MPI delivers one sender's headers in send order (non-overtaking), but
the MPI transport may finish receiving a later header first (a header whose receive did not
complete at once is tracked, the next one may complete at once).

`OrderedArrivals` restores the order: a ticket is taken per peer when a header is *matched*
(`Improbe`, which is in send order), and items are released per peer in ticket order when they
complete, whatever order they complete in. Different peers never wait for each other: that is
the readiness the runtime wants (whichever peer's message is complete first is delivered
first).

Which messages have payloads on the data plane is said by the header's MPI tag: the sequence
number plus `DEVICE_FLAG` (tags stay under MPI's guaranteed bound of 32767).
"""

from __future__ import annotations

import collections
from typing import Generic, Hashable, TypeVar

from ..errors import InternalError

__all__ = ["OrderedArrivals", "DEVICE_FLAG", "device_tag", "split_tag"]

T = TypeVar("T")
DEVICE_FLAG = 1 << 14  # header tag bit: the payloads follow on the device data plane


def device_tag(seq: int, on_device: bool) -> int:
    """The header's MPI tag: its sequence number, flagged when payloads go by the data plane."""
    if not 0 <= seq < DEVICE_FLAG:
        raise InternalError("header sequence number out of range", expected=f"0..{DEVICE_FLAG}",
                            got=seq)
    return seq | DEVICE_FLAG if on_device else seq


def split_tag(tag: int) -> tuple[int, bool]:
    """(sequence number, payloads on the data plane) of a header's MPI tag."""
    return tag & (DEVICE_FLAG - 1), bool(tag & DEVICE_FLAG)


class OrderedArrivals(Generic[T]):
    """Items released per peer in the order their tickets were taken; see the docstring."""

    def __init__(self) -> None:
        self._next: dict[Hashable, int] = {}  # peer -> next ticket to hand out
        self._head: dict[Hashable, int] = {}  # peer -> next ticket to release
        self._done: dict[Hashable, dict[int, T]] = collections.defaultdict(dict)

    def ticket(self, peer: Hashable) -> int:
        """Take the next place in `peer`'s order (when its header is matched)."""
        n = self._next.get(peer, 0)
        self._next[peer] = n + 1
        return n

    def complete(self, peer: Hashable, ticket: int, item: T) -> list[T]:
        """Record `item` for `ticket`; return the items of `peer` now due, in order."""
        head = self._head.get(peer, 0)
        if not head <= ticket < self._next.get(peer, 0) or ticket in self._done[peer]:
            raise InternalError(f"arrival ticket of rank {peer} is not outstanding",
                                expected=f"{head}..{self._next.get(peer, 0) - 1}, once",
                                got=ticket)
        done = self._done[peer]
        done[ticket] = item
        out = []
        while head in done:
            out.append(done.pop(head))
            head += 1
        self._head[peer] = head
        return out

    def num_waiting(self, peer: Hashable | None = None) -> int:
        """Completed items held back behind an earlier one (of `peer`, or of all peers)."""
        if peer is not None:
            return len(self._done.get(peer, ()))
        return sum(len(d) for d in self._done.values())

    def __repr__(self) -> str:
        return f"<OrderedArrivals peers={len(self._next)} waiting={self.num_waiting()}>"
