"""hint="auto": the tuner's choice against brute force, budgets, its errors, simulate(hint="auto"),
a Pipeline that switches between steps (exact gradients, the predicted step time), the CLI, MPI."""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass
from itertools import cycle
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import requires_mpi, run_mpi

import aioready
from aioready.caps import resolve_caps
from aioready.cli import main
from aioready.clock import run_virtual
from aioready.devices.sim import SimDevice
from aioready.errors import ConfigError
from aioready.placement import Placement
from aioready.runtime.autotune import AutoHint, AutoTuning
from aioready.runtime.choosers import Choice
from aioready.runtime.rank import POLICIES
from aioready.sim.budget import Limit
from aioready.sim.choice import FACTORS, WHOLE, candidate_hints, candidates, choose_schedule
from aioready.sim.traces import Trace, write_trace
from aioready.sim.tune import SimChooser, tune
from aioready.sim.variability import JitterModel
from aioready.testing.helpers import make_mlp_stages, max_grad_diff, mse_loss, reference_step


def lognormal_trace(seed: int = 1, stages: int = 4, microbatches: int = 8) -> Trace:
    """A trace where ready bfw at 2x its own peak is the unique fastest (found by search)."""
    place = Placement.linear(stages)
    model = JitterModel("lognormal:0.5", seed=seed, placement=place,
                        num_microbatches=microbatches, split_backward=True)
    return Trace(np.stack([model.table(0)]), placement=place, split_backward=True,
                 source="lognormal seed 1")


def test_the_tuner_picks_the_brute_force_best() -> None:
    trace = lognormal_trace()
    tuning = tune(trace, budget="4x")  # 4 x 1f1b's peak is bfw's 2x
    assert tuning.limit == (16, 12, 8, 4)
    best = tuning.best.candidate.choice
    assert (best.hint, best.mode, tuning.best.candidate.factor) == ("bfw", "ready", 2.0)
    brute = {}
    for order in candidate_hints(num_stages=4, num_ranks=4, num_microbatches=8,
                                 split_backward=True):
        for mode, factor in [("strict", 1.0), ("ready", 1.0), ("ready", 1.5), ("ready", 2.0),
                             ("ready", None)]:  # None: the whole budget on every rank
            cap = list(tuning.limit) if factor is None else [
                min(c, m) for c, m in zip(resolve_caps(f"{factor:g}x", order), tuning.limit)]
            if mode == "strict" and any(c < order.peak(r) for r, c in enumerate(cap)):
                continue  # strict cannot run below its own peak
            for policy in ("reserve",) if mode == "strict" else POLICIES:
                result = aioready.simulate(stages=4, microbatches=8, hint=order.name, mode=mode,
                                           trace=trace, cap=cap, split_backward=True,
                                           policy=policy)
                brute[(order.name, mode, tuple(cap), policy)] = result.step_time
    assert min(brute.values()) == tuning.best.step_time
    assert brute[(best.hint, best.mode, best.cap, best.policy)] == tuning.best.step_time
    assert sorted(brute.values())[1] > tuning.best.step_time  # unique: no tie decided it
    rows = {(r.candidate.choice.hint, r.candidate.choice.mode, r.candidate.choice.cap,
             r.candidate.choice.policy) for r in tuning.rows}
    for (name, mode, cap, policy), t in brute.items():  # every distinct candidate simulated
        if (name, mode, cap, policy) not in rows:  # reserve that cannot hold runs greedy
            assert (mode, policy) == ("ready", "reserve") and (name, mode, cap, "greedy") in rows
            assert t == brute[(name, mode, cap, "greedy")]
    assert "*" in tuning.table() and "bfw" in tuning.table().splitlines()[1]


