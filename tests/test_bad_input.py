"""Bad input gets an error that names the parameter, what was expected and what was got."""

from __future__ import annotations

import pytest
import torch

import aioready
from aioready.errors import ConfigError, HintError
from aioready.testing.helpers import make_mlp_stages, mse_loss
from aioready.transports.inproc import InprocWorld


@pytest.mark.parametrize("value", [0, -2, 2.5, "8", True])
def test_microbatches_must_be_a_positive_int(value: object) -> None:
    with pytest.raises(ConfigError) as err:
        aioready.Pipeline(make_mlp_stages(2), mse_loss, microbatches=value)  # type: ignore[arg-type]
    msg = str(err.value)
    assert "microbatches" in msg and "expected >= 1" in msg and repr(value) in msg


async def test_batch_not_divisible_into_equal_microbatches() -> None:
    pipe = aioready.Pipeline(make_mlp_stages(2), mse_loss, microbatches=4)
    with pytest.raises(ConfigError) as err:
        await pipe.step(torch.randn(6, 16, dtype=torch.float64),
                        torch.randn(6, 16, dtype=torch.float64))
    pipe.close()
    msg = str(err.value)
    assert "inputs" in msg and "divisible by microbatches=4" in msg and "batch size 6" in msg


async def test_microbatch_list_of_the_wrong_length() -> None:
    pipe = aioready.Pipeline(make_mlp_stages(2), mse_loss, microbatches=4)
    with pytest.raises(ConfigError, match=r"inputs.*expected 4 microbatches, got 3"):
        await pipe.step([torch.randn(2, 16)] * 3, [torch.randn(2, 16)] * 3)
    pipe.close()


def test_stage_list_that_does_not_match_the_transports_world() -> None:
    world = InprocWorld(2)
    with pytest.raises(ConfigError) as err:
        aioready.Pipeline(make_mlp_stages(3)[:2], mse_loss, microbatches=2,
                          transport=world.endpoint(0), num_stages=3)
    assert "transport's world of 2 ranks" in str(err.value)
    assert "expected stages == ranks (2), got stages=3" in str(err.value)
    with pytest.raises(ConfigError) as err2:
        aioready.Pipeline(make_mlp_stages(4)[:2], mse_loss, microbatches=2,
                          transport=world.endpoint(0), num_stages=2)
    assert "this rank's chunks" in str(err2.value) and "expected 1 modules" in str(err2.value)


def test_unknown_hint_name_lists_the_known_ones() -> None:
    with pytest.raises(HintError) as err:
        aioready.Pipeline(make_mlp_stages(2), mse_loss, microbatches=2, hint="2f2b")
    msg = str(err.value)
    assert "unknown hint" in msg and "'2f2b'" in msg and "1f1b" in msg and "gpipe" in msg


@pytest.mark.parametrize("cap", [0, -1, [1, 0]])
def test_cap_below_one(cap: object) -> None:
    with pytest.raises(ConfigError) as err:
        aioready.Pipeline(make_mlp_stages(2), mse_loss, microbatches=2, cap=cap)  # type: ignore[arg-type]
    assert "cap" in str(err.value) and "expected >= 1" in str(err.value)


def test_unknown_mode() -> None:
    with pytest.raises(ConfigError, match=r"mode.*expected ready \| strict, got 'eager'"):
        aioready.Pipeline(make_mlp_stages(2), mse_loss, microbatches=2, mode="eager")


def test_strict_mode_refuses_a_cap_below_the_hints_peak() -> None:
    with pytest.raises(ConfigError, match=r"rank 0.*peak in-flight \(2\).*got 1"):
        aioready.Pipeline(make_mlp_stages(2), mse_loss, microbatches=4, mode="strict", cap=1)


@pytest.mark.parametrize("missing", ["inputs", "targets"])
async def test_missing_inputs_or_targets_are_the_same_config_error(missing: str) -> None:
    """Both ends of the pipeline refuse a missing batch before any stage runs (targets used to
    surface as a StageError from inside loss_fn); the pipeline then runs a proper step."""
    stages = make_mlp_stages(2)
    pipe = aioready.Pipeline(stages, mse_loss, microbatches=2)
    x, y = torch.randn(4, 16, dtype=torch.float64), torch.randn(4, 16, dtype=torch.float64)
    with pytest.raises(ConfigError) as err:
        await pipe.step(None if missing == "inputs" else x, None if missing == "targets" else y)
    stage = "stage 0" if missing == "inputs" else "the last stage"
    assert stage in str(err.value) and "expected 2 microbatches, got None" in str(err.value)
    assert all(p.grad is None for s in stages for p in s.parameters())  # nothing ran
    assert float(await pipe.step(x, y)) > 0
    pipe.close()


async def test_a_loss_that_ignores_targets_takes_a_list_of_nones() -> None:
    pipe = aioready.Pipeline(make_mlp_stages(2), lambda out, _: out.square().mean(),
                             microbatches=2)
    assert float(await pipe.step(torch.randn(4, 16, dtype=torch.float64), [None, None])) > 0
    pipe.close()
