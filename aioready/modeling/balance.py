"""How many blocks each stage gets: a contiguous partition that minimises the costliest stage.

Costs are per block, plus the modules before the blocks (charged to stage 0) and after them
(charged to the last stage): parameter counts, or the measured time of a forward and backward on
a sample microbatch. The partition is exact (dynamic programming over prefix sums, O(S L^2) for
L blocks and S stages), so a big embedding or LM head gets fewer blocks beside it.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch
from torch import nn

from ..errors import ConfigError

__all__ = ["partition", "param_costs", "time_costs", "check_counts"]


def check_counts(counts: Sequence[int], num_blocks: int, num_stages: int) -> list[int]:
    """An explicit list of blocks per stage, validated."""
    counts = list(counts)
    if len(counts) != num_stages or any(not isinstance(c, int) or c < 1 for c in counts) or \
            sum(counts) != num_blocks:
        raise ConfigError("balance: a list gives the blocks of each stage",
                          expected=f"{num_stages} counts >= 1 summing to {num_blocks}",
                          got=counts)
    return counts


def partition(costs: Sequence[float], num_stages: int, *, first: float = 0.0,
              last: float = 0.0) -> list[int]:
    """Blocks per stage (each >= 1) minimising the largest stage cost."""
    L, S = len(costs), num_stages
    if L < S:
        raise ConfigError("more stages than blocks", expected=f"stages <= {L} blocks",
                          got=f"stages={S}", fix="use fewer stages or a model with more blocks")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(s: int, i: int, j: int) -> float:  # stage s holds blocks i..j-1
        extra = (first if s == 0 else 0.0) + (last if s == S - 1 else 0.0)
        return prefix[j] - prefix[i] + extra

    inf = float("inf")
    # best[s][j]: the least max cost placing blocks 0..j-1 on stages 0..s
    best = [[inf] * (L + 1) for _ in range(S)]
    cut = [[0] * (L + 1) for _ in range(S)]
    for j in range(1, L + 1):
        best[0][j] = cost(0, 0, j)
    for s in range(1, S):
        for j in range(s + 1, L + 1):
            for i in range(s, j):
                v = max(best[s - 1][i], cost(s, i, j))
                if v < best[s][j]:
                    best[s][j], cut[s][j] = v, i
    counts, j = [], L
    for s in range(S - 1, 0, -1):
        i = cut[s][j]
        counts.append(j - i)
        j = i
    counts.append(j)
    return counts[::-1]


def _numel(modules: Sequence[nn.Module], seen: set[int]) -> float:
    n = 0
    for m in modules:
        for p in m.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                n += p.numel()
    return float(n)


def param_costs(blocks: Sequence[nn.Module], before: Sequence[nn.Module],
                after: Sequence[nn.Module]) -> tuple[list[float], float, float]:
    seen: set[int] = set()
    return ([_numel([b], seen) for b in blocks], _numel(before, seen), _numel(after, seen))


def _timed(fn: Any, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _fb(out: Any) -> None:
    from .stages import hidden_of
    out = hidden_of(out)
    if isinstance(out, torch.Tensor) and out.requires_grad:
        out.float().sum().backward()


def time_costs(model: nn.Module, blocks: Sequence[nn.Module], after: Sequence[nn.Module],
               sample: tuple[Any, ...], forward_kwargs: dict[str, Any], *,
               repeats: int = 3) -> tuple[list[float], float, float]:
    """Seconds of forward + backward of each block, the pre-block code and the after modules,
    on `sample` (the best of `repeats`); gradients it leaves are cleared."""
    from .stages import capture_block_input, hidden_of
    first = _timed(lambda: _fb(capture_block_input(model, blocks[0], sample,
                                                   forward_kwargs)[0]), repeats)
    hidden, ctx = capture_block_input(model, blocks[0], sample, forward_kwargs)
    args, kwargs = ctx["args"], ctx["kwargs"]
    costs = []
    x = hidden.detach()
    for block in blocks:
        inp = x.requires_grad_(x.is_floating_point())
        costs.append(_timed(lambda: _fb(block(inp, *args, **kwargs)), repeats))
        with torch.no_grad():
            x = hidden_of(block(x.detach(), *args, **kwargs)).detach()

    def tail() -> None:
        h = x.detach().requires_grad_(x.is_floating_point())
        for m in after:
            h = m(h)
        _fb(h)
    last = _timed(tail, repeats) if after else 0.0
    model.zero_grad(set_to_none=True)
    return costs, first, last
