"""Megatron-style tensor-parallel layers: column- and row-parallel Linear inside MLP blocks.

A block `x + down(gelu(up(norm(x))))` (aioready.testing.Block) splits over a TP group of size T:
`up` is column-parallel (each member holds hidden/T output rows), `down` row-parallel (each holds
hidden/T input columns), so the hidden activation never leaves its member and the block needs
exactly two all-reduces (Megatron's f and g, Shoeybi et al. 2019, sec. 3):
- f (`copy_to_tp`): identity forward, all-reduce of the input gradient in backward;
- g (`reduce_from_tp`): all-reduce of the partial outputs in forward, identity backward.
LayerNorm, the row-parallel bias and the last stage's projection are replicated; their gradients
come out equal on every member because f/g make the gradients that reach them full.
The collectives are aioready.tp.collectives' (tagged, with a deadline); weight-gradient tasks (W)
issue none, since both layers' weight gradients are local products.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from ..testing.helpers import Block, make_mlp_stages
from .collectives import TPComm

__all__ = ["copy_to_tp", "reduce_from_tp", "ColumnParallelLinear", "RowParallelLinear",
           "TPBlock", "make_tp_mlp_stages", "shard_stage", "shard_gpt_mlps", "max_tp_grad_diff"]


def _allreduce(t: torch.Tensor, comm: TPComm) -> torch.Tensor:
    out = t.detach().contiguous().clone()
    on_device = getattr(comm, "allreduce_tensor_", None)  # TorchTPComm: CUDA tensors stay put
    if on_device is not None:
        on_device(out)
    else:
        comm.allreduce_(out.numpy())
    return out


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: TPComm) -> torch.Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _allreduce(grad, ctx.comm), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: TPComm) -> torch.Tensor:
        return _allreduce(x, comm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_tp(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    """Megatron's f: the input enters a column-parallel region."""
    return _CopyToTP.apply(x, comm)  # type: ignore[no-any-return]


def reduce_from_tp(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    """Megatron's g: the partial outputs of a row-parallel region are summed."""
    return _ReduceFromTP.apply(x, comm)  # type: ignore[no-any-return]


def _shard(t: torch.Tensor, dim: int, comm: TPComm) -> torch.Tensor:
    if t.shape[dim] % comm.size:
        raise ValueError(f"dimension {dim} of size {t.shape[dim]} does not split over "
                         f"{comm.size} TP ranks")
    return t.detach().chunk(comm.size, dim)[comm.rank].clone()


class ColumnParallelLinear(nn.Module):
    """y_t = x W_t^T + b_t: this member's slice of the output features."""

    def __init__(self, full: nn.Linear, comm: TPComm) -> None:
        super().__init__()
        self.comm = comm
        self.weight = nn.Parameter(_shard(full.weight, 0, comm))
        self.weight.tp_shard_dim = 0  # type: ignore[attr-defined]
        self.bias = nn.Parameter(_shard(full.bias, 0, comm))
        self.bias.tp_shard_dim = 0  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(copy_to_tp(x, self.comm), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = sum_t x_t W_t^T + b: this member's slice of the input features; b is replicated."""

    def __init__(self, full: nn.Linear, comm: TPComm) -> None:
        super().__init__()
        self.comm = comm
        self.weight = nn.Parameter(_shard(full.weight, 1, comm))
        self.weight.tp_shard_dim = 1  # type: ignore[attr-defined]
        self.bias = nn.Parameter(full.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_tp(nn.functional.linear(x, self.weight), self.comm) + self.bias


class TPBlock(nn.Module):
    """aioready.testing.Block split over a TP group (same parameter order as Block)."""

    def __init__(self, full: Block, comm: TPComm) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(full.norm.normalized_shape, dtype=full.norm.weight.dtype)
        self.norm.load_state_dict(full.norm.state_dict())
        self.up = ColumnParallelLinear(full.up, comm)
        self.down = RowParallelLinear(full.down, comm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def shard_stage(stage: nn.Sequential, comm: TPComm) -> nn.Sequential:
    """This member's copy of a stage: each Block becomes a TPBlock, other layers replicate."""
    import copy
    layers = [TPBlock(m, comm) if isinstance(m, Block) else copy.deepcopy(m) for m in stage]
    return nn.Sequential(*layers)


def shard_gpt_mlps(stage: nn.Module, comm: TPComm) -> nn.Module:
    """Split the MLP of every GPT block in `stage` over the TP group, in place (up column-,
    down row-parallel, as in TPBlock); attention, norms, embeddings and head stay replicated.
    Parameter names do not change, so checkpoints name the same tensors (sharded)."""
    from ..testing.models import GPTBlock
    for block in [m for m in stage.modules() if isinstance(m, GPTBlock)]:
        block.up = ColumnParallelLinear(block.up, comm)  # type: ignore[assignment]
        block.down = RowParallelLinear(block.down, comm)  # type: ignore[assignment]
    return stage


def make_tp_mlp_stages(num_stages: int, comm: TPComm, **kwargs: Any
                       ) -> tuple[list[nn.Module], list[nn.Module]]:
    """(full stages, this member's TP stages) of aioready.testing.make_mlp_stages(**kwargs)."""
    full = make_mlp_stages(num_stages, **kwargs)
    return full, [shard_stage(s, comm) for s in full]  # type: ignore[arg-type]


def max_tp_grad_diff(full: Sequence[nn.Module], tp: Sequence[nn.Module], comm: TPComm
                     ) -> float:
    """Largest difference between this member's gradients and its slices of the full ones.

    Comparing every member's shard with its slice on every member checks the same thing as
    gathering the shards and comparing whole tensors, without moving gradients.
    """
    worst = 0.0
    pairs = list(zip([p for s in full for p in s.parameters()],
                     [p for s in tp for p in s.parameters()], strict=True))
    for ref, mine in pairs:
        want = ref.grad if ref.grad is not None else torch.zeros_like(ref)
        dim = getattr(mine, "tp_shard_dim", None)
        if dim is not None:
            want = want.chunk(comm.size, dim)[comm.rank]
        got = mine.grad if mine.grad is not None else torch.zeros_like(mine)
        if got.shape != want.shape:
            raise ValueError(f"shard shape {tuple(got.shape)} != slice {tuple(want.shape)}")
        worst = max(worst, float((got - want).abs().max()))
    return worst
