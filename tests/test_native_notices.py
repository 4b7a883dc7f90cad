"""A notice read by the compiled probe and handed to the runtime as its fields
(`NativePath.route_notices`, docs/hot_path_measurements.md "The notice's read in one C call"),
checked against fakes: what the probe's answers do (counted, nothing handed over as a Message, a
handler's error failing the step as deliver's does), the switches (this one and
`AIOREADY_NATIVE_RECV_MULTI`, several tensors viewed in C), and the runtime's reading of the
fields equal to its reading of the Message (the same task, duration and error)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from aioready.errors import InternalError, ProtocolError
from aioready.placement import Placement
from aioready.runtime.notices import NOTICE_B, Notices
from aioready.tasks import Kind, Task
from aioready.transports.base import Message, MessageKind
from aioready.transports.mpi import MPITransport
from aioready.transports.mpi_native import NativePath


class _Module:
    """`_mpifast` whose probe answers `answers` in turn and records its arguments."""

    def __init__(self, answers: list[Any]) -> None:
        self.answers = answers
        self.calls: list[tuple[Any, ...]] = []
        self.send = self.send_parts = self.send_head = self.send_multi = None

    def probe(self, *args: Any) -> Any:
        self.calls.append(args)
        return self.answers.pop(0) if self.answers else None


class _Transport:
    def __init__(self) -> None:
        self._hdr = SimpleNamespace(handle=77)
        self._recv_plans = SimpleNamespace(_by_len={32: "plan"})
        self._MPI = SimpleNamespace(Request=SimpleNamespace(fromhandle=lambda h: ("req", h)))
        self._max_header_message = 1 << 20
        self._rung = False
        self._probe_again = True
        self.num_received = 0
        self.handed: list[Any] = []
        self.failed: list[BaseException] = []

    def _hand_over(self, msg: Any) -> None:
        self.num_received += 1
        self.handed.append(msg)

    def _deliver_failed(self, exc: Exception) -> None:
        self.failed.append(exc)


def _handler(*fields: int) -> None:
    raise AssertionError("the fake probe never calls it")


def test_notices_taken_in_c_are_counted_and_a_handlers_error_fails_the_step() -> None:
    msg = Message(1, MessageKind.ACTIVATION, 0, 0, ())
    boom = ValueError("handler failed")
    module = _Module([True, msg, (boom,), True])
    tr = _Transport()
    path = NativePath(tr, module, seq_mod=8, probes=16, rung_probes=16)
    assert path.route_notices(_handler)
    assert path.probe() == 4
    assert [call[4:] for call in module.calls] == [(_handler, True)] * 5  # last: no match
    assert path.num_notices == 2 and tr.num_received == 4
    assert tr.handed == [msg] and tr.failed == [boom]
    assert not path.route_notices(None)
    path.probe()
    assert module.calls[-1][4] is None  # Messages again


def test_the_switches_leave_notices_to_deliver_and_several_tensors_to_python(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOREADY_NATIVE_RECV_HEADS", "0")
    monkeypatch.setenv("AIOREADY_NATIVE_RECV_MULTI", "0")
    module = _Module([])
    path = NativePath(_Transport(), module, seq_mod=8, probes=16, rung_probes=16)
    assert not path.route_notices(_handler)
    path.probe()
    assert module.calls[-1][4:] == (None, False)


def test_a_transport_without_the_helper_does_not_route_notices() -> None:
    fake = SimpleNamespace(_native=None)
    assert MPITransport.route_notices(fake, _handler) is False  # type: ignore[arg-type]


def test_a_handlers_error_is_deliver_errors_treatment() -> None:
    """An AioreadyError as it is, anything else an InternalError naming it (as `_hand_over`)."""
    raised: list[BaseException] = []
    fake = SimpleNamespace(_rank=3, _raise=raised.append)
    bad = ProtocolError("bad notice", rank=3)
    MPITransport._deliver_failed(fake, bad)  # type: ignore[arg-type]
    MPITransport._deliver_failed(fake, KeyError("k"))  # type: ignore[arg-type]
    assert raised[0] is bad
    assert isinstance(raised[1], InternalError) and "deliver raised KeyError" in str(raised[1])


def test_read_fields_is_read_of_the_message() -> None:
    place = Placement.linear(3)
    b0 = Task(Kind.B, 0, 0)
    first, last = Notices(0, place, (0,), fed=[b0]), Notices(2, place, (2,))
    for notices, msg in ((last, Message(4, MessageKind.NOTICE, 2, 1, (), 1_000_000)),
                         (first, Message(4, MessageKind.NOTICE, 0, 0, (), NOTICE_B | 123)),
                         (first, Message(4, MessageKind.NOTICE, 0, 5, (), 77))):
        by_msg = notices.read(msg, 8)
        by_fields = notices.read_fields(msg.step, msg.stage, msg.microbatch, msg.tag, 8)
        assert by_fields == by_msg
        assert by_fields[0] is notices.read(msg, 8)[0]  # the same Task object: one lookup
    assert first.read_fields(4, 0, 0, NOTICE_B, 8)[0] is b0
    for step, stage, mb in ((4, 1, 0), (6, 2, 8), (0, 2, -1)):
        msg = Message(step, MessageKind.NOTICE, stage, mb, (), 5)
        with pytest.raises(ProtocolError) as by_msg_err:
            last.read(msg, 8)
        with pytest.raises(ProtocolError) as by_fields_err:
            last.read_fields(step, stage, mb, 5, 8)
        assert str(by_fields_err.value) == str(by_msg_err.value)
        assert msg.describe() in str(by_fields_err.value)
