"""`python -m bench.e2e --scale` at its smallest: one configuration of each runtime, end to end,
through the launchers the published numbers come from (aioready under mpiexec, torch under
torchrun), so the deep-pipeline harness cannot silently rot.

Checked on real outputs: both sides produced one finite step time per measured step; every rank
ran and slept exactly the tasks the trace gives its stages, the same on both sides; the same
loss and gradient norm (float64); a measured peak of activations; a simulated step for both
(torch against the strict form of its schedule) and an overhead share in the summary. No timing
is asserted.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from conftest import requires_mpi

from aioready.placement import Placement
from aioready.sim.traces import read_trace
from bench.e2e_scale import MODEL, run_one
from bench.e2e_scale_report import simulated, summarize
from bench.e2e_worker import DEFAULT, RunShape, stage_seconds

pytestmark = [pytest.mark.mpi, requires_mpi]

S, STEPS, WARMUP = 2, 1, 1
PAIR = ("zbv/ready", "ScheduleZBVZeroBubble")


@pytest.mark.timeout(240)
def test_e2e_torch_side_under_torchrun(tmp_path: Path) -> None:
    """bench.e2e's published torch rows come from torchrun, not from the one-launch path the
    other harness test takes: one schedule through it, with what every rank slept."""
    from bench.e2e import run_scenario, summarize
    run = run_scenario("lognormal:0.5", workdir=tmp_path, ranks=S, groups=4, microbatches=4,
                       task_ms=1.0, warmup=1, steps=1, aioready_configs=[],
                       torch_configs=["Schedule1F1B"], model_args=MODEL, timeout=200)
    (row,) = summarize(run, groups=4, microbatches=4, warmup=1, ranks=S)["rows"]
    assert row["side"] == "torch" and row["name"] == "Schedule1F1B"
    assert len(row["step_s"]) == 1 and row["step_s"][0] > 0
    assert row["sleep_counts"] == [[4, 4, 4]] * S  # one stage per rank, M tasks of each kind
    assert 0 < row["efficiency"] <= 1.05


@pytest.mark.timeout(240)
def test_scale_harness_one_config_each_side(tmp_path: Path) -> None:
    run = run_one(spec="multimodal:0.3:3", ranks=S, seed=1, task_ms=1.0, warmup=WARMUP,
                  steps=STEPS, aioready_configs=[PAIR[0], DEFAULT], torch_configs=[PAIR[1]],
                  workdir=tmp_path, model_args=[*MODEL, "--dtype", "float64"])
    rows = {r["name"]: r for r in simulated(run)["records"]}
    assert set(rows) == {*PAIR, DEFAULT}, rows
    assert not [r["error"] for r in rows.values() if "error" in r]
    groups, M = 2 * S, 4 * S
    trace = read_trace(run["trace"], placement=Placement(groups, groups, "linear"))
    a, t, d = rows[PAIR[0]], rows[PAIR[1]], rows[DEFAULT]
    for row in (a, t, d):
        assert len(row["step_s"]) == STEPS
        assert all(math.isfinite(x) and x > 0 for x in row["step_s"]), row["step_s"]
        shape = RunShape(Placement(row["num_stages"], S, row["style"]), groups,
                         row["split_backward"])
        for rank in range(S):
            n = M * STEPS * len(shape.placement.stages_of(rank))
            assert row["sleep_counts"][rank] == [n, n, n], (row["name"], rank)
            want = sum(float(stage_seconds(trace.table(WARMUP + i), shape, None)[s].sum())
                       for i in range(STEPS) for s in shape.placement.stages_of(rank))
            assert sum(row["slept_s"][rank]) == pytest.approx(want, rel=1e-9)
        assert all(0 < p <= M for p in row["peak_activations"]), row["peak_activations"]
        assert len(row["sim_ms"]) == STEPS and all(x > 0 for x in row["sim_ms"])
    assert a["sleep_counts"] == t["sleep_counts"] == d["sleep_counts"]  # the same tasks
    for row in (a, d):
        assert abs(row["loss"] - t["loss"]) <= 1e-10
        assert row["grad_sq"] == pytest.approx(t["grad_sq"], rel=1e-9)
    # the default: `aioready train`'s start on 2 stages per rank, within 1F1B's busiest rank
    assert d["num_stages"] == 2 * S and d["style"] in ("interleaved", "v")
    assert d["start"]["budget"] == 2 * S and d["chosen"]  # ZBV's activations, one chunk each
    assert d["start"]["budget_unit"] == "activations"
    assert max(d["peak_activations"]) <= d["start"]["budget"] / 2  # injector: linear units
    assert t["sim_hint"] == "zbv"
    block = summarize([run])[0]
    assert block["torch_best"]["name"] == PAIR[1]
    assert {r["name"] for r in block["rows"]} == {*PAIR, DEFAULT}
    assert block["default"]["name"] == DEFAULT
    # the most any schedule could gain: any placement's bound is below the measured ones'
    assert block["bound"]["any_ms"] <= block["bound"]["ms"] + 1e-9
    assert min(r["median_ms"] for r in block["rows"]) >= block["bound"]["any_ms"]
    assert block["ceiling_any"] >= block["ceiling"] > 0
    assert all(math.isfinite(r["overhead_share"]) and math.isfinite(r["cpu_us_per_task"])
               for r in block["rows"])
