"""hint="auto" in a Pipeline chooses the microbatch order too (runtime/auto_order.py): from the
costs it records with each step, by the simulator's ranking only, exactly (gradients and loss),
identically on every rank, and from the CLI (`--microbatch-order`)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from conftest import requires_mpi, run_mpi

import aioready
from aioready.cli import main
from aioready.cli.trainer import TrainConfig
from aioready.clock import run_virtual
from aioready.devices.sim import SimDevice
from aioready.errors import ConfigError
from aioready.placement import Placement
from aioready.runtime.autotune import AutoHint
from aioready.runtime.choosers import Choice
from aioready.schedulers.order import ORDERS
from aioready.sim.traces import Trace
from aioready.sim.tune import SimChooser
from aioready.testing.helpers import make_mlp_stages, max_grad_diff, mse_loss, reference_step

torch.set_num_threads(1)

S, M = 4, 16
COST = [3.0 if m in (0, 3, 4, 9, 13) else 1.0 for m in range(M)]  # heavy: 3x rows, 3x time
BASE = (1.0, 2.0, 0.0)  # F, B, W per unit of cost


def _run(steps: int, order: str | None, chooser: SimChooser
         ) -> tuple[aioready.Pipeline, list[tuple[float, float, float]]]:
    """`steps` steps of an auto pipeline whose microbatches' durations follow them from slot
    to slot; per step (virtual step time, loss error, gradient error) against the unsplit
    model."""
    stages = make_mlp_stages(S, width=8, hidden=8, blocks_per_stage=1)
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(int(c), 8, generator=gen, dtype=torch.float64) for c in COST]
    ys = [torch.randn(int(c), 8, generator=gen, dtype=torch.float64) for c in COST]
    pipe: aioready.Pipeline | None = None

    def duration(info: object) -> float:
        slots = pipe.microbatch_slots  # type: ignore[union-attr]
        mb = info.microbatch if slots is None else slots[info.microbatch]  # type: ignore[attr-defined]
        return BASE[int(info.kind)] * COST[mb]  # type: ignore[attr-defined]

    async def go() -> list[tuple[float, float, float]]:
        nonlocal pipe
        pipe = aioready.Pipeline(stages, mse_loss, microbatches=M, cap="2x",
                                 hint=AutoHint(retune_every=1, chooser=chooser),
                                 microbatch_order=order,
                                 device=SimDevice(duration, run_compute=True))
        out = []
        for _ in range(steps):
            for s in stages:
                s.zero_grad(set_to_none=True)
            loss = await pipe.step(xs, ys)  # costs: the inputs' bytes, 3x for a heavy one
            ref_loss, ref = reference_step(stages, mse_loss, xs, ys)
            out.append((pipe.last_step.step_time, abs(float(loss) - float(ref_loss)),
                        max_grad_diff(stages, ref)))
        return out

    times = run_virtual(go())
    assert pipe is not None
    pipe.close()
    return pipe, times


def _simulated_choice() -> aioready.SimResult:
    """The simulator's own ranking of these durations, from a trace built by hand (caller's
    order, the costs as sizes), not from anything the pipeline measured."""
    table = np.zeros((1, S, M, 3))
    for m, c in enumerate(COST):
        table[0, :, m, :] = [b * c for b in BASE]
    trace = Trace(table, placement=Placement.linear(S), split_backward=False,
                  sizes=np.array([COST]))
    return aioready.simulate(stages=S, microbatches=M, hint="auto:1f1b", trace=trace, cap="2x")


def test_auto_pipeline_chooses_the_order_the_simulator_ranks_first() -> None:
    chooser = SimChooser()
    pipe, steps = _run(3, None, chooser)
    sim = _simulated_choice()
    assert sim.order != "given"  # the case: a cost order wins on these durations
    choices = [c for _, c in pipe.auto.choices]
    assert [s for s, _ in pipe.auto.choices] == [1, 2, 3]
    # the same choice as the simulator's, after step 1 (given order) and after steps run in
    # the chosen order (their spans renumbered back to the caller's microbatches)
    assert all(c == sim.tuning.choice for c in choices), (choices, sim.tuning.choice)
    assert pipe.microbatch_order == sim.order and pipe.microbatch_slots is not None
    rows = chooser.last.rows
    assert {r.candidate.order for r in rows} == set(ORDERS)
    best = chooser.last.best
    assert all(r.step_time > best.step_time for r in rows if r.candidate.order == "given")
    assert f"chosen: {best.candidate.label}" in choices[-1].table
    assert re.search(r"^\s+hint\s+order\s+mode", choices[-1].table, re.M)  # the order column
    # exact: the reordered steps take the simulated time, with the unsplit model's numbers
    assert steps[0][0] > steps[1][0] == steps[2][0] == best.step_time == sim.step_time
    assert all(loss <= 1e-10 and grad <= 1e-10 for _, loss, grad in steps)


@pytest.mark.parametrize("order", ["given", "ascending"])
def test_a_fixed_order_is_kept(order: str) -> None:
    """microbatch_order= given explicitly: auto chooses the schedule, never the order."""
    chooser = SimChooser()
    pipe, steps = _run(2, order, chooser)
    assert pipe.microbatch_order == order
    assert [c.order for _, c in pipe.auto.choices] == [order, order]
    assert {r.candidate.order for r in chooser.last.rows} == {"given"}  # as run: no costs
    assert all(loss <= 1e-10 and grad <= 1e-10 for _, loss, grad in steps)


def test_equal_costs_add_no_candidates() -> None:
    stages = make_mlp_stages(2, seed=5)
    xs = [torch.randn(3, 16, dtype=torch.float64) for _ in range(4)]
    chooser = SimChooser()

    async def go() -> aioready.Pipeline:
        pipe = aioready.Pipeline(stages, mse_loss, microbatches=4, cap="2x",
                                 hint=AutoHint(chooser=chooser), device=SimDevice(
                                     lambda info: 1.0 + info.stage, run_compute=True))
        await pipe.step(xs, xs)
        return pipe

    pipe = run_virtual(go())
    pipe.close()
    assert {r.candidate.order for r in chooser.last.rows} == {"given"}
    assert pipe.microbatch_order == "given" and "order" not in chooser.last.table().split()


def test_choice_crosses_ranks_with_its_order() -> None:
    c = Choice("zb-h1", "linear", "ready", (4, 3, 2), "greedy", order="descending")
    values = c.encode()
    assert len(values) == Choice.width(3) and Choice.decode(values) == c


@requires_mpi
@pytest.mark.timeout(200)
def test_every_rank_runs_rank_0s_order_over_mpi() -> None:
    """Agreeing costs: one order, rank 0's, on every rank, exact. Costs that differ between
    ranks: a ConfigError on every rank naming the rank and microbatch, not a silent mismatch.
    A rank without costs: the given order everywhere."""
    proc = run_mpi(2, ["tests/mpi_scripts/auto_order.py"], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [line for line in proc.stdout.splitlines() if line.startswith("RESULT agree ")]
    assert len(results) == 2, proc.stdout
    choices = {re.search(r"choices=(\S+)", line).group(1) for line in results}
    assert len(choices) == 1, results  # one decision, every rank, order included
    [plan] = choices
    assert [c.split(":")[0] for c in plan.split("|")] == ["1", "2", "3"]
    assert all(c.split(":")[-1] in ORDERS for c in plan.split("|"))
    [root] = [line for line in results if "rank=0 " in line]
    assert "orders=ascending,descending,given,middle " in root  # the costs arrived, agreed
    assert f"best={plan.split('|')[-1].split(':')[-1]} " in root  # ran what it simulated best
    for line in results:
        assert float(re.search(r"grad_diff=(\S+)", line).group(1)) <= 1e-10
        assert float(re.search(r"loss_diff=(\S+)", line).group(1)) <= 1e-10
    differ = sorted(line for line in proc.stdout.splitlines()
                    if line.startswith("RESULT differ "))
    assert len(differ) == 2 and all("error=ConfigError" in line for line in differ), differ
    assert "rank 1, step 0: hint='auto' orders microbatches by their costs" in differ[0]
    assert "expected costs[1] = 1.0 (rank 0's), got 2.0" in differ[0]
    assert "rank 0 found no schedule to switch to" in differ[1]
    partial = [line for line in proc.stdout.splitlines() if line.startswith("RESULT partial ")]
    assert len(partial) == 2, proc.stdout
    plans = {re.search(r"choices=(\S+)", line).group(1) for line in partial}
    assert len(plans) == 1 and all(c.endswith(":given") for c in plans.pop().split("|"))
    assert any(" orders=given best=given " in line for line in partial), partial


def test_cli_microbatch_order(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--stages", "4", "--microbatches", "8", "--hint", "1f1b",
                 "--jitter", "multimodal:0.3:3", "--seed", "1", "--cap", "2x",
                 "--microbatch-order", "descending"]) == 0
    assert "microbatch order: descending" in capsys.readouterr().out
    for argv in (["simulate", "--stages", "4", "--microbatches", "8"],
                 ["train", "--steps", "1"]):
        with pytest.raises(SystemExit) as exc:
            main([*argv, "--microbatch-order", "random"])
        assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--microbatch-order: invalid choice: 'random'" in err
    with pytest.raises(ConfigError, match="microbatch_order"):
        TrainConfig(microbatch_order="random")


@pytest.mark.parametrize("order", [None, "ascending"])
def test_cli_train_with_a_microbatch_order(order: str | None,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """train --hint auto lets the chooser pick (equal-sized microbatches: the given order);
    --microbatch-order fixes it."""
    extra = [] if order is None else ["--microbatch-order", order]
    assert main(["train", "--stages", "2", "--microbatches", "4", "--steps", "2", "--hint",
                 "auto", "--cap", "2x", "--sleep-only", "--task-ms", "2", "--jitter",
                 "multimodal:0.5:2", "--no-progress", *extra]) == 0
    out = capsys.readouterr().out
    [line] = re.findall(r"^hint=auto: \S+ .*from step 1.*$", out, re.M)
    label = line.split()[1]
    assert "+" not in label if order is None else label.endswith("+ascending")


def test_cli_train_sized_microbatches_let_auto_choose_an_order(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Sequence lengths that follow the multimodal sizes: the input bytes differ, so the
    chooser simulates every order, and the trained step runs the one it printed."""
    assert main(["train", "--stages", "2", "--microbatches", "8", "--steps", "2", "--hint",
                 "auto", "--cap", "2x", "--sleep-only", "--task-ms", "1", "--jitter",
                 "multimodal:0.5:3", "--seed", "1", "--sized-microbatches",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^\s+hint\s+order\s+mode", out, re.M)  # orders were candidates
    [line] = re.findall(r"^hint=auto: \S+ .*from step 1.*$", out, re.M)
    chosen = re.search(r"chosen: (\S+) ", out).group(1)
    assert line.split()[1] == chosen  # the label it ran, with its order where not given
    with pytest.raises(ConfigError, match="sized_microbatches"):
        TrainConfig(sized_microbatches=True)
    assert main(["train", "--stages", "2", "--microbatches", "4", "--steps", "1", "--jitter",
                 "lognormal:0.5", "--sized-microbatches", "--sleep-only", "--no-progress"]) != 0
    assert "the jitter model gives microbatches no sizes" in capsys.readouterr().err