def test_the_whole_budget_is_a_candidate() -> None:
    """Under 2S on every rank, 2x of 1F1B's or BFW's own peak leaves the late ranks' memory
    unused; the whole budget is a candidate of every hint (docs/policy_measurements.md "The whole
    budget").
    Where 2x already reaches the budget everywhere (the per-rank "2x"), nothing is added."""
    orders = candidate_hints(num_stages=4, num_ranks=4, num_microbatches=16, split_backward=True)
    uniform = {(c.choice.hint, c.choice.mode, c.choice.policy, c.choice.cap): c.factor
               for _, c in candidates(orders, Limit((8,) * 4))}
    for hint, factor in (("1f1b", 8.0), ("bfw", 4.0)):  # last rank's peak: 1 and 2
        for policy in POLICIES:
            assert uniform[(hint, "ready", policy, (8, 8, 8, 8))] == factor
    assert all(cap[-1] < 8 for (h, _, _, cap), f in uniform.items() if h == "1f1b" and f <= 2)
    before = candidates(orders, Limit((8, 6, 4, 2)), factors=FACTORS[:-1])
    assert WHOLE not in FACTORS[:-1]
    assert ({c.choice for _, c in candidates(orders, Limit((8, 6, 4, 2)))}
            == {c.choice for _, c in before})
    held = Limit((16,) * 4, held=True)
    bfw = next(o for o in orders if o.name == "bfw")
    assert held.gate(bfw, "ready", held.whole(bfw)) == ((16,) * 4, None)


def test_the_budget_is_respected() -> None:
    trace = lognormal_trace()
    budget = [5, 4, 3, 1]
    tuning = tune(trace, budget=budget)
    assert tuning.limit == tuple(budget)
    for row in tuning.rows:
        assert all(c <= b for c, b in zip(row.candidate.choice.cap, budget))
        assert all(p <= b for p, b in zip(row.peak_in_flight, budget))
    roomy = tune(trace, budget="4x")
    assert tuning.best.step_time > roomy.best.step_time  # the budget cost something


def test_relative_budget_is_measured_against_the_start_hint() -> None:
    tuning = tune(lognormal_trace(), budget="1x")  # 1f1b's own peak per rank
    assert tuning.limit == (4, 3, 2, 1)
    assert tune(lognormal_trace()).limit == (4, 3, 2, 1)  # no budget: what 1f1b would hold
    assert all(p <= c for p, c in zip(tuning.best.peak_in_flight, (4, 3, 2, 1)))


def test_nothing_fits_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="no candidate schedule fits the budget") as info:
        tune(lognormal_trace(), budget=1, modes=("strict",))
    assert "allow mode 'ready'" in str(info.value)


@dataclass
class FakeResult:
    step_time: float
    efficiency: float
    peak_in_flight: tuple[int, ...]


def test_a_candidate_over_budget_is_never_chosen() -> None:
    """A faster candidate whose simulated peak exceeds the budget loses to a slower one."""
    orders = candidate_hints(num_stages=2, num_ranks=2, num_microbatches=4,
                             split_backward=False)

    def run(order, mode, caps, policy="reserve", bound=None):  # type: ignore[no-untyped-def]
        over = order.name == "gpipe"
        return FakeResult(1.0 if over else 2.0 + len(order.name), 0.5,
                          (9, 9) if over else caps)

    tuning = choose_schedule(run, orders, budget=4)
    assert tuning.best.candidate.choice.hint != "gpipe"
    # strict, and ready under each policy (its ready caps clip to the same budget), but
    # `drain`: unsplit, it decides as greedy, so it is not a candidate (sim/choice.py)
    assert [r.fits for r in tuning.rows
            if r.candidate.choice.hint == "gpipe"] == [False] * len(POLICIES)
    assert "drain" not in {r.candidate.choice.policy for r in tuning.rows}
    assert "- gpipe" in tuning.table()
    with pytest.raises(ConfigError, match="no candidate"):
        choose_schedule(run, [o for o in orders if o.name == "gpipe"], budget=4)


