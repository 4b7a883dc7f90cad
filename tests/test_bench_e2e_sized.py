"""bench.e2e --sized: the microbatch sizes known before a step reach the pipeline in the order
the caller gives them, and the microbatch in each slot sleeps its own durations.

In one process, with the harness's own pieces (bench/e2e.py's trace, bench/e2e_sized.py's
sizes, bench/e2e_worker.py's model and data): a "middle" pipeline runs the first stage's
forwards in `cost_order` of that step's sizes, every microbatch's tasks get its own trace
durations, and loss and gradients match the given order (float64). Under MPI (2 ranks): every
rank passes the sizes, the rows say the order they ran, and each rank slept its trace.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import pytest
import torch
from conftest import requires_mpi

from aioready.errors import ConfigError
from aioready.placement import Placement
from aioready.runtime.autotune import AutoHint
from aioready.runtime.pipeline import Pipeline
from aioready.schedulers.order import cost_order
from aioready.sim.traces import read_trace
from aioready.tasks import Kind
from aioready.testing.helpers import make_mlp_stages, max_grad_diff, mse_loss
from aioready.testing.models import lm_loss
from bench.e2e import generate_trace, run_scenario
from bench.e2e_sized import read_sizes, split_order, step_costs, write_sizes
from bench.e2e_worker import RunShape, _build, _data, stage_seconds

SPEC, SEED, S, M, STEPS, GROUPS = "multimodal:0.3:3", 0, 4, 8, 2, 8


def test_config_names_carry_an_optional_order() -> None:
    assert split_order("1f1b/ready@2x+middle") == ("1f1b/ready@2x", "middle")
    assert split_order("zb-h1/strict+ascending") == ("zb-h1/strict", "ascending")
    assert split_order("auto/ready@2x") == ("auto/ready@2x", None)
    for bad in ("1f1b/ready+sideways", "auto/ready@2x+middle"):
        with pytest.raises(SystemExit, match="ORDER"):
            split_order(bad)


def test_sizes_follow_the_multimodal_draw(tmp_path: Path) -> None:
    path = tmp_path / "sizes.json"
    assert write_sizes(SPEC + "+straggler:1:1.5", seed=SEED, groups=GROUPS, microbatches=M,
                       steps=STEPS, path=path)
    sizes = read_sizes(path)
    trace_path = tmp_path / "trace.csv"
    generate_trace(SPEC, seed=SEED, groups=GROUPS, microbatches=M, steps=STEPS, task_ms=20.0,
                   path=trace_path)
    trace = read_trace(trace_path, placement=Placement(GROUPS, GROUPS, "linear"))
    for step in range(STEPS):
        assert set(sizes[step]) == {1.0, 3.0}  # this seed has heavy and light microbatches
        forward = trace.table(step)[:, :, Kind.F].mean(axis=0)  # mean over the groups
        heavy = [m for m in range(M) if sizes[step][m] == 3.0]
        light = [m for m in range(M) if sizes[step][m] == 1.0]
        assert min(forward[heavy]) > 2 * max(forward[light]), step  # the sizes are the sleeps'
    assert not write_sizes("lognormal:0.5", seed=SEED, groups=GROUPS, microbatches=M, steps=1,
                           path=tmp_path / "none.json")


def _args() -> argparse.Namespace:
    return argparse.Namespace(thin=False, vocab=64, dim=16, heads=2, seq=8, seed=SEED,
                              dtype="float64", microbatches=M, mb_size=2, groups=GROUPS)


def _run(tmp_path: Path, order: str | None) -> tuple[list[tuple[int, int, Kind]], list, list]:
    """Both steps in one process; (stage, microbatch, kind) of each sleep, the losses, stages."""
    tmp_path.mkdir()
    trace_path = tmp_path / "trace.csv"
    generate_trace(SPEC, seed=SEED, groups=GROUPS, microbatches=M, steps=STEPS, task_ms=0.0,
                   path=trace_path)
    trace = read_trace(trace_path, placement=Placement(GROUPS, GROUPS, "linear"))
    write_sizes(SPEC, seed=SEED, groups=GROUPS, microbatches=M, steps=STEPS,
                path=tmp_path / "sizes.json")
    sizes = read_sizes(tmp_path / "sizes.json")
    shape = RunShape(Placement(S, S, "linear"), GROUPS, False)
    stages, injector = _build(_args(), shape, tuple(range(S)), trace, None)
    seen: list[tuple[int, int, Kind]] = []
    durations = injector.duration

    def recording(step: int, stage: int, mb: int, kind: Kind) -> float:
        seen.append((stage, mb, kind))
        assert durations(step, stage, mb, kind) == pytest.approx(
            stage_seconds(trace.table(step), shape, None)[stage, mb, kind])
        return 0.0
    injector.duration = recording
    x, y, tags = _data(_args())
    inputs = [(x[m * 2:(m + 1) * 2], tags[m * 2:(m + 1) * 2]) for m in range(M)]
    targets = list(y.split(2))
    pipe = Pipeline(stages, lm_loss, microbatches=M, mode="ready", microbatch_order=order)
    losses = []

    async def steps() -> None:
        for step in range(STEPS):
            for m in stages:
                m.zero_grad(set_to_none=True)
            injector.step = step
            seen.append((-1, step, Kind.F))  # a step marker
            losses.append(await pipe.step(inputs, targets, costs=step_costs(sizes, step, pipe)))
    asyncio.run(steps())
    pipe.close()
    return seen, losses, stages


def test_sized_costs_reach_the_pipeline_in_the_callers_order(tmp_path: Path) -> None:
    sizes_seen, losses, stages = _run(tmp_path / "middle", "middle")
    sizes = read_sizes(tmp_path / "middle" / "sizes.json")
    marks = [i for i, (s, _, _) in enumerate(sizes_seen) if s == -1] + [len(sizes_seen)]
    for step in range(STEPS):
        window = sizes_seen[marks[step] + 1:marks[step + 1]]
        first = [mb for stage, mb, kind in window if stage == 0 and kind is Kind.F]
        want = list(cost_order(sizes[step], "middle", S, split_backward=False))
        assert first == want and want != list(range(M)), (step, first, want)
        assert sorted(window) == sorted((s, m, k) for s in range(S) for m in range(M)
                                        for k in (Kind.F, Kind.B, Kind.W))  # each task once
    _, given_losses, given_stages = _run(tmp_path / "given", None)
    for mine, theirs in zip(losses, given_losses):
        assert float(mine) == pytest.approx(float(theirs), rel=1e-12, abs=1e-12)
    assert max_grad_diff(stages, given_stages) < 1e-10


def test_only_pipelines_that_order_get_costs() -> None:
    """`Pipeline.takes_costs` says where step(costs=) orders microbatches (and so where the
    harness passes them): true exactly where a step with costs runs, false where it is refused."""
    stages = make_mlp_stages(2, width=4, hidden=8)
    sizes = [[1.0, 3.0, 1.0, 1.0]]
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    given = Pipeline(stages, mse_loss, microbatches=4)
    middle = Pipeline(stages, mse_loss, microbatches=4, microbatch_order="middle")
    auto = Pipeline(stages, mse_loss, microbatches=4, hint=AutoHint(start="1f1b"), cap="2x")
    fixed_auto = Pipeline(stages, mse_loss, microbatches=4, hint=AutoHint(start="1f1b"),
                          cap="2x", microbatch_order="given")
    try:
        for pipe, takes in ((given, False), (fixed_auto, False), (middle, True), (auto, True)):
            assert pipe.takes_costs is takes
            assert step_costs(sizes, 0, pipe) == (sizes[0] if takes else None)
            if takes:
                asyncio.run(pipe.step(x, y, costs=sizes[0]))
            else:
                with pytest.raises(ConfigError, match="costs"):
                    asyncio.run(pipe.step(x, y, costs=sizes[0]))
        assert step_costs(None, 0, middle) is None
    finally:
        for pipe in (given, middle, auto, fixed_auto):
            pipe.close()


@requires_mpi
@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_sized_rows_on_two_mpi_ranks(tmp_path: Path) -> None:
    ranks, m = 2, 6
    configs = ["1f1b/ready", "1f1b/ready+middle", "auto/ready@2x"]
    run = run_scenario(SPEC, workdir=tmp_path, ranks=ranks, groups=GROUPS, microbatches=m,
                       task_ms=1.0, warmup=1, steps=1, seed=SEED, aioready_configs=configs,
                       torch_configs=[], model_args=["--dtype", "float64", "--dim", "16",
                                                     "--seq", "8", "--vocab", "64"],
                       timeout=250, sized=True)
    rows = {r["name"]: r for r in run["records"]}
    assert set(rows) == set(configs)
    assert rows["1f1b/ready"]["order"] == "given"
    assert rows["1f1b/ready+middle"]["order"] == "middle"
    assert len(rows["1f1b/ready"]["caps"]) == ranks
    auto = rows["auto/ready@2x"]  # its choice rests on measured times: only its form is fixed
    chosen_order = auto["chosen"].split()[0].partition("+")[2] or "given"
    assert auto["order"] == chosen_order, auto["chosen"]  # it ran the order it chose
    trace = read_trace(run["trace"], placement=Placement(GROUPS, GROUPS, "linear"))
    for name, row in rows.items():
        shape = RunShape(Placement(row["num_stages"], ranks, row["style"]), GROUPS,
                         row["split_backward"])
        table = stage_seconds(trace.table(1), shape, None)
        for rank in range(ranks):  # every microbatch slept its own durations, once
            want = [float(table[list(shape.placement.stages_of(rank))][:, :, k].sum())
                    for k in range(3)]
            assert row["slept_s"][rank] == pytest.approx(want, rel=1e-9, abs=1e-12), name
        assert row["loss"] == pytest.approx(rows["1f1b/ready"]["loss"], rel=1e-12), name
        assert row["grad_sq"] == pytest.approx(rows["1f1b/ready"]["grad_sq"], rel=1e-9), name


def test_launches_reduce_to_a_median_and_a_spread() -> None:
    from bench.e2e_sized import _aggregate, _loss_note

    def row(name: str, seconds: float, loss: float) -> dict:
        return {"name": name, "side": "aioready", "median_s": seconds, "efficiency": 0.5,
                "lower_bound_s": 1.0, "split_backward": False, "caps": [2, 1],
                "order": "middle", "chosen": None, "peak_activations": [2.0, 1.0],
                "loss": loss, "grad_sq": 2.0}
    launches = [{"rows": [row("a", t, 1.5), row("b", 2 * t, 1.5)]} for t in (3.0, 1.0, 2.0)]
    rows = {r["name"]: r for r in _aggregate(launches)}
    assert (rows["a"]["median_s"], rows["a"]["min_s"], rows["a"]["max_s"]) == (2.0, 1.0, 3.0)
    assert rows["b"]["launch_median_s"] == [6.0, 2.0, 4.0]
    assert _loss_note(list(rows.values())).startswith("The loss is bitwise identical")
    launches[1]["rows"][1]["loss"] = 1.5000001
    note = _loss_note(_aggregate(launches))
    assert "not bitwise identical" in note and "1.5000001 on b" in note, note


def test_the_simulated_twin_runs_each_row_as_configured(tmp_path: Path) -> None:
    from bench.e2e_sized import twin
    trace, sizes, m, steps = tmp_path / "trace.csv", tmp_path / "sizes.json", 8, 2
    generate_trace("none", seed=SEED, groups=GROUPS, microbatches=m, steps=steps + 1,
                   task_ms=10.0, path=trace)
    flat = [[1.0] * m for _ in range(steps + 1)]
    got = twin(["1f1b/strict"], "none", trace, flat, groups=GROUPS, ranks=S, microbatches=m,
               warmup=1, steps=steps)
    # uniform durations, F = 10 ms and B = 20 ms per stage: 1F1B takes (M + S - 1)(F + B)
    assert got["1f1b/strict"][0] == pytest.approx((m + S - 1) * 0.030, rel=1e-9)
    write_sizes(SPEC, seed=SEED, groups=GROUPS, microbatches=m, steps=steps + 1, path=sizes)
    generate_trace(SPEC, seed=SEED, groups=GROUPS, microbatches=m, steps=steps + 1,
                   task_ms=10.0, path=trace)
    got = twin(["1f1b/strict", "1f1b/strict+middle", "auto/ready@2x"], SPEC, trace,
               read_sizes(sizes), groups=GROUPS, ranks=S, microbatches=m, warmup=1,
               steps=steps)
    assert got["1f1b/strict+middle"][1].startswith("1f1b+middle strict")
    assert got["1f1b/strict+middle"][0] < got["1f1b/strict"][0]  # the heavy ones placed
    assert got["auto/ready@2x"][1].startswith("auto:")  # "auto:" and the hint it chose
