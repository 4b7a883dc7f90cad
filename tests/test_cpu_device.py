"""CPUDevice's quiet path (devices/cpu.py): a task computes on the loop thread only when nothing
else needs the loop (by default only on a loop aioready.run made; the only open CPUDevice of the process, one completion source and no
transfer of it that wants the engine's polling, grad mode on), and the engine is polled once after it, so the next decision sees what
arrived during the task. Otherwise the worker thread computes, as before."""

from __future__ import annotations

import asyncio
import threading
import weakref

import pytest
import torch

from aioready.devices import cpu
from aioready.devices.base import TaskInfo
from aioready.errors import ConfigError
from aioready.launch import run_loop
from aioready.progress import ProgressConfig, ProgressEngine
from aioready.tasks import Kind

pytestmark = pytest.mark.timeout(60)

INFO = TaskInfo(0, 0, 0, 0, 0, Kind.F)


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Devices other tests left open in this process must not count here."""
    monkeypatch.setattr(cpu, "_OPEN", weakref.WeakSet())


class HotSource:
    """A completion source with one rendezvous-size transfer in flight (wants polling)."""

    def __init__(self, hot: bool) -> None:
        self.hot = hot
        self.polls = 0

    def poll(self) -> int:
        self.polls += 1
        return 0

    def num_pending(self) -> int:
        return 1

    def wants_hot(self) -> bool:
        return self.hot


class BellSource(HotSource):
    """A quiet source with a doorbell (as the MPI transport has on one host)."""

    def __init__(self) -> None:
        super().__init__(False)
        self.armed = False

    def arm_doorbell(self) -> bool:
        self.armed = True
        return True

    def disarm_doorbell(self) -> None:
        self.armed = False


async def _thread_of(device: cpu.CPUDevice) -> int:
    return await device.run(INFO, threading.get_ident)


async def test_only_device_computes_on_the_loop_thread() -> None:
    device = cpu.CPUDevice("q", quiet_inline=True)
    try:
        assert await _thread_of(device) == threading.get_ident()
        assert device.num_quiet == 1
    finally:
        device.close()


async def test_a_second_open_device_keeps_both_on_their_threads() -> None:
    a, b = cpu.CPUDevice("a", quiet_inline=True), cpu.CPUDevice("b", quiet_inline=True)
    try:
        assert await _thread_of(a) != threading.get_ident()
        assert await _thread_of(b) != threading.get_ident()
        assert a.num_quiet == b.num_quiet == 0
        b.close()  # a alone again: quiet
        assert await _thread_of(a) == threading.get_ident()
    finally:
        a.close()


async def test_off_by_argument_and_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    device = cpu.CPUDevice("off", quiet_inline=False)
    try:
        assert await _thread_of(device) != threading.get_ident()
    finally:
        device.close()
    monkeypatch.setenv("AIOREADY_CPU_QUIET_INLINE", "0")
    device = cpu.CPUDevice("env-off")
    try:
        assert not device.quiet_inline
        assert await _thread_of(device) != threading.get_ident()
        assert device.num_quiet == 0
    finally:
        device.close()


async def test_grad_mode_off_on_the_loop_thread_keeps_the_worker() -> None:
    """The worker computes with grad on; a caller's no_grad must not reach the stage."""
    device = cpu.CPUDevice("grad", quiet_inline=True)
    try:
        with torch.no_grad():
            assert await device.run(INFO, torch.is_grad_enabled)
        assert device.num_quiet == 0
    finally:
        device.close()


@pytest.mark.parametrize("hot", [True, False], ids=["transfer-wants-polling", "quiet"])
async def test_engine_state_decides_and_a_quiet_task_ends_with_a_poll(hot: bool) -> None:
    engine = ProgressEngine.for_loop(asyncio.get_running_loop())
    source = HotSource(hot)
    engine.add_source(source)
    device = cpu.CPUDevice("engine", quiet_inline=True)
    try:
        before = source.polls
        on_loop = await _thread_of(device) == threading.get_ident()
        assert on_loop is not hot
        if not hot:  # polled right after the task, before the caller's next decision
            assert source.polls == before + 1
    finally:
        engine.remove_source(source)
        device.close()


async def test_a_second_completion_source_keeps_the_worker() -> None:
    """A DP reducer's or CUDA events' requests only move when polled: no quiet path then."""
    engine = ProgressEngine.for_loop(asyncio.get_running_loop())
    sources = [HotSource(False), HotSource(False)]
    device = cpu.CPUDevice("two-sources", quiet_inline=True)
    try:
        engine.add_source(sources[0])
        assert await _thread_of(device) == threading.get_ident()
        engine.add_source(sources[1])
        assert await _thread_of(device) != threading.get_ident()
        assert device.num_quiet == 1
    finally:
        for src in sources:
            engine.remove_source(src)
        device.close()


def test_quiet_switch_from_env_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOREADY_CPU_QUIET_INLINE", "yes")
    with pytest.raises(ConfigError, match="AIOREADY_CPU_QUIET_INLINE"):
        cpu.CPUDevice()


def test_by_default_quiet_only_on_a_loop_aioready_made(monkeypatch: pytest.MonkeyPatch) -> None:
    """A service that embeds a pipeline keeps its loop serving while a task computes; a loop
    that aioready.run made (the CLI, a launched script) is the runtime's own to block."""
    monkeypatch.delenv("AIOREADY_CPU_QUIET_INLINE", raising=False)
    device = cpu.CPUDevice("default")
    try:
        assert device.quiet_inline is None
        caller = threading.get_ident()
        on_service_loop = asyncio.run(_thread_of(device))
        assert on_service_loop != caller and device.num_quiet == 0
        assert run_loop(_thread_of(device)) == caller and device.num_quiet == 1
    finally:
        device.close()
    monkeypatch.setenv("AIOREADY_CPU_QUIET_INLINE", "1")  # forced on a service's loop too
    device = cpu.CPUDevice("forced")
    try:
        assert asyncio.run(_thread_of(device)) == threading.get_ident()
    finally:
        device.close()


async def test_a_quiet_task_computes_with_the_engines_doorbells_disarmed() -> None:
    """With `inline_disarm`, a task that starts while the engine is parked on its doorbells
    computes with them disarmed (a peer's message meanwhile rings nobody: the loop could not answer it), and the
    park is armed again when the task ends, with the task's-end poll after it."""
    loop = asyncio.get_running_loop()
    engine = ProgressEngine.for_loop(loop)
    config = engine.config
    engine.reconfigure(ProgressConfig(spin_s=0.0, inline_disarm=True))  # no spin window
    source = BellSource()
    engine.add_source(source)
    device = cpu.CPUDevice("bell", quiet_inline=True)
    try:
        engine.set_waiting(True)
        for _ in range(1000):
            if source.armed:
                break
            await asyncio.sleep(0.001)
        assert source.armed
        engine.set_waiting(False)
        polls = source.polls
        armed_during = await device.run(INFO, lambda: source.armed)
        assert device.num_quiet == 1 and not armed_during
        assert source.armed and source.polls == polls + 1
    finally:
        engine.remove_source(source)
        engine.reconfigure(config)
        device.close()
