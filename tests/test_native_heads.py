"""The compiled helper's header-only and several-tensor sends (`NativePath._head`, `_several`,
docs/hot_path_measurements.md "Ready against strict"), their bookkeeping checked against fakes: the
sequence number, a send not completed at once tracked, the doorbell's notice rule (a notice rings
no peer whose loop computes, data does), what they cannot take left to the Python path, and the
switches."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from aioready.transports.base import Message, MessageKind
from aioready.transports.mpi_native import NativePath


class _Module:
    """`_mpifast` with a `send_head` and a `send_multi` that record their arguments and answer
    `answer`."""

    def __init__(self, answer: Any = None) -> None:
        self.answer = answer
        self.calls: list[tuple[Any, ...]] = []
        self.send = self.send_parts = self.probe = None

    def send_head(self, *args: Any) -> Any:
        self.calls.append(args)
        return self.answer

    send_multi = send_head


class _Transport:
    def __init__(self) -> None:
        self._hdr = SimpleNamespace(handle=77)
        self._recv_plans = SimpleNamespace(_by_len={})
        self._MPI = SimpleNamespace(Request=SimpleNamespace(fromhandle=lambda h: ("req", h)))
        self._seq = [5, 9]
        self._sent_waiters: list[Any] = []
        self.rings: list[tuple[int, bool]] = []
        self._bell = SimpleNamespace(ring=lambda dest, notice=False: self.rings.append(
            (dest, notice)))
        self.tracked: list[tuple[Any, ...]] = []
        self.kicks = 0
        self.hot_bytes = 1 << 16
        self.parts: Any = (b"desc", ((1000, 8, 64), (2000, 16, 128)), 160)
        self._send_plans = SimpleNamespace(parts=lambda msg: self.parts)

    def _track_send(self, *args: Any) -> None:
        self.tracked.append(args)

    def _kick_after_send(self) -> None:
        self.kicks += 1


def _path(module: _Module) -> tuple[NativePath, _Transport]:
    tr = _Transport()
    return NativePath(tr, module, seq_mod=8, probes=16, rung_probes=16), tr


def test_a_notice_goes_through_send_head_and_rings_as_a_notice() -> None:
    module = _Module()
    path, tr = _path(module)
    notice = Message(3, MessageKind.NOTICE, 2, 6, (), (1 << 31) | 40)
    assert path.send(1, notice)
    assert module.calls == [(77, 1, 9, MessageKind.NOTICE, 3, 2, 6, (1 << 31) | 40, 32)]  # header + padding
    assert tr._seq == [5, 2]  # (9 + 1) % 8
    assert tr.rings == [(1, True)] and tr.kicks == 1 and not tr.tracked
    assert path.num_heads == 1
    data = Message(3, MessageKind.ACTIVATION, 2, 6, (), 0)  # header only, not a notice: rings
    assert path.send(0, data)
    assert tr.rings == [(1, True), (0, False)] and path.num_heads == 2


def test_a_head_not_sent_at_once_is_tracked_and_one_that_cannot_be_is_left_to_python() -> None:
    module = _Module(answer=(b"head", 1234))
    path, tr = _path(module)
    assert path.send(0, Message(1, MessageKind.NOTICE, 0, 0, (), 0))
    assert tr.tracked == [(("req", 1234), b"head", None, 0, False)]
    module.answer = NotImplemented
    assert not path.send(0, Message(1 << 32, MessageKind.NOTICE, 0, 0, (), 0))
    assert tr._seq == [6, 9] and path.num_heads == 1  # the refused one counted nothing


@pytest.mark.parametrize("env,module", [("0", _Module()), ("1", SimpleNamespace(
    send=None, send_parts=None, probe=None))], ids=["switch-off", "module-without-it"])
def test_the_switch_or_an_older_module_leaves_notices_to_the_python_path(
        monkeypatch: pytest.MonkeyPatch, env: str, module: Any) -> None:
    monkeypatch.setenv("AIOREADY_NATIVE_HEADERS", env)
    path, tr = _path(module)
    assert not path.send(1, Message(3, MessageKind.NOTICE, 2, 6, (), 0))
    assert tr.rings == [] and tr._seq == [5, 9]


def test_several_tensors_go_through_send_multi_unless_unplanned_or_large() -> None:
    module = _Module()
    path, tr = _path(module)
    msg = Message(2, MessageKind.GRADIENT, 1, 4, (object(), None), 7)
    assert path.send(0, msg)
    assert module.calls == [(77, 0, 5, MessageKind.GRADIENT, 2, 1, 4, 7, b"desc", 2,
                             ((1000, 8, 64), (2000, 16, 128)), 160)]
    assert tr._seq == [6, 9] and tr.rings == [(0, False)] and path.num_multi == 1
    tr.parts = None  # no plan: the Python path
    assert not path.send(0, msg)
    tr.parts = (b"desc", ((1000, 8, 64),), 1 << 16)  # tracked hot by the Python path
    assert not path.send(0, msg)
    assert len(module.calls) == 1 and tr._seq == [6, 9] and path.num_multi == 1


def test_the_multi_switch_leaves_several_tensors_to_the_python_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOREADY_NATIVE_MULTI", "0")
    path, tr = _path(_Module())
    assert not path.send(0, Message(2, MessageKind.GRADIENT, 1, 4, (object(), None), 7))
    assert tr.rings == [] and path.num_multi == 0
