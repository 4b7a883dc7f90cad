"""hint="auto" (and policy="auto") in a Pipeline within a byte budget: the chooser replays the
bytes the stages measured, and the switch applies the chosen schedule's byte gate and caps on
every rank (docs/policy.md "Choosing automatically", runtime/autotune.py)."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest
from conftest import requires_mpi, run_mpi

import aioready
from aioready.errors import ConfigError
from aioready.memory import Budget
from aioready.runtime.autotune import AutoTuning
from aioready.testing.helpers import make_mlp_stages, max_grad_diff, mse_loss, reference_step
from tests.test_memory import _batches

ROWS = (2, 9, 3, 4, 12, 1, 6, 5)  # microbatches of unequal sizes: their bytes differ


def _steps(n: int, **kw: Any) -> tuple[aioready.Pipeline, list[Any]]:
    """`n` steps on the same batches; each checked against the unsplit reference."""
    stages = make_mlp_stages(4)
    xs, ys = _batches(ROWS)
    reports = []

    async def main() -> aioready.Pipeline:
        pipe = aioready.Pipeline(stages, mse_loss, microbatches=len(xs), device="inline", **kw)
        try:
            for _ in range(n):
                for s in stages:
                    s.zero_grad(set_to_none=True)
                loss = await pipe.step(xs, ys)
                ref_loss, ref = reference_step(stages, mse_loss, xs, ys)
                assert abs(float(loss) - float(ref_loss)) <= 1e-10
                assert max_grad_diff(stages, ref) <= 1e-10
                reports.append(pipe.last_step)
        finally:
            pipe.close()
        return pipe
    return asyncio.run(main()), reports


def _strict_peaks() -> dict[int, int]:
    """What strict 1F1B (the start hint) holds at its peak on each rank, measured."""
    _, [step] = _steps(1, hint="1f1b", mode="strict", measure_memory=True)
    return step.peak_activation_bytes


def _check_applied(pipe: aioready.Pipeline, reports: list[Any]) -> Any:
    """The choice runs on every rank from the step after the first, within its budget."""
    [(first, choice)] = pipe.auto.choices  # type: ignore[union-attr]
    assert first == 1
    assert (pipe.hint.name, pipe.mode) == (choice.hint, choice.mode)
    limit = pipe.auto.chooser.last.limit  # type: ignore[union-attr]
    for rt in pipe.runtimes:
        assert (rt.cap, rt._policy) == (choice.cap[rt.rank], choice.policy)
        if choice.memory is None:
            assert choice.mode == "strict" and rt.memory is None
        else:
            assert rt.memory == Budget(bytes=choice.memory[rt.rank], count=choice.cap[rt.rank])
            assert choice.memory[rt.rank] <= limit[rt.rank]
    for step in reports[1:]:
        for rank, held in step.peak_activation_bytes.items():
            mine = [b for (stage, _), (b, _) in step.activation_bytes.items()
                    if pipe.hint.placement.rank_of(stage) == rank]
            # each microbatch's bytes per input byte is one ratio per stage here (an MLP on rows),
            # so the gate's prediction is exact and bounds the bytes; under the reservation the
            # order's own forwards pass it (docs/policy.md "Memory budgets"), at most its peak
            slack = 0 if choice.policy != "reserve" else pipe.hint.peak(rank) * max(mine)
            assert held <= limit[rank] + slack, (rank, held, limit)
            if choice.memory is not None and choice.policy != "reserve":
                assert step.peak_in_flight[rank] <= choice.cap[rank]
    return choice


def test_auto_within_twice_the_measured_bytes_switches_and_keeps_them() -> None:
    pipe, reports = _steps(3, hint="auto", memory="2x")
    strict = _strict_peaks()
    limit = pipe.auto.chooser.last.limit  # type: ignore[union-attr]
    # "2x" is twice what the start hint's strict order holds, replayed on the measured bytes:
    # exactly what a real strict 1F1B step measures
    assert limit == tuple(2 * strict[r] for r in range(4))
    _check_applied(pipe, reports)
    assert (pipe.memory or [None] * 4) == [rt.memory for rt in pipe.runtimes]  # strict: None


def test_auto_within_fixed_bytes_and_the_order_stays_given() -> None:
    pipe, reports = _steps(3, hint="auto", memory="64KiB")
    assert pipe.auto.chooser.last.limit == (65536,) * 4  # type: ignore[union-attr]
    assert pipe.auto.orders is None and pipe.microbatch_order == "given"  # type: ignore
    choice = _check_applied(pipe, reports)
    assert choice.table and "peak bytes" in choice.table


def test_at_the_start_hints_own_bytes_the_choice_holds_no_more() -> None:
    pipe, reports = _steps(2, hint="auto", memory="1x")
    strict = _strict_peaks()
    assert pipe.auto.chooser.last.limit == tuple(strict[r] for r in range(4))  # type: ignore
    _check_applied(pipe, reports)
    for (stage, _), (held, source) in reports[1].activation_bytes.items():
        first = reports[1].activation_bytes[(stage, 0)]
        assert held * first[1] == first[0] * source  # bytes per input byte: one per stage


def test_policy_auto_within_bytes_keeps_its_hint() -> None:
    pipe, reports = _steps(3, hint="1f1b", policy="auto", memory="2x")
    choice = _check_applied(pipe, reports)
    assert choice.hint == "1f1b" and choice.mode == "ready"


def test_what_cannot_choose_within_bytes_is_refused_clearly() -> None:
    with pytest.raises(ConfigError, match="tensor-parallel"):
        AutoTuning.for_pipeline("auto", budget=None, num_stages=4, split_backward=False,
                                world_size=None, memory="2x", coordinator=object())
    with pytest.raises(ConfigError, match="cap and memory both given"):
        aioready.Pipeline(make_mlp_stages(2), mse_loss, microbatches=2, hint="auto",
                          memory="2x", cap="2x")

    async def stage_less(**kw: Any) -> None:  # nothing measures the bytes: no choice within
        pipe = aioready.Pipeline([None] * 2, None, microbatches=2, memory="2x",
                                 device="inline", **kw)
        try:
            await pipe.step()
        finally:
            pipe.close()
    for kw in ({"hint": "auto"}, {"hint": "1f1b", "policy": "auto"}):
        with pytest.raises(ConfigError, match="bytes the stages measured"):
            asyncio.run(stage_less(**kw))


def test_a_choice_within_bytes_crosses_ranks_as_integers() -> None:
    from aioready.runtime.choosers import Choice
    for choice in (Choice("gpipe", "linear", "ready", (6, 4), "greedy", (87808, 59584)),
                   Choice("1f1b", "linear", "strict", (2, 1))):
        values = choice.encode()
        assert len(values) == Choice.width(2) and Choice.decode(values) == choice


@pytest.mark.timeout(120)
def test_train_chooses_within_memory(tmp_path: Any) -> None:
    import json

    from aioready.cli import main
    assert main(["train", "--stages", "2", "--microbatches", "4", "--steps", "2", "--task-ms",
                 "0", "--dim", "8", "--seq", "4", "--hint", "auto:1f1b", "--memory", "2x",
                 "--no-progress", "--json", str(tmp_path / "t.json")]) == 0
    summary = json.loads((tmp_path / "t.json").read_text())
    [choice] = summary["auto"]["choices"]
    assert choice["from_step"] == 1 and summary["memory"] == "2x" and summary["cap"] is None
    if choice["memory"] is not None:  # the chosen byte budget per rank (None: strict)
        assert len(choice["memory"]) == 2 and min(choice["memory"]) > 0


@requires_mpi
@pytest.mark.mpi
@pytest.mark.timeout(200)
def test_every_rank_switches_to_one_byte_budget_over_mpi() -> None:
    """Rank 0 chooses on every rank's measured bytes (gathered beside the spans); each rank
    runs the choice's byte budget for its own rank, within it, with exact gradients."""
    proc = run_mpi(2, ["tests/mpi_scripts/auto.py", "3", "2x"], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = sorted(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    assert len(results) == 2, proc.stdout
    found = [dict(re.findall(r"(\w+)=(\S+)", line)) for line in results]
    assert len({(f["choices"], f["memory"]) for f in found}) == 1, results  # one decision
    assert len(found[0]["memory"].split("|")) == 3  # a choice after every step
    for f in found:
        assert f["applied"] == "True", f  # the last choice's budget and count, on this rank
        assert float(f["grad_diff"]) <= 1e-10 and float(f["loss_diff"]) <= 1e-10
        assert float(f["over"]) <= 0, f  # -inf: every choice was strict, ungated
