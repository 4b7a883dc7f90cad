"""Stall diagnosis: a lost message or a hint and cap that cannot progress end the step with a
StallError carrying every rank's dump, instead of a hang."""

from __future__ import annotations

import asyncio

import pytest
import torch
from tp_grid import Grid

from aioready import ConfigError, Kind, StageError, StallError
from aioready.clock import run_virtual
from aioready.devices.sim import SimDevice
from aioready.runtime.pipeline import Pipeline
from aioready.runtime.watchdog import StallWatchdog, StepGuard, resolve_timeout
from aioready.schedulers import make_hint
from aioready.testing.helpers import make_mlp_stages, mse_loss
from aioready.transports.base import MessageKind

pytestmark = pytest.mark.timeout(60)


def _sim_pipe(**kw: object) -> Pipeline:
    return Pipeline([None] * 4, None, microbatches=8, hint="1f1b",
                    device=SimDevice(lambda i: 1.0 if i.kind == Kind.F else 2.0,
                                     run_compute=False), **kw)  # type: ignore[arg-type]


def _drop_grad_b3_stage1(src: int, dest: int, msg: object) -> bool:
    return (getattr(msg, "kind", None) is MessageKind.GRADIENT and msg.stage == 1  # type: ignore
            and msg.microbatch == 3)  # type: ignore[attr-defined]


def _lost_b3_dump(pipe: Pipeline) -> str:
    """Run a step of `pipe` whose gradient of B3 into stage 1 is lost; the stall dump."""
    pipe.runtimes[0].transport.world.drop = _drop_grad_b3_stage1  # type: ignore[attr-defined]

    async def main() -> None:
        await pipe.step()
    with pytest.raises(StallError) as info:
        run_virtual(main())
    return str(info.value)


def test_lost_message_stops_with_dump() -> None:
    pipe = _sim_pipe(stall_timeout=5.0, policy="greedy")
    text = _lost_b3_dump(pipe)
    assert "step 0" in text and "stall_timeout=5 s" in text
    # rank 1 waits for B3's gradient from rank 2: the dump names the lost message's task
    assert "rank 1 step 0" in text and "'B3<-rank 2'" in text
    assert "rank 0 step 0" in text  # rank 0 waits too; ranks 2 and 3 finished their part
    assert "rank 2: idle after step 0" in text and "rank 3: idle after step 0" in text
    assert "hint position" in text and "in flight" in text
    assert pipe.stall_watchdog is not None and pipe.stall_watchdog.last_dump


def test_lost_message_under_the_reservation_names_the_task_held_for() -> None:
    """The default policy keeps rank 1's device for B3 (the hint's next task): B4 and B5 wait,
    so rank 2 does not finish either; the dump says what each rank holds out for."""
    pipe = _sim_pipe(stall_timeout=5.0)
    text = _lost_b3_dump(pipe)
    assert "rank 1 step 0" in text and "'B3<-rank 2'" in text
    rank1 = next(line for line in text.splitlines() if line.startswith("rank 1 step 0"))
    assert "reserved for B3" in rank1 and "'B4'" in rank1 and "'B5'" in rank1
    assert not any(rt._active for rt in pipe.runtimes)


def test_strict_cap_below_peak_stalls() -> None:
    pipe = _sim_pipe(mode="strict", stall_timeout=10.0)
    pipe.runtimes[0].cap = 1  # forced past the check that refuses it: F1 waits for B0, B0 for F1

    async def main() -> None:
        await pipe.step()
    with pytest.raises(StallError) as info:
        run_virtual(main())
    text = str(info.value)
    assert "in flight 1/1 microbatches [0]" in text
    assert "strict next F1" in text


def test_no_stall_when_progressing() -> None:
    pipe = _sim_pipe(mode="strict", stall_timeout=2.5)  # tasks take 1-2 s: progress every <= 2 s

    async def main() -> None:
        await pipe.step()
        await pipe.step()
    run_virtual(main())
    assert pipe.last_step is not None and pipe.last_step.step_time == 33.0


async def test_stall_on_real_loop_with_torch() -> None:
    stages = make_mlp_stages(4)
    pipe = Pipeline(stages, mse_loss, microbatches=4, hint="1f1b", stall_timeout=30.0)
    x, y = torch.randn(8, 16, dtype=torch.float64), torch.randn(8, 16, dtype=torch.float64)
    await pipe.step(x, y)  # warm-up: torch's first backward can take seconds on a busy host
    assert pipe.stall_watchdog is not None
    pipe.stall_watchdog.timeout = 1.0
    dropped = []
    pipe.runtimes[0].transport.world.drop = lambda s, d, m: bool(  # type: ignore[attr-defined]
        m.kind is MessageKind.ACTIVATION and m.stage == 2 and m.microbatch == 1
        and not dropped.append(m))
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(StallError) as info:
        await pipe.step(x, y)
    assert loop.time() - start >= 1.0  # never before the stall timeout; how soon after is load
    assert len(dropped) == 1
    assert "step 1" in str(info.value) and "'F1<-rank 1'" in str(info.value)
    pipe.close()


