"""CUDA path: the poll logic with fake events (runs everywhere), the real thing when a GPU is there."""

from __future__ import annotations

import asyncio
import ctypes
import os
import threading

import pytest
import torch

from aioready.cuda import events as cuda_events
from aioready.cuda.events import CUDAEventSource
from aioready.devices.cuda import CUDADevice, cuda_available
from aioready.errors import ConfigError, StageError

gpu = pytest.mark.skipif(not cuda_available(), reason="no CUDA device visible to torch")


class FakeEvent:
    """Stands in for torch.cuda.Event: query() says whether it completed; counts queries."""

    def __init__(self) -> None:
        self.done = False
        self.queries = 0
        self.error: Exception | None = None
        self._gate = threading.Event()

    def query(self) -> bool:
        self.queries += 1
        if self.error is not None:
            raise self.error
        return self.done

    def finish(self) -> None:
        self.done = True
        self._gate.set()

    def synchronize(self) -> None:
        assert self._gate.wait(10), "fake event never finished"


class FakeEngine:
    def __init__(self) -> None:
        self.sources: list = []
        self.kicks = 0

    def add_source(self, src) -> None:
        self.sources.append(src)

    def kick(self) -> None:
        self.kicks += 1


async def test_poll_queries_only_the_head_of_each_stream() -> None:
    engine = FakeEngine()
    src = CUDAEventSource(wake="poll", engine=engine)
    assert engine.sources == [src]
    a = [FakeEvent() for _ in range(3)]
    b = [FakeEvent() for _ in range(2)]
    futs_a = [src.add(e, "A") for e in a]
    futs_b = [src.add(e, "B") for e in b]
    assert engine.kicks == 5 and src.num_pending() == 5 and src.wants_hot()
    assert src.poll() == 0
    assert [e.queries for e in a + b] == [1, 0, 0, 1, 0]
    a[1].finish()  # finished out of order on its stream: still waits for the head
    b[0].finish()
    assert src.poll() == 1
    assert futs_b[0].done() and not any(f.done() for f in futs_a)
    assert [e.queries for e in a] == [2, 0, 0] and b[1].queries == 1
    a[0].finish()
    assert src.poll() == 2  # a[0] and a[1]; a[2] is the new head
    assert [f.done() for f in futs_a] == [True, True, False]
    a[2].finish()
    b[1].finish()
    assert src.poll() == 2 and src.num_pending() == 0 and not src.wants_hot()
    assert src.num_completed == 5


async def test_query_error_fails_that_task_only() -> None:
    src = CUDAEventSource(wake="poll", engine=FakeEngine())
    bad, good = FakeEvent(), FakeEvent()
    bad.error = RuntimeError("CUDA error: an illegal memory access was encountered")
    f_bad, f_good = src.add(bad, 0), src.add(good, 0)
    good.finish()
    assert src.poll() == 2
    with pytest.raises(StageError, match="illegal memory access"):
        f_bad.result()
    assert f_good.result() is None


async def test_progress_engine_resolves_futures_and_goes_idle() -> None:
    from aioready.progress import ProgressEngine
    loop = asyncio.get_running_loop()
    engine = ProgressEngine.for_loop(loop)
    src = CUDAEventSource(wake="poll")
    assert src.engine is engine
    events = [FakeEvent() for _ in range(4)]
    futs = [src.add(e, i % 2) for i, e in enumerate(events)]
    for i, e in enumerate(events):
        loop.call_later(0.001 * (i + 1), e.finish)
    await asyncio.wait_for(asyncio.gather(*futs), 5)
    assert src.num_pending() == 0 and src.num_completed == 4
    await asyncio.sleep(0.01)
    idle = engine.statistics().num_idle_waits
    assert idle >= 1  # nothing pending: the engine waits for a kick, it does not spin
    e = FakeEvent()
    fut = src.add(e, 0)
    loop.call_later(0.002, e.finish)
    await asyncio.wait_for(fut, 5)
    src.close()
    engine.close()


async def test_thread_wake_does_not_keep_the_engine_hot() -> None:
    engine = FakeEngine()
    src = CUDAEventSource(wake="thread", engine=engine)
    events = [FakeEvent() for _ in range(3)]
    futs = [src.add(e, "s") for e in events]
    assert not src.wants_hot() and engine.kicks == 0
    for e in events:
        threading.Timer(0.005, e.finish).start()
    await asyncio.wait_for(asyncio.gather(*futs), 5)
    assert src.num_pending() == 0
    src.close()


