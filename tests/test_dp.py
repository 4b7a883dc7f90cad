"""Data parallelism without MPI: bucket plans, the bucket-size setting, the protocol, and the
train command's refusals (the MPI runs are tests/test_dp_mpi.py)."""

from __future__ import annotations

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


def test_train_config_refuses_tp_and_bad_dp() -> None:
    with pytest.raises(ConfigError, match="no tensor-parallel layers"):
        TrainConfig(tp=2)
    with pytest.raises(ConfigError, match="dp must be >= 1"):
        TrainConfig(dp=0)