async def test_stage_exception_ends_step_and_cancels_others() -> None:
    stages = make_mlp_stages(4)

    class Boom(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("boom in stage 2")
    stages[2] = Boom()
    pipe = Pipeline(stages, mse_loss, microbatches=4, hint="1f1b", stall_timeout=30)
    x, y = torch.randn(8, 16, dtype=torch.float64), torch.randn(8, 16, dtype=torch.float64)
    with pytest.raises(StageError) as info:
        await asyncio.wait_for(pipe.step(x, y), 20)
    text = str(info.value)
    assert text.startswith("rank 2, step 0, task F0: forward of stage 2 raised ValueError: "
                           "boom in stage 2"), text
    assert not any(rt._active for rt in pipe.runtimes)
    pipe.close()


def test_timeout_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from aioready.runtime.watchdog import DEFAULT
    monkeypatch.delenv("AIOREADY_STALL_TIMEOUT", raising=False)
    assert resolve_timeout("stall_timeout", DEFAULT, "AIOREADY_STALL_TIMEOUT", 60.0) == 60.0
    monkeypatch.setenv("AIOREADY_STALL_TIMEOUT", "2.5")
    assert resolve_timeout("stall_timeout", DEFAULT, "AIOREADY_STALL_TIMEOUT", 60.0) == 2.5
    assert resolve_timeout("stall_timeout", 7, "AIOREADY_STALL_TIMEOUT", 60.0) == 7.0
    monkeypatch.setenv("AIOREADY_STALL_TIMEOUT", "off")
    assert _sim_pipe().stall_watchdog is None
    monkeypatch.setenv("AIOREADY_STALL_TIMEOUT", "soon")
    with pytest.raises(ConfigError, match="AIOREADY_STALL_TIMEOUT is not a number"):
        _sim_pipe()
    monkeypatch.delenv("AIOREADY_STALL_TIMEOUT")
    for bad in (-1, "5", float("inf"), True):
        with pytest.raises(ConfigError, match="stall_timeout= must be a positive number"):
            _sim_pipe(stall_timeout=bad)
    assert _sim_pipe(stall_timeout=None).stall_watchdog is None


@pytest.mark.parametrize("line", [0, 1])
def test_stall_in_a_tp_group_dumps_leaders_and_members(line: int) -> None:
    """A lost activation on TP rank `line`'s pipeline line stalls a 2x2 TP x PP grid. Line 0:
    the leaders wait for it and every member waits for their decision; line 1: the leaders
    finish and the members wait. Either way every rank's dump is its queue's state."""
    hint = make_hint("1f1b", num_stages=2, num_microbatches=4)
    grid = Grid(hint, 2, mode="ready", cap=None, device=lambda p, t: SimDevice(
        lambda i: 1.0 if i.kind == Kind.F else 2.0, run_compute=False))
    grid.pp_worlds[line].drop = lambda src, dest, msg: (
        msg.kind is MessageKind.ACTIVATION and msg.microbatch == 1)
    guard = StepGuard()
    watchdog = StallWatchdog([rt for row in grid.runtimes for rt in row], guard, 10.0)

    async def main() -> None:
        await guard.run(grid.step(0), 0)
    with pytest.raises(StallError):
        run_virtual(main())
    assert watchdog.last_dump is not None and "dump failed" not in watchdog.last_dump
    lead0, member0, lead1, member1 = watchdog.last_dump.split("\n")
    if line == 0:  # stage 1's leader waits for F1's input; its member has it, but no decision
        assert "ready [], in flight 0/1 microbatches []" in lead1
        assert "pending receives 1 ['F1<-rank 0']" in lead1
        assert "ready ['F1'], in flight 0/1 microbatches []" in member1
        assert "strict next None" in member1  # the leader has decided nothing it lacks
        for dump in (lead0, member0):  # stage 0 waits for B1's gradient, F1 still in flight
            assert "in flight 1/2 microbatches [1]" in dump and "'B1<-rank 1'" in dump
    else:  # the members wait for what their leader decided and already ran
        assert lead0 == "rank 0: idle after step 0" and lead1 == "rank 1: idle after step 0"
        assert "ready ['F3'], in flight 2/2 microbatches [1, 2]" in member0
        assert "strict next B1" in member0 and "'B1<-rank 1'" in member0
        assert "in flight 0/1 microbatches []" in member1
        assert "strict next F1" in member1 and "'F1<-rank 0'" in member1