def test_simulate_auto_is_deterministic_and_names_its_choice() -> None:
    kw = dict(stages=4, microbatches=8, hint="auto", jitter="lognormal:0.5", seed=1,
              split_backward=True, cap="4x")
    a, b = aioready.simulate(**kw), aioready.simulate(**kw)
    assert a.to_json() == b.to_json()
    assert a.hint == "auto:bfw" and a.tuning.table() == b.tuning.table()
    assert a.step_time == a.tuning.best.step_time == min(r.step_time for r in a.tuning.rows)
    capped = aioready.simulate(**{**kw, "cap": "1x"})
    assert max(capped.peak_in_flight) <= 4 and capped.hint.startswith("auto:")


def test_simulate_auto_keeps_a_named_placement() -> None:
    result = aioready.simulate(stages=8, microbatches=8, ranks=4, hint="auto:zbv",
                               split_backward=True, jitter="lognormal:0.5")
    assert {r.candidate.choice.placement for r in result.tuning.rows} == {"v"}
    free = aioready.simulate(stages=8, microbatches=8, ranks=4, hint="auto",
                             split_backward=True, jitter="lognormal:0.5")
    assert {r.candidate.choice.placement for r in free.tuning.rows} == {"v", "interleaved"}


def test_choice_crosses_ranks_as_integers() -> None:
    choice = Choice("bfw", "v", "ready", (8, 7, 6, 5), table="t")
    values = choice.encode()
    assert all(isinstance(v, int) for v in values)
    assert Choice.decode(values) == choice and choice.label == "bfw@v"


def test_when_retuning_is_due() -> None:
    every2 = AutoTuning(AutoHint(retune_every=2, window=1, chooser=SimChooser()), None)
    assert [s for s in range(8) if every2.due(s)] == [1, 3, 5, 7]
    once = AutoTuning(AutoHint(retune_every=0, window=2, chooser=SimChooser()), None)
    assert [s for s in range(8) if once.due(s)] == [2]
    with pytest.raises(ConfigError, match="retune_every"):
        AutoHint(retune_every=-1)


def slow_every_third(info) -> float:  # type: ignore[no-untyped-def]
    return 3.0 if info.microbatch % 3 == 0 else 1.0


def test_pipeline_switches_to_the_predicted_schedule_on_the_virtual_clock() -> None:
    chooser = SimChooser()

    async def main() -> list[float]:
        pipe = aioready.Pipeline([None] * 4, None, microbatches=8, hint=AutoHint(
            chooser=chooser), split_backward=True, cap="2x",
            device=SimDevice(slow_every_third, run_compute=False))
        times = []
        for _ in range(3):
            await pipe.step()
            times.append(pipe.last_step.step_time)
        assert pipe.hint.name != "1f1b" and len(pipe.auto.choices) == 1
        assert [rt.cap for rt in pipe.runtimes] == list(chooser.last.best.candidate.choice.cap)
        return times

    times = run_virtual(main())
    assert chooser.last is not None
    assert times[1] == times[2] == chooser.last.best.step_time  # exact for these durations
    assert times[1] < times[0]


class Cycling:
    """A chooser that walks a fixed list of schedules, so every switch is exercised."""

    def __init__(self, choices: list[Choice]) -> None:
        self.choices = cycle(choices)
        self.calls = 0

    def choose(self, reports, *, hint, budget, unit_ms):  # type: ignore[no-untyped-def]
        self.calls += 1
        assert len(reports) == 1 and len(reports[0].spans) == hint.placement.num_stages * 4 * 3
        return next(self.choices)


