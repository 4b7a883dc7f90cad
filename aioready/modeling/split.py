"""`split(model, stages=S, layers="model.layers", ...)`: pipeline stages by module names.

For any model built as a sequence of blocks (a ModuleList) with modules before them (embeddings)
and after them (final norm, LM head). The stages share the model's modules, so the optimizer can
take `model.parameters()` or each stage's own; nothing is copied. Every parameter of the model
must belong to a stage: one that belongs to none (a module missing from `before` or `after`) is
refused by name, and so is one shared by stages on different ranks (an embedding tied to the head
on a linear placement), because over MPI each rank would train its own copy. Stages on one rank
share a parameter like one module does: its gradient is the sum of their contributions (the V
placement puts the first and last stage on rank 0, so a tied embedding and head just work).

Stages are returned in stage order, which is what an in-process `Pipeline` takes for any hint;
over MPI, `of_rank(rank)` gives a rank its chunks in chunk order under the split's placement,
which must be the placement of the hint run (it decides which rank already holds the context of
a microbatch, see stages.py).
"""

from __future__ import annotations

from typing import Any, Sequence

from torch import nn

from ..errors import ConfigError
from ..placement import STYLES, Placement
from .balance import check_counts, param_costs, partition, time_costs
from .stages import ContextStore, SplitStage, check_context

__all__ = ["split", "SplitStages"]


class SplitStages(list):  # type: ignore[type-arg]
    """The stage modules in stage order, with the placement and block counts they were cut for."""

    def __init__(self, stages: Sequence[SplitStage], placement: Placement,
                 counts: list[int]) -> None:
        super().__init__(stages)
        self.placement = placement
        self.counts = counts

    def of_rank(self, rank: int) -> list[SplitStage]:
        """The stages `rank` holds, in chunk order (what its `Pipeline(..., transport=)` takes)."""
        return [self[s] for s in self.placement.stages_of(rank)]

    def parameters_of(self, rank: int) -> list[nn.Parameter]:
        """The parameters of `rank`'s stages, each once (a tied one is in two): for its optimizer."""
        return list({id(p): p for s in self.of_rank(rank) for p in s.parameters()}.values())


def _module(model: nn.Module, name: str, what: str) -> nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError:
        names = [n for n, _ in model.named_modules() if n][:12]
        raise ConfigError(f"{what}: the model has no module {name!r}",
                          expected=f"a dotted module name such as {names}", got=name) from None


def _placement(placement: Any, num_stages: int, ranks: int | None) -> Placement:
    if isinstance(placement, Placement):
        if placement.num_stages != num_stages:
            raise ConfigError("placement is for another number of stages",
                              expected=num_stages, got=placement.num_stages)
        return placement
    style = "linear" if placement == "plain" else placement
    if style not in STYLES:
        raise ConfigError("placement", expected=f"a Placement or one of {STYLES}",
                          got=repr(placement))
    if ranks is None:
        ranks = num_stages if style == "linear" else num_stages // 2
    return Placement(num_stages, ranks, style)


def _check_ownership(model: nn.Module, groups: list[list[nn.Module]], where: Placement) -> None:
    owners: dict[int, set[int]] = {}
    for s, modules in enumerate(groups):
        for m in modules:
            for p in m.parameters():
                owners.setdefault(id(p), set()).add(s)
    for name, p in model.named_parameters():
        stages = sorted(owners.get(id(p), ()))
        if len({where.rank_of(s) for s in stages}) > 1:
            raise ConfigError(
                f"parameter {name!r} belongs to stages {stages[0]} and {stages[-1]}, on "
                f"different ranks", expected="a parameter shared by stages on one rank only",
                got="a tied parameter across ranks", fix="use placement='v' (the first and last "
                "stages share rank 0), untie it (e.g. tie_word_embeddings=False), or keep both "
                "modules on one stage")
    missing = [n for n, p in model.named_parameters() if id(p) not in owners]
    if missing:
        raise ConfigError("parameters in no stage", expected="every parameter of the model in "
                          "layers=, before= or after=", got=missing[:8],
                          fix="add their modules to before= or after=")


def split(model: nn.Module, *, stages: int, layers: str = "model.layers",
          before: Sequence[str] = (), after: Sequence[str] = (),
          balance: str | Sequence[int] = "params", placement: Any = "linear",
          ranks: int | None = None, sample: Any = None,
          forward_kwargs: dict[str, Any] | None = None) -> SplitStages:
    """Cut `model` into `stages` stage modules that share its parameters.

    `layers` names the ModuleList of blocks; `before` the modules the model's forward uses before
    the blocks (stage 0 runs that forward up to the first block); `after` the modules applied in
    order to the last block's output. `balance` is "params", "time" (a forward and backward of
    each block on `sample`, the model's inputs as a tuple) or a list of blocks per stage. With a
    `sample`, split also checks that every block gets the context the first one gets.
    `placement` is "linear" ("plain"), "interleaved", "v" or a Placement; `ranks` defaults to
    the hint's (S for linear, S/2 otherwise). `forward_kwargs` are passed to the model's forward
    (e.g. {"use_cache": False}).
    """
    if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
        raise ConfigError("stages must be a positive integer", expected=">= 1", got=stages)
    blocks = _module(model, layers, "layers")
    if not isinstance(blocks, (nn.ModuleList, nn.Sequential)):
        raise ConfigError(f"layers={layers!r} is not a list of blocks",
                          expected="an nn.ModuleList", got=type(blocks).__name__)
    blocks = list(blocks)
    head = [_module(model, n, "before") for n in before]
    tail = [_module(model, n, "after") for n in after]
    where = _placement(placement, stages, ranks)
    fkw = dict(forward_kwargs or {})
    if sample is not None:
        sample = sample if isinstance(sample, tuple) else (sample,)
        check_context(model, blocks, sample, fkw)
    if isinstance(balance, str):
        if balance == "params":
            costs, first, last = param_costs(blocks, head, tail)
        elif balance == "time":
            if sample is None:
                raise ConfigError("balance='time' measures blocks on a sample",
                                  expected="sample=(inputs of the model,)", got=None)
            costs, first, last = time_costs(model, blocks, tail, sample, fkw)
        else:
            raise ConfigError("balance", expected="'params', 'time' or a list of block counts",
                              got=repr(balance))
        counts = partition(costs, stages, first=first, last=last)
    else:
        counts = check_counts(balance, len(blocks), stages)
    starts = [sum(counts[:s]) for s in range(stages)]
    slices = [blocks[a:a + n] for a, n in zip(starts, counts)]
    _check_ownership(model, [(head if s == 0 else []) + slices[s] +
                             (tail if s == stages - 1 else []) for s in range(stages)], where)
    stores = [ContextStore(r) for r in range(where.num_ranks)]
    out = []
    for s in range(stages):
        rank = where.rank_of(s)
        mine = where.stages_of(rank)
        nxt = s + 1
        out.append(SplitStage(
            index=s, num_stages=stages, model=model, blocks=slices[s], before=head, after=tail,
            store=stores[rank], keep_context=any(t > s for t in mine),
            # the next stage's rank has the context already if it holds an earlier stage
            send_context=nxt < stages and not any(
                t < nxt for t in where.stages_of(where.rank_of(min(nxt, stages - 1)))),
            forward_kwargs=fkw))
    return SplitStages(out, where, counts)
