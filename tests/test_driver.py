"""The one step driver (runtime/driver.py) behind Pipeline.step and simulate: when one rank fails,
the caller gets that rank's error itself, not an exception group or a sibling's cancellation."""

from __future__ import annotations

import pytest

from aioready.clock import run_virtual
from aioready.devices.base import TaskInfo
from aioready.devices.sim import SimDevice
from aioready.errors import StageError
from aioready.runtime.driver import run_ranks
from aioready.runtime.pipeline import Pipeline
from aioready.runtime.rank import RankRuntime
from aioready.schedulers import make_hint
from aioready.tasks import Kind
from aioready.transports.inproc import InprocWorld


def _failing(info: TaskInfo) -> float:
    if (info.rank, info.kind, info.microbatch) == (2, Kind.B, 1):
        raise StageError("boom", task=f"B{info.microbatch}")
    return 1.0


def test_a_failing_rank_raises_its_own_error() -> None:
    hint = make_hint("1f1b", num_stages=4, num_microbatches=4)
    world = InprocWorld(4)
    runtimes = [RankRuntime(rank=r, hint=hint, mode="ready", cap=None, executors=None,
                            device=SimDevice(_failing, run_compute=False),
                            transport=world.endpoints[r]) for r in range(4)]
    with pytest.raises(StageError, match="boom") as info:
        run_virtual(run_ranks(runtimes, 0))
    assert info.value.rank == 2 and info.value.step == 0


def test_the_pipeline_step_uses_the_same_driver() -> None:
    pipe = Pipeline([None] * 4, None, microbatches=4,
                    device=SimDevice(_failing, run_compute=False))
    with pytest.raises(StageError, match="boom") as info:
        run_virtual(pipe.step())
    assert info.value.rank == 2
    assert all(rt.reports == [] for rt in pipe.runtimes)


def test_every_rank_runs_the_step_and_none_is_left_running() -> None:
    hint = make_hint("zbv", num_stages=8, num_microbatches=4, split_backward=True)
    world = InprocWorld(4)
    runtimes = [RankRuntime(rank=r, hint=hint, mode="strict", cap=None, executors=None,
                            device=SimDevice(lambda info: 1.0, run_compute=False),
                            transport=world.endpoints[r]) for r in range(4)]

    async def two_steps() -> list[object]:
        return [await run_ranks(runtimes, step) for step in range(2)]

    assert run_virtual(two_steps()) == [None, None]
    assert [len(rt.reports) for rt in runtimes] == [2] * 4
    assert all(len(rt.reports[-1].spans) == 3 * 2 * 4 for rt in runtimes)