async def test_gradients_stay_exact_across_switches() -> None:
    S, M = 4, 4
    stages = make_mlp_stages(S, seed=11)
    plan = [Choice("bfw", "linear", "ready", (8, 6, 4, 2)),
            Choice("zb-h1", "linear", "strict", (4, 4, 4, 4)),
            Choice("1f1b", "linear", "ready", (1, 1, 1, 1))]
    chooser = Cycling(plan)
    pipe = aioready.Pipeline(stages, mse_loss, microbatches=M, split_backward=True,
                             hint=AutoHint(retune_every=1, chooser=chooser))
    seen = []
    gen = torch.Generator().manual_seed(3)
    try:
        for _ in range(4):
            xs = [torch.randn(3, 16, generator=gen, dtype=torch.float64) for _ in range(M)]
            ys = [torch.randn(3, 16, generator=gen, dtype=torch.float64) for _ in range(M)]
            for s in stages:
                s.zero_grad(set_to_none=True)
            seen.append((pipe.hint.name, pipe.mode, tuple(rt.cap for rt in pipe.runtimes)))
            loss = await pipe.step(xs, ys)
            ref_loss, ref = reference_step(stages, mse_loss, xs, ys)
            assert abs(float(loss) - float(ref_loss)) <= 1e-10
            assert max_grad_diff(stages, ref) <= 1e-10
    finally:
        pipe.close()
    assert seen[0][0] == "1f1b"
    assert seen[1:] == [(c.hint, c.mode, c.cap) for c in plan]
    assert chooser.calls == 4


async def test_pipeline_auto_with_the_default_chooser_trains_exactly() -> None:
    stages = make_mlp_stages(2, seed=5)
    gen = torch.Generator().manual_seed(4)
    xs = [torch.randn(3, 16, generator=gen, dtype=torch.float64) for _ in range(4)]
    ys = [torch.randn(3, 16, generator=gen, dtype=torch.float64) for _ in range(4)]
    pipe = aioready.Pipeline(stages, mse_loss, microbatches=4, hint="auto", cap="2x")
    try:
        for _ in range(2):
            for s in stages:
                s.zero_grad(set_to_none=True)
            await pipe.step(xs, ys)
    finally:
        pipe.close()
    _, ref = reference_step(stages, mse_loss, xs, ys)
    assert max_grad_diff(stages, ref) <= 1e-10
    [(step, choice)] = pipe.auto.choices
    assert step == 1 and "budget per rank: [4, 2]" in choice.table
    assert all(c <= b for c, b in zip(choice.cap, (4, 2)))


async def test_the_loop_keeps_serving_while_a_real_pipeline_chooses() -> None:
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.001)

    class Slow(Cycling):
        def choose(self, reports, *, hint, budget, unit_ms):  # type: ignore[no-untyped-def]
            self.before = ticks
            time.sleep(0.2)  # a long simulation, off the loop thread
            self.after = ticks
            return super().choose(reports, hint=hint, budget=budget, unit_ms=unit_ms)

    chooser = Slow([Choice("1f1b", "linear", "ready", (4, 3, 2, 1))])
    pipe = aioready.Pipeline([None] * 4, None, microbatches=4, split_backward=True,
                             hint=AutoHint(chooser=chooser), device="inline")
    task = asyncio.create_task(ticker())
    try:
        await pipe.step()
    finally:
        task.cancel()
        pipe.close()
    assert chooser.calls == 1 and chooser.after > chooser.before


async def test_a_choice_that_cannot_run_leaves_the_pipeline_as_it_was() -> None:
    chooser = Cycling([Choice("zb-h1", "linear", "strict", (4, 4, 4, 2))])
    pipe = aioready.Pipeline([None] * 4, None, microbatches=4, split_backward=True,
                             hint=AutoHint(chooser=chooser), device="inline")
    with pytest.raises(ConfigError, match="strict mode cannot run hint 'zb-h1'"):
        await pipe.step()
    assert {(rt.hint.name, rt.mode) for rt in pipe.runtimes} == {("1f1b", "ready")}
    assert [rt.cap for rt in pipe.runtimes] == [4, 3, 2, 1]
    pipe.close()


async def test_an_auto_pipeline_resumes_from_a_checkpoint_of_a_switched_hint() -> None:
    plan = [Choice("bfw", "linear", "ready", (4, 2))]
    stages = make_mlp_stages(2, seed=2)
    xs = [torch.zeros(3, 16, dtype=torch.float64)] * 4
    pipe = aioready.Pipeline(stages, mse_loss, microbatches=4, split_backward=True,
                             hint=AutoHint(chooser=Cycling(plan)))
    await pipe.step(xs, xs)
    state = pipe.state_dict()
    pipe.close()
    assert pipe.hint.name == "bfw"
    again = aioready.Pipeline(make_mlp_stages(2, seed=3), mse_loss, microbatches=4,
                              split_backward=True, hint=AutoHint(chooser=Cycling(plan)))
    assert again.load_state_dict(state) == 1
    again.close()
    fixed = aioready.Pipeline(make_mlp_stages(2, seed=3), mse_loss, microbatches=4,
                              split_backward=True, hint="1f1b")
    with pytest.raises(aioready.CheckpointError, match="hint"):
        fixed.load_state_dict(state)
    fixed.close()


