"""The stage module `split` builds: a slice of a model's blocks, with what comes before and after.

No tracer. Stage 0 runs the model's own forward and stops it at the entry of the first block
(a forward pre-hook raises), which yields exactly what the model passes to its blocks: the
hidden state and the *context*, the other arguments (attention mask, position ids, rotary
cos/sin, flags). Whatever glue the model computes before its blocks is thus the model's own code,
run unchanged. Every block is then called as `block(hidden, *context_args, **context_kwargs)`
(a block may return a tensor or a tuple whose first item is the hidden state), and the last stage
applies the `after` modules in order.

The context does not change from block to block, so it is not re-sent at every hop: it travels
with the hidden state only to a rank that has not seen the microbatch yet, and every rank keeps
it in its `ContextStore` for its later chunks (with V or interleaved placements a rank's second
chunk reuses what its first received). Rebuilding it locally would need the model's inputs on
every rank and its pre-block code re-run there; sending it once per rank needs neither.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from ..errors import ConfigError, StageError
from .context import running_microbatch

__all__ = ["SplitStage", "ContextStore", "capture_block_input", "hidden_of", "check_context"]

Context = dict[str, Any]  # {"args": tuple, "kwargs": dict}


class _Entered(BaseException):
    """Raised by the pre-hook to stop the model's forward at its first block (a BaseException,
    so a model's own `except Exception` cannot swallow it)."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.call = (args, kwargs)


def capture_block_input(model: nn.Module, block: nn.Module, inputs: tuple[Any, ...],
                        kwargs: dict[str, Any]) -> tuple[torch.Tensor, Context]:
    """Run `model(*inputs, **kwargs)` up to the entry of `block`; return its hidden state and
    the rest of the call."""
    def stop(_: nn.Module, args: tuple[Any, ...], kw: dict[str, Any]) -> None:
        raise _Entered(args, kw)

    handle = block.register_forward_pre_hook(stop, with_kwargs=True)
    try:
        model(*inputs, **kwargs)
    except _Entered as entered:
        args, kw = entered.call
    else:
        raise ConfigError("the model's forward never called its first block",
                          expected="a forward that runs the blocks named by layers=",
                          got=f"{type(model).__name__} returned without calling it")
    finally:
        handle.remove()
    if not args or not isinstance(args[0], torch.Tensor):
        raise ConfigError("the first block is not called with the hidden state first",
                          expected="block(hidden_states, ...) with a positional tensor",
                          got=f"args {[type(a).__name__ for a in args]}, kwargs {sorted(kw)}")
    return args[0], {"args": tuple(args[1:]), "kwargs": dict(kw)}


def check_context(model: nn.Module, blocks: Sequence[nn.Module], sample: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> None:
    """Run the model once on `sample` and refuse it if a block gets another context than the
    first (e.g. alternating sliding-window masks), naming the block and the argument."""
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    handles = [b.register_forward_pre_hook(lambda _, a, kw: calls.append((a, kw)),
                                           with_kwargs=True) for b in blocks]
    try:
        with torch.no_grad():
            model(*sample, **kwargs)
    finally:
        for h in handles:
            h.remove()
    first_args, first_kw = calls[0]
    for i, (args, kw) in enumerate(calls[1:len(blocks)], start=1):
        diff = [f"argument {j}" for j, (a, b) in enumerate(zip(args[1:], first_args[1:]), 1)
                if a is not b] + [repr(k) for k in sorted(set(kw) | set(first_kw))
                                  if kw.get(k) is not first_kw.get(k)]
        if diff or len(args) != len(first_args):
            raise ConfigError(f"block {i} is called with another context than block 0",
                              expected="the same extra arguments for every block",
                              got=f"{diff or 'another argument count'} differ",
                              fix="compute per-block arguments inside the blocks")


def hidden_of(output: Any) -> torch.Tensor:
    """A block's hidden state: the output itself or the first item of a tuple (older models)."""
    return output[0] if isinstance(output, (tuple, list)) else output


class ContextStore:
    """One rank's context per microbatch; an entry is replaced by the next step's."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._by_mb: dict[int | None, Context] = {}

    def put(self, ctx: Context) -> None:
        self._by_mb[running_microbatch()] = ctx

    def get(self, stage: int) -> Context:
        mb = running_microbatch()
        if mb not in self._by_mb:
            raise StageError(
                f"stage {stage} on rank {self.rank} has no context for microbatch {mb}",
                expected="the split's placement to be the pipeline's",
                got="a rank that did not see this microbatch before",
                fix="pass split(..., placement=) the placement of the hint you run")
        return self._by_mb[mb]

    def __len__(self) -> int:
        return len(self._by_mb)


class SplitStage(nn.Module):
    """Stage `index` of a split model; holds (shares) the model's modules it computes."""

    def __init__(self, *, index: int, num_stages: int, model: nn.Module,
                 blocks: Sequence[nn.Module], before: Sequence[nn.Module],
                 after: Sequence[nn.Module], store: ContextStore, keep_context: bool,
                 send_context: bool, forward_kwargs: dict[str, Any] | None) -> None:
        super().__init__()
        self.index = index
        self.is_first = index == 0
        self.is_last = index == num_stages - 1
        self.before = nn.ModuleList(before if self.is_first else ())
        self.blocks = nn.ModuleList(blocks)
        self.after = nn.ModuleList(after if self.is_last else ())
        # not registered: its parameters belong to every stage's modules, not to each stage
        self.__dict__["_model"] = model
        self.__dict__["_first_block"] = blocks[0] if self.is_first and blocks else None
        self._store = store
        self._keep = keep_context
        self._send = send_context
        self._forward_kwargs = dict(forward_kwargs or {})

    def forward(self, *inputs: Any) -> Any:
        if self.is_first:
            hidden, ctx = capture_block_input(self._model, self._first_block, inputs,
                                              self._forward_kwargs)
        else:
            hidden = inputs[0]
            ctx = inputs[1] if len(inputs) > 1 else self._store.get(self.index)
        if self._keep:
            self._store.put(ctx)
        args, kwargs = ctx["args"], ctx["kwargs"]
        for block in self.blocks:
            hidden = hidden_of(block(hidden, *args, **kwargs))
        if self.is_last:
            for module in self.after:
                hidden = module(hidden)
            return hidden
        return (hidden, ctx) if self._send else hidden

    def extra_repr(self) -> str:
        return (f"index={self.index}, blocks={len(self.blocks)}, sends_context={self._send}, "
                f"keeps_context={self._keep}")
