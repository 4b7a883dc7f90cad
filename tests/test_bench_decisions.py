"""bench.decisions, the proof that a hot-path change keeps every decision, must see a change."""

from __future__ import annotations

import pytest

from aioready.forecast import Forecast
from bench.decisions import fingerprints

CASES = [dict(stages=4, microbatches=8, hint="1f1b", jitter="lognormal:0.5", seed=0,
              split_backward=False, steps=2, policy="reserve", cap="2x"),
         dict(stages=8, microbatches=8, hint="interleaved-zb", jitter="multimodal:0.3:3",
              seed=1, split_backward=True, steps=2, policy="reserve")]


def test_the_same_code_gives_the_same_fingerprints() -> None:
    assert fingerprints(True, CASES) == fingerprints(True, CASES)


@pytest.mark.parametrize("what", ["notice", "margin"])
def test_a_changed_forecast_changes_every_fingerprint(monkeypatch: pytest.MonkeyPatch,
                                                      what: str) -> None:
    before = fingerprints(True, CASES)
    if what == "notice":  # every notice announces a little longer
        early = Forecast.early_estimate
        monkeypatch.setattr(Forecast, "early_estimate",
                            lambda self, t: None if early(self, t) is None
                            else early(self, t) * (1 + 1e-6) + 1e-6)
    else:  # the backfill test's margin, which only decisions and the end state read
        margin = Forecast.margin
        monkeypatch.setattr(Forecast, "margin", lambda self, t: margin(self, t) * 2)
    after = fingerprints(True, CASES)
    assert before.keys() == after.keys()
    assert all(before[k] != after[k] for k in before)