def test_auto_needs_a_placement_when_ranks_hold_several_stages() -> None:
    with pytest.raises(ConfigError, match="auto:zbv"):
        AutoTuning.for_pipeline("auto", budget=None, num_stages=8, world_size=4,
                                split_backward=True)
    _, start = AutoTuning.for_pipeline("auto:zbv", budget=None, num_stages=8, world_size=4,
                                       split_backward=True)
    assert start == "zbv"


def test_cli_tune_prints_the_table_and_the_command(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.csv"
    write_trace(path, lognormal_trace())
    assert main(["tune", "--trace", str(path), "--budget", "2x", "--json",
                 str(tmp_path / "out.json")]) == 0
    out = capsys.readouterr().out
    # on this trace zb-h1 under `light` at 1.5x its own peak wins; bfw (whose own peak is
    # 1f1b's 2x) under greedy and under the reservation are rows below
    assert re.search(r"^\* zb-h1 +ready/light +1.5x", out, re.M)
    assert re.search(r"^  bfw +ready/greedy +1x", out, re.M)
    assert re.search(r"^  bfw +ready +1x", out, re.M)  # the reserving policy
    assert "budget per rank: [8, 6, 4, 2]; chosen: zb-h1 ready/light at 1.5x" in out
    assert (f"run it: aioready simulate --stages 4 --microbatches 8 --trace {path} --hint zb-h1 "
            "--mode ready --policy light --cap 6,6,4,2 --split-backward") in out
    assert main(["tune", "--trace", str(path), "--budget", "1", "--modes", "strict"]) == 1
    assert "no candidate schedule fits" in capsys.readouterr().err


def test_cli_simulate_auto_compares_with_strict_start(capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    assert main(["simulate", "--stages", "4", "--microbatches", "8", "--split-backward",
                 "--jitter", "lognormal:0.5", "--seed", "1", "--hint", "auto", "--cap", "4x",
                 "--compare"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("1f1b strict:") and "auto:bfw ready:" in out
    speedup = float(re.search(r"speedup of ready over strict: ([0-9.]+)x", out).group(1))
    assert speedup > 1.0


@requires_mpi
@pytest.mark.mpi
@pytest.mark.timeout(200)
@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.heavy)])
def test_every_rank_switches_identically_over_mpi(n: int) -> None:
    proc = run_mpi(n, ["tests/mpi_scripts/auto.py", "3"], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(results) == n, proc.stdout
    choices = {re.search(r"choices=(\S+)", line).group(1) for line in results}
    assert len(choices) == 1, results  # one decision, every rank
    [plan] = choices
    assert [c.split(":")[0] for c in plan.split("|")] == ["1", "2", "3"]
    for line in results:
        assert float(re.search(r"grad_diff=(\S+)", line).group(1)) <= 1e-10
        assert float(re.search(r"loss_diff=(\S+)", line).group(1)) <= 1e-10


def test_cli_train_auto_prints_its_choice(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--stages", "2", "--microbatches", "4", "--steps", "2",
                 "--split-backward", "--hint", "auto", "--cap", "2x", "--sleep-only",
                 "--task-ms", "2", "--jitter", "multimodal:0.5:2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    # the choice follows measured (sleep) durations, so any policy may win on a loaded host
    assert re.search(r"^hint=auto: \S+ (ready(/(greedy|light))?|strict) from step 1, "
                     r"caps \[\d+, \d+\]$", out, re.M)
    assert "budget per rank: [4, 2]; chosen:" in out
