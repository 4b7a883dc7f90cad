"""Doorbell: a parked rank is woken by the message, not by a timer sweep.

MPI gives no file descriptor to wait on, so a rank whose arbiter waits for a message polls on a
timer (progress.py): at 250 us parks that costs ~10 % of a core per waiting rank, and more ranks
than cores (laptops, CI, tests) turn that into time taken from the ranks that compute. When every
rank of the job runs on this host, each rank also owns a datagram socket (Linux abstract
namespace, named by a token of the job) and a byte in a shared-memory window saying "parked".
A rank about to park sets its byte, polls once more (a message that came before the byte was
visible is found there), and sleeps on its socket with only a long backstop timer. A sender,
after each header `Isend` to a local rank, reads that rank's byte and, when it is set, sends one
datagram: the receiver's loop wakes on it in tens of microseconds. A hot rank's byte is clear,
so the sender's cost is one shared-memory read per message.

Lost wake-ups are bounded, not excluded: the byte and MPI's queue are two places, so a send that
raced a park could miss the byte; the backstop (`backoff_max_s`, 8 ms) still finds the message.
The window and the socket are made collectively with the transport (like its communicators).
"""

from __future__ import annotations

import os
import socket
from typing import Any

import numpy as np

__all__ = ["Doorbell"]


class Doorbell:
    """One rank's socket and its view of every local rank's "parked" byte."""

    def __init__(self, MPI: Any, world: Any) -> None:
        token = np.frombuffer(os.urandom(8), np.uint8).copy()
        world.Bcast(token, root=0)  # one name space per job; numpy, nothing pickled
        self._prefix = b"\0aioready-" + token.tobytes().hex().encode() + b"-"
        local = world.Split_type(MPI.COMM_TYPE_SHARED)
        self._local = local
        self.usable = local.Get_size() == world.Get_size()  # every peer can ring this rank
        self._win = MPI.Win.Allocate_shared(1, 1, comm=local)
        self._flags = [np.frombuffer(self._win.Shared_query(r)[0], np.uint8)
                       for r in range(local.Get_size())]
        ranks = np.zeros(local.Get_size(), np.int64)
        local.Allgather(np.array([world.Get_rank()], np.int64), ranks)
        self._slot = {int(w): i for i, w in enumerate(ranks)}  # world rank -> local index
        self._mine = self._flags[local.Get_rank()]
        self._mine[0] = 0
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        self._sock.bind(self._prefix + str(world.Get_rank()).encode())
        local.Barrier()  # every socket is bound before anyone may ring
        self.num_rung = 0

    def fileno(self) -> int:
        return self._sock.fileno()

    def set_parked(self, parked: bool) -> None:
        self._mine[0] = parked

    def ring(self, dest: int) -> None:
        """After a header was sent to `dest`: wake it if it is parked."""
        slot = self._slot.get(dest)
        if slot is None or not self._flags[slot][0]:
            return
        self.num_rung += 1
        try:
            self._sock.sendto(b"!", self._prefix + str(dest).encode())
        except OSError:  # its buffer is full (it is being woken) or it closed: nothing to do
            pass

    def drain(self) -> None:
        try:
            while True:
                self._sock.recv(64)
        except OSError:
            pass

    def close(self) -> None:
        """Collective, like the transport's communicators."""
        self._sock.close()
        self._flags = []
        self._mine = None  # type: ignore[assignment]
        self._win.Free()
        self._local.Free()
