"""Memory budgets in bytes (aioready/memory.py, held_bytes.py, ready_set Note [byte gate]): one
parser for every entry point, a gate that admits exactly as the arithmetic says, measured bytes
that match what autograd holds, exact gradients, and budgets respected on real stages and in
the simulator."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
import torch

import aioready
from aioready.cli.trainer import TrainConfig
from aioready.errors import ConfigError
from aioready.held_bytes import HeldBytes
from aioready.memory import Budget, parse_memory, resolve_memory
from aioready.modeling.memory import stage_memory
from aioready.ready_set import ReadySet
from aioready.sim.memory import BYTES_PER_MS
from aioready.tasks import Task
from aioready.testing.helpers import make_mlp_stages, max_grad_diff, mse_loss, reference_step

GiB, MiB = 2**30, 2**20


@pytest.mark.parametrize("memory, form", [
    (None, None), ("24GiB", Budget(bytes=24 * GiB)), ("512MiB", Budget(bytes=512 * MiB)),
    ("1.5GB", Budget(bytes=1_500_000_000)), (" 100 kb ", Budget(bytes=100_000)),
    (4096, Budget(bytes=4096)), ("4096", Budget(bytes=4096)), ("2x", Budget(factor=2.0)),
    ("1.5X", Budget(factor=1.5)), ("8GiB,6GiB", (Budget(bytes=8 * GiB), Budget(bytes=6 * GiB))),
    (["1MiB", 2048, "3x"], (Budget(bytes=MiB), Budget(bytes=2048), Budget(factor=3.0))),
])
def test_parse_normalises_each_form(memory: Any, form: Any) -> None:
    assert parse_memory(memory) == form


@pytest.mark.parametrize("bad", [0, -1, "0GiB", "-1GiB", "0.1B", True, False, 1.5, math.nan,
                                 "nanx", "infx", "0x", "-2x", "x", "12 parsecs", "GiB", "",
                                 "1e400GiB", [], [True], ["1MiB", "lots"], {"a": 1}, b"1MiB"])
def test_a_bad_memory_is_a_config_error_naming_what_was_expected_and_got(bad: Any) -> None:
    with pytest.raises(ConfigError, match="memory") as info:
        parse_memory(bad)
    assert info.value.expected is not None and repr(bad)[:8] in str(info.value.got)


def test_one_budget_per_rank_must_match_the_ranks() -> None:
    assert resolve_memory("2x", 3) == [Budget(factor=2.0)] * 3
    with pytest.raises(ConfigError, match="one per rank"):
        resolve_memory(["1MiB", "2MiB"], 3)


def test_cap_and_memory_together_are_refused_everywhere() -> None:
    for make in (lambda: aioready.Pipeline([None] * 2, None, microbatches=2, cap=2,
                                           memory="1MiB", device="inline"),
                 lambda: aioready.simulate(stages=2, microbatches=2, cap=2, memory="1MiB"),
                 lambda: TrainConfig(cap="2x", memory="2x")):
        with pytest.raises(ConfigError, match="not both"):
            make()


# -- the gate, by hand ---------------------------------------------------------------------

class Rank:
    """What the runtime does around a ReadySet: admit, measure, release (rank.py)."""

    def __init__(self, order: str, budget: Budget, *, peak: int, reserve: bool) -> None:
        ranked = [Task.parse(w) for w in order.split()]
        self.held = HeldBytes(budget, peak_count=peak, num_chunks=1, split_backward=False)
        self.ready = ReadySet({t: i for i, t in enumerate(ranked)}, cap=len(ranked),
                              num_chunks=1, split_backward=False, held=self.held,
                              reserve_order=ranked if reserve else None, reserve_peak=peak,
                              fits=(lambda c, r: False) if reserve else None)

    def push(self, text: str) -> None:
        for word in text.split():
            self.ready.push(Task.parse(word))

    def run(self, nbytes: float = 0.0) -> str | None:
        """Pop, run (an F holds `nbytes`) and end one task; its text, or None."""
        task = self.ready.pop_nowait()
        if task is None:
            return None
        if task.chunk == 0 and task.kind.name == "F":
            self.held.admit(task.microbatch)
            self.held.measured(task.microbatch, 0, nbytes)
        self.ready.done(task)
        self.held.release(task)
        return str(task)


def test_the_byte_gate_admits_and_holds_as_the_arithmetic_says() -> None:
    rank = Rank("F0 F1 F2 F3 B0 B1 B2 B3", Budget(bytes=100), peak=4, reserve=False)
    for m, size in enumerate((10, 10, 20, 5)):
        rank.held.inputs(m, size)
    rank.push("F0 F1 F2 F3")
    assert rank.held.predict(0) is None
    assert rank.run(40) == "F0"  # nothing measured, nothing in flight: admitted
    assert rank.held.predict(1) == 40  # 4 bytes per input byte x 10
    assert rank.run(40) == "F1"  # 40 + 40 <= 100
    assert rank.held.predict(2) == 80 and rank.held.held == 80
    assert rank.run() is None  # F2: 80 + 80 > 100, and nothing else is ready
    rank.push("B0")
    assert rank.run() == "B0" and rank.held.held == 40
    assert rank.run() is None  # 40 + 80 > 100 still
    rank.push("B1")
    assert rank.run() == "B1" and rank.held.held == 0
    assert rank.run(80) == "F2"  # 80 <= 100
    assert rank.held.predict(3) == 20  # (40 + 40 + 80) / (10 + 10 + 20) x 5
    assert rank.run(20) == "F3" and rank.held.held == 100  # exactly the budget
    assert rank.held.peak == 100


def test_a_microbatch_larger_than_the_budget_runs_alone(caplog: pytest.LogCaptureFixture
                                                        ) -> None:
    rank = Rank("F0 F1 B0 B1", Budget(bytes=10), peak=2, reserve=False)
    rank.push("F0 F1")
    assert rank.run(50) == "F0"
    assert rank.run() is None  # F1 would be 50 more
    rank.push("B0")
    assert rank.run() == "B0"
    with caplog.at_level("WARNING", logger="aioready.held_bytes"):
        assert rank.run(50) == "F1"  # alone: admitted, said once
        assert "more than the memory budget" in caplog.text


def test_under_the_reservation_the_byte_room_bounds_the_forwards_run_ahead() -> None:
    """The order (peak 1) holds 40 at its peak; a budget of 100 leaves a room of 60 above it:
    one microbatch of 40 may run ahead of the order, not two (40 + 40 > 60)."""
    rank = Rank("F0 B0 F1 B1 F2 B2 F3 B3", Budget(bytes=100), peak=1, reserve=True)
    rank.push("F0 F1 F2 F3")
    assert rank.run(40) == "F0"
    assert rank.run(40) == "F1"  # ahead: 80 <= 100 and 40 <= 60
    assert rank.run() is None  # F2: 120 > 100
    small = Rank("F0 B0 F1 B1 F2 B2", Budget(bytes=70), peak=1, reserve=True)
    small.push("F0 F1 F2")
    assert small.run(40) == "F0"
    assert small.run() is None  # room 30 < 40: nothing runs ahead
    small.push("B0")
    assert small.run() == "B0"
    assert small.run(40) == "F1"  # in order: the reservation's own task


# -- real stages -----------------------------------------------------------------------------

def _batches(rows: tuple[int, ...]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(r, 16, generator=gen, dtype=torch.float64) for r in rows]
    return xs, [torch.randn(r, 16, generator=gen, dtype=torch.float64) for r in rows]


def _run(stages: list[torch.nn.Module], xs: list, ys: list, **kw: Any) -> aioready.Pipeline:
    async def main() -> aioready.Pipeline:
        pipe = aioready.Pipeline(stages, mse_loss, microbatches=len(xs), **kw)
        try:
            await pipe.step(xs, ys)
        finally:
            pipe.close()
        return pipe
    return asyncio.run(main())


def test_measured_bytes_are_what_autograd_saves_for_each_microbatch() -> None:
    stages = make_mlp_stages(3)
    xs, ys = _batches((2, 7))
    pipe = _run(stages, xs, ys, hint="gpipe", memory="1GiB")
    for m, x in enumerate(xs):
        prices = stage_memory(stages, x)
        for rt in pipe.runtimes[:-1]:  # the last stage also holds its loss's graph
            assert rt.executors[0].held_bytes(m) == prices[rt.rank].graph_bytes
    recomputed = _run(make_mlp_stages(3), xs, ys, hint="gpipe", memory="1GiB",
                      recompute=[False, True, True])
    # with recompute a stage holds only its inputs (stage 0's output: the same shape as x)
    assert recomputed.runtimes[1].executors[0].held_bytes(1) == xs[1].nbytes
    assert recomputed.runtimes[0].executors[0].held_bytes(1) == \
        pipe.runtimes[0].executors[0].held_bytes(1) > xs[1].nbytes


@pytest.mark.parametrize("policy", ["greedy", "reserve", "light"])
@pytest.mark.parametrize("hint, split", [("1f1b", False), ("zb-h1", True), ("zbv", True)])
def test_a_byte_budget_keeps_gradients_exact(policy: str, hint: str, split: bool) -> None:
    stages = make_mlp_stages(4)
    xs, ys = _batches((2, 9, 3, 4, 12, 1, 6, 5))
    _, ref = reference_step(stages, mse_loss, xs, ys)
    _run(stages, xs, ys, hint=hint, split_backward=split, memory="24KiB", policy=policy,
         device="inline")
    assert max_grad_diff(stages, ref) < 1e-12


def test_real_stages_stay_within_a_byte_budget_unless_one_microbatch_exceeds_it() -> None:
    """Greedy gate, shapes varying per microbatch: the held bytes never pass the budget while
    more than one microbatch is held; one bigger than the budget runs alone."""
    xs, ys = _batches((2, 9, 3, 4, 12, 1, 6, 5))
    alone = _run(make_mlp_stages(4), xs, ys, memory=1, policy="greedy").last_step
    assert set(alone.peak_in_flight.values()) == {1}
    single = alone.peak_activation_bytes  # per rank: its largest microbatch
    for budget in (10_000, 20_000, 40_000):
        step = _run(make_mlp_stages(4), xs, ys, memory=budget, policy="greedy",
                    device="inline").last_step
        for rank, peak in step.peak_activation_bytes.items():
            assert peak <= max(budget, single[rank]), (budget, rank, peak)
        if budget >= 20_000:  # room for a few microbatches, not all eight: the gate binds
            assert 1 < step.peak_in_flight[0] < 8, step.peak_in_flight
    roomy = _run(make_mlp_stages(4), xs, ys, memory="1GiB", policy="greedy",
                 device="inline").last_step  # inline: the same order of events every run
    assert roomy.peak_activation_bytes[0] > 40_000, roomy.peak_activation_bytes


def test_twice_the_hints_peak_bytes_is_respected_under_the_reservation() -> None:
    xs, ys = _batches((4,) * 8)
    one = _run(make_mlp_stages(4), xs, ys, memory=1, policy="greedy").last_step
    step = _run(make_mlp_stages(4), xs, ys, memory="2x").last_step
    hint_peak = aioready.make_hint("1f1b", num_stages=4, num_microbatches=8).default_caps
    for rank, peak in step.peak_activation_bytes.items():
        assert peak <= 2 * hint_peak[rank] * one.peak_activation_bytes[rank]
    assert step.peak_in_flight[0] > hint_peak[0]  # the room was used


# -- the simulator ---------------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["greedy", "reserve"])
def test_equal_microbatches_make_2x_bytes_the_same_gate_as_2x_count(policy: str) -> None:
    by_count = aioready.simulate(stages=4, microbatches=8, cap="2x", policy=policy)
    by_bytes = aioready.simulate(stages=4, microbatches=8, memory="2x", policy=policy)
    assert by_bytes.step_time == by_count.step_time
    assert by_bytes.peak_in_flight == by_count.peak_in_flight
    assert by_bytes.peak_activation_bytes == tuple(int(p * BYTES_PER_MS)
                                                   for p in by_count.peak_in_flight)
    assert by_bytes.memory == ("2x",) * 4
    assert by_bytes.as_dict()["peak_activation_bytes"] == list(by_bytes.peak_activation_bytes)


def test_simulated_heavy_microbatches_hold_more_and_the_budget_binds() -> None:
    """multimodal without noise: a heavy microbatch holds FACTOR x the bytes at every stage and
    the prediction from its input is exact, so the greedy gate keeps within a fixed budget."""
    jitter = "multimodal:0.3:3:0"
    free = aioready.simulate(stages=4, microbatches=16, jitter=jitter, cap=16, policy="greedy")
    bound = aioready.simulate(stages=4, microbatches=16, jitter=jitter, memory="6MiB",
                              policy="greedy")
    assert max(free.peak_activation_bytes) > 6 * MiB
    assert all(p <= 6 * MiB for p in bound.peak_activation_bytes), bound.peak_activation_bytes
    assert bound.step_time >= free.step_time
    twice = aioready.simulate(stages=4, microbatches=16, jitter=jitter, memory="2x")
    once = aioready.simulate(stages=4, microbatches=16, jitter=jitter, mode="strict")
    assert twice.step_time < once.step_time  # memory above the peak buys speed
    assert max(twice.peak_activation_bytes) > max(once.peak_activation_bytes)


# -- the command line ------------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_train_and_simulate_take_memory(tmp_path: Any) -> None:
    import json

    from aioready.cli import main
    assert main(["train", "--stages", "2", "--microbatches", "4", "--steps", "2", "--task-ms",
                 "0", "--dim", "8", "--seq", "4", "--memory", "2x", "--no-progress", "--json",
                 str(tmp_path / "t.json")]) == 0
    summary = json.loads((tmp_path / "t.json").read_text())
    assert summary["memory"] == "2x" and summary["cap"] is None
    held = summary["peak_activation_bytes"]
    assert len(held) == 2 and all(isinstance(b, int) and b > 0 for step in held for b in step)
    assert main(["simulate", "--stages", "4", "--microbatches", "8", "--memory", "3MiB",
                 "--policy", "greedy", "--json", str(tmp_path / "s.json")]) == 0
    result = json.loads((tmp_path / "s.json").read_text())
    assert result["memory"] == ["3 MiB"] * 4 and max(result["peak_in_flight"]) == 3
    assert result["peak_activation_bytes"] == [p * MiB for p in result["peak_in_flight"]]


@pytest.mark.parametrize("command", ["train", "simulate"])
@pytest.mark.parametrize("bad", ["infx", "-1GiB", "3 parsecs"])
def test_both_commands_refuse_a_bad_memory_naming_it(command: str, bad: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from aioready.cli import main
    shape = ["--stages", "2", "--microbatches", "2"]
    rest = ["--steps", "1", "--no-progress"] if command == "train" else []
    assert main([command, *shape, f"--memory={bad}", *rest]) == 1
    err = capsys.readouterr().err
    assert f"aioready {command}: error" in err and f"'{bad}'" in err and "memory" in err


def test_auto_refuses_bytes_it_cannot_measure_and_gated_entries_are_counted_by_bytes(
        ) -> None:
    async def stage_less() -> None:  # hint="auto" chooses within measured bytes only
        pipe = aioready.Pipeline([None] * 2, None, microbatches=2, hint="auto", memory="2x",
                                 device="inline")
        try:
            await pipe.step()
        finally:
            pipe.close()
    with pytest.raises(ConfigError, match="auto"):
        asyncio.run(stage_less())
    rank = Rank("F0 F1 B0 B1", Budget(bytes=60), peak=2, reserve=False)
    rank.push("F0 F1")
    rank.run(40)
    assert rank.run() is None and rank.ready.statistics().num_gated == 1


def test_recompute_holds_only_inputs_so_the_same_budget_admits_more() -> None:
    xs, ys = _batches((2, 9, 3, 4, 12, 1, 6, 5))
    steps = [_run(make_mlp_stages(4), xs, ys, memory=20_000, policy="greedy", device="inline",
                  recompute=recompute).last_step for recompute in (False, True)]
    assert steps[1].peak_in_flight[0] > steps[0].peak_in_flight[0]
    # stage 0 keeps its inputs: 8 microbatches of 42 rows x 16 float64 at most
    assert steps[1].peak_activation_bytes[0] <= sum(x.nbytes for x in xs) < 20_000
