"""Data parallelism without MPI: bucket plans, the bucket-size setting, the protocol, and the
train command's refusals (the MPI runs are tests/test_dp_mpi.py)."""

from __future__ import annotations

import math

import pytest
import torch

from aioready.cli.trainer import TrainConfig
from aioready.dp.reducer import DEFAULT_BUCKET_BYTES, plan_buckets, resolve_bucket_bytes
from aioready.errors import ConfigError


def test_buckets_split_by_size_and_dtype() -> None:
    params = [torch.zeros(10, dtype=torch.float64), torch.zeros(10, dtype=torch.float64),
              torch.zeros(30, dtype=torch.float64), torch.zeros(4, dtype=torch.float32),
              torch.zeros(2, dtype=torch.float64)]
    plan = plan_buckets(params, bucket_bytes=160)
    assert [[p.numel() for p in b] for b in plan] == [[10, 10], [30], [4], [2]]


def test_bucket_size_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIOREADY_DP_BUCKET_MB", raising=False)
    assert resolve_bucket_bytes() == DEFAULT_BUCKET_BYTES
    monkeypatch.setenv("AIOREADY_DP_BUCKET_MB", "0.5")
    assert resolve_bucket_bytes() == 1 << 19
    assert resolve_bucket_bytes(1000) == 1000
    monkeypatch.setenv("AIOREADY_DP_BUCKET_MB", "lots")
    with pytest.raises(ConfigError, match="AIOREADY_DP_BUCKET_MB"):
        resolve_bucket_bytes()


def test_train_config_refuses_bad_sizes() -> None:
    with pytest.raises(ConfigError, match="dp must be >= 1"):
        TrainConfig(dp=0)
    with pytest.raises(ConfigError, match="tp must be >= 1"):
        TrainConfig(tp=0)


# -- cross-stage reductions in one process, against the unsplit model --------------------------
import copy  # noqa: E402

from torch import nn  # noqa: E402

from aioready.dp.cross_stage import GradScaler  # noqa: E402
from aioready.runtime.pipeline import Pipeline  # noqa: E402
from aioready.testing.helpers import make_mlp_stages, max_grad_diff, mse_loss  # noqa: E402

TOL = 1e-10
S, M, WIDTH = 4, 4, 16


def data(seed: int = 5, varlen: bool = False) -> tuple[list, list]:
    gen = torch.Generator().manual_seed(seed)
    rows = [1 + m for m in range(M)] if varlen else [2] * M
    xs = [torch.randn(r, 3, WIDTH, generator=gen, dtype=torch.float64) for r in rows]
    ys = [torch.randn(r, 3, WIDTH, generator=gen, dtype=torch.float64) for r in rows]
    return xs, ys


def unsplit(stages: list[nn.Module], xs: list, ys: list, weights: list[float] | None = None
            ) -> tuple[float, list[nn.Module]]:
    """The whole model (one deepcopy, so tied parameters stay shared) on every microbatch."""
    model = copy.deepcopy(nn.Sequential(*stages))
    total = 0.0
    norm = sum(weights) if weights else len(xs)
    for m, (x, y) in enumerate(zip(xs, ys)):
        loss = mse_loss(model(x), y) * (weights[m] if weights else 1.0) / norm
        loss.backward()
        total += float(loss.detach())
    return total, list(model)


async def run_pipe(stages: list[nn.Module], xs: list, ys: list, **kw: object) -> tuple:
    pipe = Pipeline(stages, kw.pop("loss_fn", mse_loss), microbatches=M,  # type: ignore[arg-type]
                    split_backward=True, **kw)  # type: ignore[arg-type]
    try:
        loss = await pipe.step(xs, ys)
    except BaseException:
        pipe.close()
        raise
    return pipe, loss


async def test_clip_grad_norm_equals_torch_on_the_unsplit_model() -> None:
    xs, ys = data()
    stages = make_mlp_stages(S, width=WIDTH, seed=3)
    ref_loss, ref = unsplit(stages, xs, ys)
    want = torch.nn.utils.clip_grad_norm_([p for s in ref for p in s.parameters()], 0.05)
    pipe, loss = await run_pipe(stages, xs, ys)
    norm = await pipe.clip_grad_norm_(0.05)
    pipe.close()
    assert float(want) > 0.05  # the clip really scaled the gradients
    assert abs(float(norm) - float(want)) <= TOL
    assert max_grad_diff(stages, ref) <= TOL
    assert abs(float(loss) - ref_loss) <= TOL


