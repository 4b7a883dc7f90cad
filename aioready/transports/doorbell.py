"""Doorbell: a parked rank is woken by the message, not by a timer sweep.

MPI gives no file descriptor to wait on, so a rank whose arbiter waits for a message polls on a
timer (progress.py): at 250 us parks that costs ~10 % of a core per waiting rank, and more ranks
than cores (laptops, CI, tests) turn that into time taken from the ranks that compute. When every
rank of the job runs on this host, each rank also owns a datagram socket (Linux abstract
namespace, named by a token of the job) and a byte in shared memory saying "parked".
A rank about to park sets its byte, polls once more (a message that came before the byte was
visible is found there), and sleeps on its socket with only a long backstop timer. A sender,
after each header `Isend` to a local rank, reads that rank's byte and, when it is set, sends one
datagram: the receiver's loop wakes on it in tens of microseconds. A hot rank's byte is clear,
so the sender's cost is one shared-memory read per message.

Lost wake-ups are bounded, not excluded: the byte and MPI's queue are two places, so a send that
raced a park could miss the byte; the backstop (`bell_backstop_s`, 50 ms) still finds it.
The bytes and the socket are made collectively with the transport (like its communicators);
closing is local.
"""

from __future__ import annotations

import mmap
import socket
from typing import Any

import numpy as np

from .shared_file import job_name, map_on_every_rank, unmap

__all__ = ["Doorbell"]

_COMPUTING = 2  # a "parked" byte's value while the parked rank's loop computes a task


class Doorbell:
    """One rank's socket and its view of every local rank's "parked" byte.

    The bytes live in a file of /dev/shm made by shared_file.map_on_every_rank.
    """

    def __init__(self, MPI: Any, world: Any) -> None:
        name = job_name(world)  # one name space per job
        self._prefix = f"\0aioready-{name}-".encode()
        self._me_world = world.Get_rank()
        self.num_rung = 0
        self._sock: socket.socket | None = None
        self._map: mmap.mmap | None = None
        self._flags = np.zeros(0, np.uint8)
        shared = map_on_every_rank(MPI, world, f"/dev/shm/aioready-{name}", lambda n: n,
                                   self._bind)
        self.usable = shared is not None
        if shared is None:
            self.close()
            return
        self._map, self._slot = shared  # world rank -> its byte
        self._flags = np.frombuffer(self._map, np.uint8)
        self._me = self._slot[self._me_world]

    def _bind(self) -> bool:
        """This rank's socket, bound before any peer may ring it (map_on_every_rank's setup)."""
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        self._sock.bind(self._prefix + str(self._me_world).encode())
        return True

    def fileno(self) -> int:
        assert self._sock is not None
        return self._sock.fileno()

    def set_parked(self, parked: bool) -> None:
        self._flags[self._me] = parked

    def set_computing(self, computing: bool) -> None:
        """Parked, but the loop computes a task whose end polls: ring it for data, not for a
        notice (MPITransport.hush_doorbell); False: parked as before."""
        self._flags[self._me] = _COMPUTING if computing else 1

    def ring(self, dest: int, notice: bool = False) -> None:
        """After a header was sent to `dest`: wake it if it is parked (for a `notice`, unless
        its loop computes, `set_computing`)."""
        slot = self._slot.get(dest)
        if slot is None:
            return
        flag = self._flags[slot]
        if not flag or notice and flag == _COMPUTING:
            return
        self.num_rung += 1
        try:
            self._sock.sendto(b"!", self._prefix + str(dest).encode())  # type: ignore[union-attr]
        except OSError:  # its buffer is full (it is being woken) or it closed: nothing to do
            pass

    def drain(self) -> None:
        """Read one datagram: a second one (two peers rang) keeps the socket readable, and the
        loop calls the reader again, so no extra `recv` (and its EAGAIN) per wake-up."""
        try:
            self._sock.recv(64)  # type: ignore[union-attr]
        except OSError:
            pass

    def close(self) -> None:
        """Local: no other rank takes part."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._flags = np.zeros(0, np.uint8)
        unmap(self._map)
        self._map = None