async def test_unknown_wake_mode_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="wake mode"):
        CUDAEventSource(wake="spin", engine=FakeEngine())


@pytest.mark.skipif(not hasattr(os, "eventfd"), reason="os.eventfd needs Linux")
async def test_hostfn_shim_writes_the_eventfd_the_loop_watches() -> None:
    try:
        shim = cuda_events.notify_shim()
    except ConfigError as exc:
        pytest.skip(f"no C compiler: {exc}")
    loop = asyncio.get_running_loop()
    efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    woke = loop.create_future()
    loop.add_reader(efd, lambda: woke.done() or woke.set_result(os.eventfd_read(efd)))
    try:
        # A plain C thread stands in for CUDA's driver thread calling the host function.
        fn = ctypes.cast(shim.aioready_notify, ctypes.c_void_p).value
        threading.Thread(target=ctypes.CFUNCTYPE(None, ctypes.c_void_p)(fn),
                         args=(efd,)).start()
        assert await asyncio.wait_for(woke, 5) == 1
    finally:
        loop.remove_reader(efd)
        os.close(efd)


def test_cuda_device_without_a_gpu_is_a_clear_error() -> None:
    if cuda_available():
        pytest.skip("a GPU is visible: the no-GPU error cannot be shown")
    with pytest.raises(ConfigError, match="no CUDA device"):
        CUDADevice(0)


def test_cuda_device_rejects_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        CUDADevice("cpu")
    with pytest.raises(ConfigError, match=">= 0"):
        CUDADevice(-1)
    with pytest.raises(ConfigError, match="int | str"):
        CUDADevice(1.5)


def test_pipeline_device_cuda_without_gpu_is_a_clear_error() -> None:
    if cuda_available():
        pytest.skip("a GPU is visible")
    from aioready.runtime.pipeline import Pipeline
    from aioready.testing.helpers import make_mlp_stages, mse_loss
    with pytest.raises(ConfigError, match="no CUDA device"):
        Pipeline(make_mlp_stages(2), mse_loss, microbatches=2, device="cuda")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["strict", "ready"])
@pytest.mark.parametrize("wake", ["poll", "hybrid", "thread"])
def test_gpu_pipeline_matches_unsplit_model(mode: str, wake: str) -> None:
    """Plain (not async) so it also runs where pytest-asyncio is missing (the GPU image)."""
    import aioready
    from aioready.runtime.pipeline import Pipeline
    from aioready.testing.helpers import make_mlp_stages, max_grad_diff, mse_loss, reference_step
    stages = [s.cuda() for s in make_mlp_stages(4)]
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 16, generator=gen, dtype=torch.float64).cuda() for _ in range(8)]
    ys = [torch.randn(4, 16, generator=gen, dtype=torch.float64).cuda() for _ in range(8)]
    ref_loss, ref = reference_step(stages, mse_loss, xs, ys)
    pipe = Pipeline(stages, mse_loss, microbatches=8, mode=mode,
                    device=lambda r: CUDADevice(r, wake=wake))

    async def step() -> torch.Tensor:
        return await asyncio.wait_for(pipe.step(xs, ys), 60)

    loss = aioready.run(step())
    torch.cuda.synchronize()
    assert {rt.device.stream.cuda_stream for rt in pipe.runtimes}.__len__() == 4
    assert abs(float(loss) - float(ref_loss)) <= 1e-10
    assert max_grad_diff(stages, ref) <= 1e-10
    pipe.close()

async def test_hybrid_spins_then_hands_pending_events_to_waiters() -> None:
    engine = FakeEngine()
    src = CUDAEventSource(wake="hybrid", engine=engine, spin_s=0.005)
    fast, slow = FakeEvent(), FakeEvent()
    f_fast = src.add(fast, "s")
    assert engine.kicks == 1 and src.wants_hot() and not src._waiters
    fast.finish()
    assert src.poll() == 1 and f_fast.done()
    f_slow = src.add(slow, "s")
    await asyncio.sleep(0.01)
    assert not src.wants_hot()  # window over: parked, a waiter thread took the event
    assert list(src._waiters) == ["s"]
    threading.Timer(0.005, slow.finish).start()
    await asyncio.wait_for(f_slow, 5)
    src.close()