def weighted_mse(out: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
    return mse_loss(out, target), out.shape[0]  # weight: the rows of the microbatch


async def test_token_weighted_loss_and_per_microbatch_losses() -> None:
    xs, ys = data(varlen=True)
    stages = make_mlp_stages(S, width=WIDTH, seed=4)
    weights = [float(x.shape[0]) for x in xs]
    ref_loss, ref = unsplit(stages, xs, ys, weights)
    mean_loss, mean_ref = unsplit(stages, xs, ys)
    pipe, loss = await run_pipe(stages, xs, ys, loss_fn=weighted_mse, normalize="weight")
    pipe.close()
    assert abs(ref_loss - mean_loss) > 1e-4  # the weights change the result
    assert max_grad_diff(ref, mean_ref) > 1e-4
    assert abs(float(loss) - ref_loss) <= TOL
    assert max_grad_diff(stages, ref) <= TOL
    losses = pipe.last_losses
    assert [w for _, w in losses] == weights
    with torch.no_grad():
        model = nn.Sequential(*make_mlp_stages(S, width=WIDTH, seed=4))
        expect = [float(mse_loss(model(x), y)) for x, y in zip(xs, ys)]
    assert max(abs(a - b) for (a, _), b in zip(losses, expect)) <= TOL


async def test_loss_fn_form_must_match_normalize() -> None:
    xs, ys = data()
    with pytest.raises(Exception, match="returned \\(loss, weight\\)"):
        await run_pipe(make_mlp_stages(S, width=WIDTH), xs, ys, loss_fn=weighted_mse)
    with pytest.raises(ConfigError, match="normalize"):
        Pipeline(make_mlp_stages(S, width=WIDTH), mse_loss, normalize="tokens")


def tied_stages() -> list[nn.Module]:
    """The first stage's first Linear and the last stage's last Linear share one weight."""
    stages = make_mlp_stages(S, width=WIDTH, seed=6)
    stages[0].insert(0, nn.Linear(WIDTH, WIDTH, bias=False).double())
    stages[0][0].weight = stages[-1][-1].weight
    return stages


async def test_tied_weights_sum_their_gradients() -> None:
    xs, ys = data()
    ref_loss, ref = unsplit(tied_stages(), xs, ys)
    stages = [copy.deepcopy(s) for s in tied_stages()]  # separate copies, as on two ranks
    assert stages[0][0].weight is not stages[-1][-1].weight
    pipe, loss = await run_pipe(stages, xs, ys,
                                tied={"proj": {0: "0.weight", S - 1: "2.weight"}})
    norm = await pipe.clip_grad_norm_(1e9)
    pipe.close()
    assert torch.equal(stages[0][0].weight.grad, stages[-1][-1].weight.grad)
    assert max_grad_diff(stages, ref) <= TOL
    want = torch.nn.utils.clip_grad_norm_(nn.Sequential(*ref).parameters(), 1e9)  # shared once
    assert abs(float(norm) - float(want)) <= TOL
    assert abs(float(loss) - ref_loss) <= TOL


async def test_tied_weight_errors() -> None:
    with pytest.raises(ConfigError, match="no parameter 'nope'"):
        Pipeline(make_mlp_stages(S, width=WIDTH), mse_loss, microbatches=M,
                 tied={"t": {0: "nope", 1: "0.up.weight"}})
    with pytest.raises(ConfigError, match="two or more"):
        Pipeline(make_mlp_stages(S, width=WIDTH), mse_loss, microbatches=M,
                 tied={"t": {0: "0.up.weight"}})


async def test_grad_scaler_unscales_exactly_and_skips_on_inf() -> None:
    xs, ys = data()
    stages = make_mlp_stages(S, width=WIDTH, seed=7)
    ref_loss, ref = unsplit(stages, xs, ys)
    scaler = GradScaler(2.0 ** 10)
    pipe = Pipeline(stages, mse_loss, microbatches=M, scaler=scaler)
    loss = await pipe.step(xs, ys)
    assert not scaler.found_inf and max_grad_diff(stages, ref) <= TOL
    assert abs(float(loss) - ref_loss) <= TOL
    opt = torch.optim.SGD([p for s in stages for p in s.parameters()], lr=0.1)
    assert scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    before = [p.detach().clone() for s in stages for p in s.parameters()]
    handle = stages[1][0].up.weight.register_hook(lambda g: g * float("inf"))
    await pipe.step(xs, ys)
    handle.remove()
    pipe.close()
    assert scaler.found_inf and not scaler.step(opt)
    scaler.update()
    assert scaler.scale == 2.0 ** 9
    assert all(torch.equal(a, p) for a, p in zip(before, [p for s in stages
                                                          for p in s.parameters()]))


class _Probe(nn.Module):
    """Records whether autocast is on where the stage's forward runs (the device thread)."""

    def __init__(self, inner: nn.Module, seen: list) -> None:
        super().__init__()
        self.inner = inner
        self.seen = seen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(torch.is_autocast_enabled("cpu"))
        return self.inner(x)


async def test_autocast_reaches_the_device_thread() -> None:
    xs, ys = data()
    xs = [x.float() for x in xs]
    ys = [y.float() for y in ys]
    for autocast, want in ((None, False), (torch.bfloat16, True)):
        seen: list = []
        stages = [_Probe(s.float(), seen) for s in make_mlp_stages(S, width=WIDTH)]
        pipe = Pipeline(stages, mse_loss, microbatches=M, autocast=autocast)
        loss = await pipe.step(xs, ys)
        pipe.close()
        assert seen == [want] * (S * M), (autocast, seen)
        assert math.isfinite(float(loss))
        assert all(p.grad.dtype == torch.float32 for s in stages for p in s.parameters())


async def test_reductions_over_ranks_in_other_processes_need_a_grid() -> None:
    """With a transport but no grid a rank sees only its stages: refuse, never reduce locally."""
    from aioready.transports.inproc import InprocWorld
    stages = make_mlp_stages(2, width=WIDTH)
    pipe = Pipeline([stages[0]], mse_loss, microbatches=M, transport=InprocWorld(2).endpoint(0))
    with pytest.raises(ConfigError, match="clip_grad_norm_ reduce over every rank"):
        await pipe.clip_grad_norm_(1.0)
    pipe.close()
    with pytest.raises(ConfigError, match="grid=ProcessGrid"):
        Pipeline([stages[0]], mse_loss, microbatches=M, transport=InprocWorld(2).endpoint(0),
                 scaler=GradScaler())
