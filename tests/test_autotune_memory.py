"""hint="auto" within a byte budget: simulate, tune and the CLI choose a schedule whose peak
activation bytes fit, pruning chooses as the full search does, and bad values are refused."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

import aioready
from aioready.cli import main
from aioready.errors import ConfigError
from aioready.placement import Placement
from aioready.sim.choice import choose_auto
from aioready.sim.memory import mean_bytes
from aioready.sim.traces import Trace, write_trace
from aioready.sim.tune import tune
from aioready.sim.variability import JitterModel

KW = dict(stages=4, microbatches=8, hint="auto", jitter="multimodal:0.3:3", seed=1,
          split_backward=True)


def trace() -> Trace:
    place = Placement.linear(4)
    model = JitterModel("multimodal:0.3:3", seed=1, placement=place, num_microbatches=8,
                        split_backward=True)
    return Trace(np.stack([model.table(0)]), placement=place, split_backward=True,
                 source="multimodal seed 1")


def test_simulate_auto_fits_a_relative_byte_budget() -> None:
    result = aioready.simulate(**KW, memory="2x")  # type: ignore[arg-type]
    tuning = result.tuning
    assert tuning.in_bytes and result.hint.startswith("auto:")
    # "2x": twice what strict 1f1b (the start hint) holds at its peak on each rank
    strict = aioready.simulate(**{**KW, "hint": "1f1b", "mode": "strict"})  # type: ignore
    assert tuning.limit == tuple(2 * b for b in strict.peak_activation_bytes)
    assert all(p <= b for p, b in zip(result.peak_activation_bytes, tuning.limit))
    assert result.step_time == tuning.best.step_time
    fitting = [r for r in tuning.rows if r.fits]
    assert tuning.best is fitting[0] and all(r.step_time >= tuning.best.step_time
                                             for r in fitting)
    assert any(not r.fits and not r.stopped for r in tuning.rows)  # some went over it
    assert "peak bytes (budgets)" in tuning.table() and "MiB" in tuning.table()


def test_a_larger_byte_budget_is_never_slower() -> None:
    tight = aioready.simulate(**KW, memory="1x")  # type: ignore[arg-type]
    strict = aioready.simulate(**{**KW, "hint": "1f1b", "mode": "strict"})  # type: ignore
    assert tight.step_time <= strict.step_time  # "1x" always admits the start hint itself
    roomy = aioready.simulate(**KW, memory="40MiB")  # type: ignore[arg-type]
    assert roomy.tuning.limit == (40 * 2**20,) * 4
    assert roomy.step_time <= tight.step_time
    assert max(roomy.peak_activation_bytes) > max(tight.peak_activation_bytes)


def test_pruning_chooses_as_the_full_search_under_bytes() -> None:
    loaded = trace()

    def run(order, mode, caps, policy, bound=None, memory=None):  # type: ignore[no-untyped-def]
        return aioready.simulate(stages=4, microbatches=8, hint=order, mode=mode, trace=loaded,
                                 cap=None if memory else list(caps),
                                 memory=memory and list(memory), split_backward=True,
                                 policy=policy, stop_after=bound)
    tunings = [choose_auto(run, "auto", num_stages=4, num_ranks=4, num_microbatches=8,
                           split_backward=True, memory="2x", prune=prune,
                           mean_bytes=lambda o: mean_bytes(loaded, o.placement, 1))
               for prune in (True, False)]
    assert tunings[0].best == tunings[1].best and tunings[0].choice == tunings[1].choice
    assert tunings[0].choice.memory is not None or tunings[0].choice.mode == "strict"


@pytest.mark.parametrize("bad, match", [("-1GiB", "at least one byte"), ("2y", "known unit"),
                                        (1.5, "memory"), (True, "memory"), ("0x", "memory"),
                                        ("1MiB,2MiB", "one per rank")])
def test_bad_byte_budgets_are_refused_clearly(bad: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        aioready.simulate(**KW, memory=bad)  # type: ignore[arg-type]
    assert repr(bad) in str(info.value) or str(bad) in str(info.value)
    with pytest.raises(ConfigError, match=match):
        tune(trace(), memory=bad)  # type: ignore[arg-type]


def test_cap_and_memory_together_are_refused() -> None:
    with pytest.raises(ConfigError, match="cap and memory both given"):
        aioready.simulate(**KW, cap="2x", memory="2x")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="cap and memory both given"):
        tune(trace(), budget="2x", memory="2x")


def test_cli_tune_and_simulate_take_memory(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.csv"
    write_trace(path, trace())
    assert main(["tune", "--trace", str(path), "--memory", "2x", "--json",
                 str(tmp_path / "out.json")]) == 0
    out = capsys.readouterr().out
    assert "peak bytes (budgets)" in out and re.search(r"^\* ", out, re.M)
    body = json.loads((tmp_path / "out.json").read_text())
    assert body["memory"] == "2x" and body["chosen"]["peak"] <= [int(x) for x in
                                                                 tune(trace(), memory="2x").limit]
    chosen = body["chosen"]
    assert ("--memory " in out) == (chosen["memory"] is not None)
    assert main(["tune", "--trace", str(path), "--memory", "lots"]) != 0
    assert "memory" in capsys.readouterr().err
    assert main(["tune", "--trace", str(path), "--memory", "2x", "--budget", "2x"]) != 0
    assert "cap and memory both given" in capsys.readouterr().err
    assert main(["simulate", "--stages", "4", "--microbatches", "8", "--split-backward",
                 "--jitter", "multimodal:0.3:3", "--seed", "1", "--hint", "auto",
                 "--memory", "2x"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("auto:") and "peak bytes (budgets)" in out
