"""The end-to-end benchmark harness at its smallest size, both sides, so it cannot silently rot.

aioready (MPITransport) and torch.distributed.pipelining (gloo) run, one after the other in the
same mpiexec-launched processes (one start-up; the benchmark itself uses torchrun), the same
float64 model on the same microbatches with the same injected durations. Checked: finite step
times; every rank slept exactly what the trace gives its stages, on both sides, and the same on
both; the same loss and gradient norm on both sides (an apples-to-apples check of the comparison).
No timing is asserted.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from conftest import requires_mpi

from aioready.placement import Placement
from aioready.sim.traces import read_trace
from bench.e2e import run_scenario, summarize
from bench.e2e_worker import RunShape, parse_config, stage_seconds

pytestmark = [pytest.mark.mpi, requires_mpi]

M, WARMUP, STEPS, GROUPS, RANKS = 4, 1, 1, 8, 4
PAIRS = {"1f1b/ready@6": "Schedule1F1B", "zbv/ready": "ScheduleZBVZeroBubble"}


@pytest.mark.timeout(400)
def test_e2e_harness_smallest(tmp_path: Path) -> None:
    spec = "lognormal:0.5+straggler:1:1.5"
    run = run_scenario(spec, workdir=tmp_path, ranks=RANKS, groups=GROUPS, microbatches=M,
                       task_ms=2.0, warmup=WARMUP, steps=STEPS,
                       aioready_configs=list(PAIRS), torch_configs=list(PAIRS.values()),
                       model_args=["--dtype", "float64", "--dim", "16", "--seq", "8",
                                   "--vocab", "64"], timeout=350, one_launch=True)
    summary = summarize(run, groups=GROUPS, microbatches=M, warmup=WARMUP, ranks=RANKS)
    rows = {r["name"]: r for r in summary["rows"]}
    assert set(rows) == set(PAIRS) | set(PAIRS.values())
    trace = read_trace(run["trace"], placement=Placement(GROUPS, GROUPS, "linear"))
    for name, row in rows.items():
        assert len(row["step_s"]) == STEPS
        assert all(math.isfinite(t) and t > 0 for t in row["step_s"]), row["step_s"]
        assert 0 < row["efficiency"] <= 1.05, (name, row["efficiency"])
        assert len(row["cpu_s_per_step"]) == RANKS and all(
            math.isfinite(c) and c > 0 for c in row["cpu_s_per_step"]), name
        # the model compute is measured on both sides, inside each rank's CPU (e2e_compute.py)
        assert len(row["compute_s_per_step"]) == RANKS and all(
            0 < m < c for m, c in zip(row["compute_s_per_step"], row["cpu_s_per_step"])), name
        shape = RunShape(Placement(row["num_stages"], RANKS, row["style"]), GROUPS,
                         row["split_backward"])
        for rank in range(RANKS):  # what each rank slept is what the trace gives its stages
            want = [0.0, 0.0, 0.0]
            for step in range(WARMUP, WARMUP + STEPS):
                table = stage_seconds(trace.table(step), shape, (1, 1.5))
                for s in shape.placement.stages_of(rank):
                    for k in range(3):
                        want[k] += float(table[s, :, k].sum())
            assert row["slept_s"][rank] == pytest.approx(want, rel=1e-9, abs=1e-12), (name, rank)
            n = M * STEPS * len(shape.placement.stages_of(rank))
            assert row["sleep_counts"][rank] == [n, n, n], (name, rank)
    for ours, theirs in PAIRS.items():
        a, t = rows[ours], rows[theirs]
        assert (a["style"], a["num_stages"], a["split_backward"]) == (
            t["style"], t["num_stages"], t["split_backward"])
        flat = [x for per_rank in a["slept_s"] for x in per_rank]
        assert flat == pytest.approx([x for per_rank in t["slept_s"] for x in per_rank],
                                     rel=1e-12, abs=1e-15), ours
        assert abs(a["loss"] - t["loss"]) <= 1e-10, (ours, a["loss"], t["loss"])
        assert a["grad_sq"] == pytest.approx(t["grad_sq"], rel=1e-9), ours
    assert summary["speedup_vs_torch"] is not None and math.isfinite(summary["speedup_vs_torch"])


def test_config_names_carry_an_optional_cap() -> None:
    assert parse_config("bfw/ready@12") == ("bfw", "ready", "reserve", 12)
    assert parse_config("zbv/strict") == ("zbv", "strict", "reserve", None)
    assert parse_config("1f1b/ready:greedy@2x") == ("1f1b", "ready", "greedy", "2x")
    assert parse_config("1f1b/ready:light") == ("1f1b", "ready", "light", None)
    assert parse_config("auto/ready@1.5x") == ("auto", "ready", "reserve", "1.5x")
    for bad in ("zbv/fast", "bfw/ready@x", "bfw", "bfw/ready:eager", "bfw/ready@2y"):
        with pytest.raises(SystemExit, match="hint/strict"):
            parse_config(bad)


def test_config_names_carry_a_byte_budget() -> None:
    from bench.e2e_worker import byte_budget
    assert parse_config("auto/ready@mem2x") == ("auto", "ready", "reserve", "mem2x")
    assert parse_config("1f1b/ready:greedy@mem1.5x") == ("1f1b", "ready", "greedy", "mem1.5x")
    assert byte_budget("mem2x") == (None, "2x")
    assert byte_budget("2x") == ("2x", None) and byte_budget(6) == (6, None)
    for bad in ("auto/ready@mem", "auto/ready@mem2", "auto/ready@memx", "auto/ready@mem2y",
                "auto/ready@2xmem"):
        with pytest.raises(SystemExit, match="memNx"):
            parse_config(bad)


@pytest.mark.timeout(300)
def test_e2e_auto_within_twice_the_bytes(tmp_path: Path) -> None:
    """hint="auto" within twice the start hint's measured bytes on real MPI ranks: it switched
    after its first step, every rank held at most its byte budget in the measured steps, and
    the loss and gradients are those of strict 1F1B on the same model and data."""
    configs = ["1f1b/strict", "auto/ready@mem2x"]
    run = run_scenario("multimodal:0.3:3", workdir=tmp_path, ranks=RANKS, groups=GROUPS,
                       microbatches=8, task_ms=2.0, warmup=1, steps=1,
                       aioready_configs=configs, torch_configs=[],
                       model_args=["--dtype", "float64", "--dim", "16", "--seq", "8",
                                   "--vocab", "64"], timeout=250)
    rows = {r["name"]: r for r in run["records"]}
    assert set(rows) == set(configs)
    auto, strict = rows["auto/ready@mem2x"], rows["1f1b/strict"]
    assert auto.get("chosen"), auto
    for row in (auto, strict):  # the launch has a byte budget: every aioready row measures
        assert len(row["peak_activation_bytes"]) == RANKS
        assert all(b is not None and b > 0 for b in row["peak_activation_bytes"]), row["name"]
    assert strict["memory_bytes"] == [None] * RANKS
    budgets = auto["memory_bytes"]
    assert all(b is not None and b > 0 for b in budgets), budgets
    for rank, (held, budget) in enumerate(zip(auto["peak_activation_bytes"], budgets)):
        assert held <= budget, (rank, held, budget, auto["chosen"])
    assert abs(auto["loss"] - strict["loss"]) <= 1e-10, (auto["loss"], strict["loss"])
    assert auto["grad_sq"] == pytest.approx(strict["grad_sq"], rel=1e-9)
