"""A tiny GPT-style language model split into pipeline stages, for examples, demos and tests.

Stage 0 holds the token and position embeddings, every stage holds `layers_per_stage` pre-norm
transformer blocks (causal self-attention and an MLP), and the last stage ends in a final
LayerNorm and the LM head. Weights come from one seeded generator in stage order, so every MPI
rank can build the whole model and keep only its own stages, and get the same weights. Sequence
length may differ between microbatches (up to `seq`): positions are taken from the input's length.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["GPTBlock", "GPTStage", "gpt_stages", "lm_loss"]


class GPTBlock(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim must be a multiple of heads (got dim={dim}, heads={heads})")
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=-1)
        shape = (B, T, self.heads, D // self.heads)
        q, k, v = (t.reshape(shape).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(D // self.heads)
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, D)
        x = x + self.proj(y)
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class GPTStage(nn.Module):
    """One pipeline stage: optional embeddings (first), blocks, optional norm + head (last)."""

    def __init__(self, *, first: bool, last: bool, vocab: int, dim: int, heads: int,
                 layers: int, seq: int) -> None:
        super().__init__()
        self.seq = seq
        self.tok = nn.Embedding(vocab, dim) if first else None
        self.pos = nn.Embedding(seq, dim) if first else None
        self.blocks = nn.ModuleList(GPTBlock(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim) if last else None
        self.head = nn.Linear(dim, vocab, bias=False) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok is not None and self.pos is not None:
            T = x.shape[1]
            if T > self.seq:
                raise ValueError(f"sequence of {T} tokens is longer than the model's "
                                 f"seq={self.seq}")
            x = self.tok(x) + self.pos(torch.arange(T, device=x.device))
        for block in self.blocks:
            x = block(x)
        if self.ln_f is not None and self.head is not None:
            x = self.head(self.ln_f(x))
        return x


def gpt_stages(num_stages: int, *, vocab: int = 256, dim: int = 64, heads: int = 4,
               layers_per_stage: int = 1, seq: int = 64, seed: int = 0,
               dtype: torch.dtype = torch.float32) -> list[nn.Module]:
    """The model's stages, in order; the same `seed` gives the same weights in every process."""
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1 (got {num_stages})")
    stages: list[nn.Module] = [
        GPTStage(first=s == 0, last=s == num_stages - 1, vocab=vocab, dim=dim, heads=heads,
                 layers=layers_per_stage, seq=seq) for s in range(num_stages)]
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for stage in stages:
            for name, p in stage.named_parameters():
                if name.endswith("bias"):
                    p.zero_()
                elif ".ln" in name or name.startswith("ln_"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return [s.to(dtype) for s in stages]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; `targets` are the token ids the logits should predict."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
