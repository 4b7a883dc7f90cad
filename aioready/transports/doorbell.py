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
import os
import socket
from typing import Any

import numpy as np

__all__ = ["Doorbell"]

_COMPUTING = 2  # a "parked" byte's value while the parked rank's loop computes a task


class Doorbell:
    """One rank's socket and its view of every local rank's "parked" byte.

    The bytes live in a file of /dev/shm that local rank 0 creates and unlinks once every local
    rank mapped it, not in an MPI window: freeing a window waits for every rank, and a rank that
    fails must be able to close its transport while its peers are still running.
    """

    def __init__(self, MPI: Any, world: Any) -> None:
        token = np.frombuffer(os.urandom(8), np.uint8).copy()
        world.Bcast(token, root=0)  # one name space per job; numpy, nothing pickled
        name = token.tobytes().hex()
        self._prefix = f"\0aioready-{name}-".encode()
        self.num_rung = 0
        self._sock: socket.socket | None = None
        self._map: mmap.mmap | None = None
        self._flags = np.zeros(0, np.uint8)
        local = world.Split_type(MPI.COMM_TYPE_SHARED)
        try:
            self.usable = local.Get_size() == world.Get_size()  # every peer can ring this rank
            if self.usable:
                self.usable = self._attach(MPI, local, world.Get_rank(), f"/dev/shm/aioready-{name}")
        finally:
            local.Free()
        if not self.usable:
            self.close()

    def _attach(self, MPI: Any, local: Any, me: int, path: str) -> bool:
        """Map the shared bytes and bind the socket, on every local rank or on none."""
        first = local.Get_rank() == 0
        ok = np.zeros(1, np.int32)
        try:
            if first:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                os.ftruncate(fd, max(local.Get_size(), 1))
                os.close(fd)
            ok[0] = 1
        except OSError:
            pass
        local.Bcast(ok, root=0)
        if ok[0]:
            try:
                fd = os.open(path, os.O_RDWR)
                try:
                    self._map = mmap.mmap(fd, max(local.Get_size(), 1))
                finally:
                    os.close(fd)
                self._flags = np.frombuffer(self._map, np.uint8)
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._sock.setblocking(False)
                self._sock.bind(self._prefix + str(me).encode())
            except OSError:
                ok[0] = 0
        every = np.zeros(1, np.int32)
        local.Allreduce(ok, every, op=MPI.MIN)  # also: every socket is bound before any ring
        if first and os.path.exists(path):
            os.unlink(path)  # the mappings keep the bytes; nothing is left behind
        ranks = np.zeros(local.Get_size(), np.int64)
        local.Allgather(np.array([me], np.int64), ranks)
        self._slot = {int(w): i for i, w in enumerate(ranks)}  # world rank -> byte
        self._me = self._slot[me]
        return bool(every[0])

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
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view is still alive somewhere: the GC unmaps it
                pass
            self._map = None
