"""Sleep injection (aioready/testing/inject.py) and `aioready train --trace --sleep-only`, in-process.

The injected wrapper must leave the model's math exactly as it was (float64, against the unsplit
unwrapped model), sleep each task exactly once (split backward revisits nodes on its way to the
weights), and keep its dummy parameter's gradient an exact zero.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from aioready.placement import Placement
from aioready.runtime.pipeline import Pipeline
from aioready.tasks import Kind
from aioready.testing.inject import SleepInjector, make_tags, wrap_stages
from aioready.testing.models import gpt_stages, lm_loss

S, M, B, T, V = 4, 4, 2, 8, 32


def _reference(stages: list[torch.nn.Module], xs: list, ys: list) -> tuple[float, list]:
    model = [copy.deepcopy(s) for s in stages]
    total = 0.0
    for x, y in zip(xs, ys):
        h = x
        for s in model:
            h = s(h)
        loss = lm_loss(h, y) / M
        loss.backward()
        total += float(loss.detach())
    return total, model


@pytest.mark.parametrize("hint,split", [("1f1b", False), ("zb-h1", True)])
async def test_injection_keeps_the_math_and_sleeps_each_task_once(hint: str, split: bool) -> None:
    base = gpt_stages(S, vocab=V, dim=16, heads=2, seq=T, dtype=torch.float64, seed=3)
    ref_loss, ref = _reference(base, *_data())
    calls: list[tuple[int, int, Kind]] = []
    injector = SleepInjector(lambda step, s, m, k: calls.append((s, m, k)) or 0.0)
    stages = wrap_stages(base, range(S), S, injector)
    xs, ys = _data()
    tags = make_tags(M, B).split(B)
    pipe = Pipeline(stages, lm_loss, microbatches=M, hint=hint, mode="ready",
                    split_backward=split)
    try:
        loss = await pipe.step([(x, t) for x, t in zip(xs, tags)], ys)
    finally:
        pipe.close()
    assert abs(float(loss) - ref_loss) <= 1e-10
    diff = max(float((p.grad - q.grad).abs().max())
               for w, r in zip(stages, ref) for p, q in zip(w.inner.parameters(), r.parameters()))
    assert diff <= 1e-10
    assert all(float(w.zero.grad) == 0.0 for w in stages)
    want = sorted((s, m, k) for s in range(S) for m in range(M) for k in Kind)
    assert sorted(calls) == want  # every task once, with the right microbatch id
    assert injector.count == [S * M] * 3


def _data() -> tuple[list, list]:
    gen = torch.Generator().manual_seed(7)
    x = torch.randint(0, V, (M * B, T), generator=gen)
    y = torch.randint(0, V, (M * B, T), generator=gen)
    return list(x.split(B)), list(y.split(B))


def test_injector_sleeps_its_duration() -> None:
    injector = SleepInjector(lambda step, s, m, k: 0.002 * (step + 1))
    injector.step = 1
    injector.sleep(0, 0, Kind.F)
    injector.sleep(0, 0, Kind.W)
    assert injector.slept == pytest.approx([0.004, 0.0, 0.004])
    assert injector.count == [1, 0, 1]


def test_injector_counts_a_task_only_once_it_has_slept(monkeypatch: pytest.MonkeyPatch) -> None:
    """The totals the benchmark checks (what every rank slept) must come from sleeps that
    happened: a sleep that is skipped or fails leaves nothing counted."""
    import aioready.testing.inject as inject
    slept: list[float] = []
    monkeypatch.setattr(inject.time, "sleep", slept.append)
    injector = SleepInjector(lambda step, s, m, k: 0.003)
    injector.sleep(1, 2, Kind.B)
    assert slept == [0.003]  # it did sleep, for the task's duration
    assert injector.count == [0, 1, 0] and injector.slept == pytest.approx([0.0, 0.003, 0.0])

    def refuse(seconds: float) -> None:
        raise InterruptedError(seconds)
    monkeypatch.setattr(inject.time, "sleep", refuse)
    with pytest.raises(InterruptedError):
        injector.sleep(0, 0, Kind.F)
    assert injector.count == [0, 1, 0]  # the task that never slept is not counted


def test_tracking_injector_peaks_in_linear_stage_microbatches(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import aioready.testing.inject as inject
    from bench.e2e_thin import TrackingInjector
    monkeypatch.setattr(inject.time, "sleep", lambda seconds: None)
    injector = TrackingInjector(lambda step, s, m, k: 0.001, weight=0.5)
    for m in range(3):
        injector.sleep(0, m, Kind.F)
    injector.sleep(0, 0, Kind.B)
    assert injector.in_flight == 3  # B alone does not free microbatch 0: W still holds it
    injector.sleep(0, 0, Kind.W)
    injector.sleep(0, 3, Kind.F)
    for m in (1, 2, 3):
        injector.sleep(0, m, Kind.W)
        injector.sleep(0, m, Kind.B)
    assert injector.in_flight == 0 and injector.peak == 3
    assert injector.peak_activations() == 1.5
    injector.reset()
    assert injector.peak == 0 and injector.count == [0, 0, 0]


async def test_train_replays_a_trace_sleep_only(tmp_path: Path) -> None:
    from aioready.cli.trainer import TrainConfig, train
    from aioready.sim.traces import write_trace
    from aioready.sim.variability import BaseDurations, JitterModel
    from aioready.telemetry.bounds import lower_bound_table

    placement = Placement(2, 2, "linear")
    model = JitterModel("lognormal:0.5", seed=2, placement=placement, num_microbatches=2,
                        base=BaseDurations(f=3.0, b=6.0))
    path = tmp_path / "trace.csv"
    write_trace(path, model, steps=2)
    cfg = TrainConfig(stages=2, microbatches=2, steps=2, trace=str(path), sleep_only=True)
    result = await train(cfg)
    assert result.losses == [None, None]  # no compute ran
    assert "trace" in result.durations
    for step, m in enumerate(result.metrics):
        bound = lower_bound_table(placement, model.table(step), False) * 1e-3
        assert m.step_time >= bound * 0.999  # a replay never beats its trace's lower bound


async def test_train_trace_mode_add_is_in_the_summary(tmp_path: Path) -> None:
    """`--trace-mode add`: the model computes, then every task sleeps its whole traced
    duration; the summary says which mode replayed the trace."""
    from aioready.cli.trainer import TrainConfig, train
    from aioready.errors import ConfigError
    from aioready.sim.traces import write_trace
    from aioready.sim.variability import BaseDurations, JitterModel
    from aioready.telemetry.bounds import lower_bound_table

    placement = Placement(2, 2, "linear")
    model = JitterModel("multimodal:0.3:3", seed=1, placement=placement, num_microbatches=2,
                        base=BaseDurations(f=2.0, b=4.0))
    path = tmp_path / "trace.csv"
    write_trace(path, model, steps=2)
    cfg = TrainConfig(stages=2, microbatches=2, steps=2, trace=str(path), trace_mode="add",
                      seq=8, dim=16)
    result = await train(cfg)
    summary = result.summary(cfg)
    assert summary["trace_mode"] == "add" and summary["trace"] == str(path)
    assert all(loss is not None for loss in result.losses)  # the model did compute
    assert result.overruns == 0  # add mode has nothing to overrun
    for step, m in enumerate(result.metrics):
        assert m.step_time >= lower_bound_table(placement, model.table(step), False) * 1e-3
    floor = TrainConfig(stages=2, microbatches=2, steps=1, trace=str(path))
    assert result.summary(floor)["trace_mode"] == "floor"  # the default
    with pytest.raises(ConfigError, match="trace_mode"):
        TrainConfig(trace=str(path), trace_mode="at-least")


def test_train_sleep_only_flag_parses() -> None:
    import argparse

    from aioready.cli import train as cmd
    parser = argparse.ArgumentParser()
    cmd.add_parser(parser.add_subparsers())
    args = parser.parse_args(["train", "--trace", "t.csv", "--sleep-only"])
    assert cmd.config_from_args(args).sleep_only is True
    assert cmd.config_from_args(args).trace_mode == "floor"
    args = parser.parse_args(["train", "--trace", "t.csv", "--trace-mode", "add"])
    assert cmd.config_from_args(args).trace_mode == "add"
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--trace", "t.csv", "--trace-mode", "at-least"])
