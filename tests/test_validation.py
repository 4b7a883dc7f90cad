"""Bad input at the Pipeline boundary: a clear ConfigError/HintError naming what was expected and
what was got, at construction, not a TypeError inside the first step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from aioready import ConfigError, HintError
from aioready.runtime.pipeline import Pipeline
from aioready.schedulers import make_hint
from aioready.testing.helpers import make_mlp_stages, mse_loss

STAGES = make_mlp_stages(4)


@pytest.mark.parametrize("kw, error, text", [
    (dict(cap="four"), ConfigError, "cap (expected None, an int >= 1, 'Nx'"),
    (dict(cap="four"), ConfigError, "got 'four')"),
    (dict(cap="-2x"), ConfigError, "cap factor (expected a positive multiple"),
    (dict(cap=True), ConfigError, "got True)"),
    (dict(cap=[4, 3]), ConfigError, "cap: one per rank (expected 4 caps, got 2 ([4, 3]))"),
    (dict(cap=[1, 0, 1, 1]), ConfigError, "rank 1: cap must admit at least one microbatch"),
    (dict(cap=[2.5, 1, 1, 1]), ConfigError, "cap (expected None"),
    (dict(device=5), ConfigError, "device (expected 'cpu', 'cuda', a Device or a factory"),
    (dict(device="tpu"), ConfigError, "unknown device"),
    (dict(loss_fn=None), ConfigError, "the last stage needs a loss function"),
    (dict(loss_fn="mse"), ConfigError, "loss_fn must be callable"),
    (dict(split_backward="yes"), ConfigError, "split_backward (expected True or False"),
    (dict(microbatches=2.0), ConfigError, "microbatches must be a positive integer"),
    (dict(mode="fast"), ConfigError, "got 'fast'"),
    (dict(hint="1f2b"), HintError, "unknown hint"),
    (dict(stall_timeout=-3), ConfigError, "stall_timeout= must be a positive number"),
    (dict(peer_timeout="soon"), ConfigError, "peer_timeout= must be a positive number"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_pipeline_arguments(kw: dict[str, Any], error: type, text: str) -> None:
    kw = dict(kw)
    loss = kw.pop("loss_fn", mse_loss)
    with pytest.raises(error) as info:
        Pipeline(STAGES, loss, **kw)
    assert text in str(info.value)


def test_hint_file_for_another_stage_count(tmp_path: Path) -> None:
    path = tmp_path / "two.txt"
    path.write_text(make_hint("1f1b", num_stages=2, num_microbatches=8,
                              split_backward=False).dumps())
    with pytest.raises((ConfigError, HintError), match=r"stages=2|expected 2"):
        Pipeline(STAGES, mse_loss, hint=str(path))
    path.write_text("F0 F1 B0\n")
    with pytest.raises(HintError, match="two.txt"):
        Pipeline(STAGES, mse_loss, hint=str(path))
