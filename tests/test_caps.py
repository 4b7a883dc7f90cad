"""One cap parser (aioready/caps.py) for Pipeline, simulate and both CLI commands: the same forms
give the same per-rank caps everywhere, and a bad value is a ConfigError that names it."""

from __future__ import annotations

from typing import Any

import pytest

from aioready.caps import parse_cap, resolve_caps
from aioready.errors import ConfigError
from aioready.runtime.pipeline import Pipeline
from aioready.schedulers import make_hint
from aioready.sim.simulator import simulate

HINT = make_hint("1f1b", num_stages=4, num_microbatches=8)  # default caps 4, 3, 2, 1


@pytest.mark.parametrize("cap, form", [
    (None, None), (3, 3), ("3", 3), (" 2X ", "2x"), ("1.5x", "1.5x"), ("4,3,2,1", (4, 3, 2, 1)),
    ([4, None, 2, 1], (4, None, 2, 1)), ((1, 2, 3, 4), (1, 2, 3, 4)),
])
def test_parse_normalises_each_form(cap: Any, form: Any) -> None:
    assert parse_cap(cap) == form


@pytest.mark.parametrize("bad", ["x", "0x", "-2x", "nanx", "infx", "two", "4.0", "4,,3", "-1",
                                 "", 0, "0", True, 2.5, [2.5, 1, 1, 1], ["4", 3, 2, 1], object()])
def test_a_bad_cap_is_a_config_error_naming_the_value(bad: Any) -> None:
    with pytest.raises(ConfigError) as info:
        parse_cap(bad)
    assert repr(bad) in str(info.value)


CAPS = [(None, [4, 3, 2, 1]), (5, [5] * 4), ("5", [5] * 4), ("2x", [8, 6, 4, 2]),
        ("1.5x", [6, 5, 3, 2]), ("4,3,3,3", [4, 3, 3, 3]), ([6, None, 2, 1], [6, 3, 2, 1])]


@pytest.mark.parametrize("cap, caps", CAPS, ids=[repr(c) for c, _ in CAPS])
def test_pipeline_and_simulate_accept_the_same_forms(cap: Any, caps: list[int]) -> None:
    assert resolve_caps(cap, HINT) == caps
    pipe = Pipeline([None] * 4, None, microbatches=8, cap=cap, device="inline")
    assert [rt.cap for rt in pipe.runtimes] == caps
    assert list(simulate(stages=4, microbatches=8, cap=cap).cap) == caps


@pytest.mark.parametrize("bad", ["four", "2y", "0,1,1,1", [1, 2]])
def test_pipeline_and_simulate_refuse_the_same_values(bad: Any) -> None:
    for make in (lambda: Pipeline([None] * 4, None, microbatches=8, cap=bad, device="inline"),
                 lambda: simulate(stages=4, microbatches=8, cap=bad)):
        with pytest.raises(ConfigError, match="cap") as info:
            make()
        assert repr(bad) in str(info.value)
