"""StageExecutor: runs one stage's torch module for F, B and W of each microbatch.

Forward keeps what backward needs, per microbatch (a dict keyed by microbatch, never a FIFO:
tasks run out of order). Full backward (B unsplit) calls autograd once and accumulates parameter
gradients into the module. Split backward follows the method torch.distributed.pipelining uses,
written here from its description (docs/architecture.md "Split backward"):

- B computes only the input gradient. Before it runs, we find the *intermediates*: nodes of the
  graph whose gradient is known after the input-gradient pass (they lie on the path from the
  outputs to the inputs, or are outputs) and that have a child leading to a parameter off that
  path. Prehooks on them stash the gradient that flows in during the input-gradient pass.
- W runs autograd from those intermediates (as GradientEdges, seeded with the stashed gradients)
  to the parameters. When every parameter hangs off one intermediate only (the usual case), W runs
  one small autograd call per intermediate, asking only for that intermediate's own parameters,
  so autograd never walks the input-gradient path again. With shared parameters it runs one call
  from all intermediates, with prehooks that replace whatever flows into an intermediate by its
  stashed gradient, so nothing is counted twice (correct, but it recomputes part of B).
When the inputs need no gradient (stage 0) B does nothing and W is a full backward, as in torch.

A stage may take and return structures (dicts, tuples, small plain values): they cross the
boundary flattened (transports/structure.py). With `recompute`, F keeps only its inputs and B
recomputes the forward once (runtime/recompute.py).

Each F measures what its microbatch holds until its last backward piece: the bytes autograd
saved for backward during the module call (testing.memory.SavedTensorMeter: each storage once,
parameters excluded; it runs in the device's thread, where the forward runs), or with
`recompute` the inputs F keeps. `held_bytes(mb)` reads it (held_bytes.py, the byte gate). Only
with `measure` (a byte budget, or asked for): the hooks cost a Python call per saved tensor.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch.autograd.graph import GradientEdge, Node

from ..errors import StageError
from ..modeling.context import microbatch_scope
from ..modeling.memory import tensor_bytes
from ..testing.memory import SavedTensorMeter
from ..transports.structure import flatten, is_schema, unflatten
from .recompute import Replay, capture, replaying

__all__ = ["StageExecutor", "as_tuple", "NORMALIZE"]

NORMALIZE = ("microbatches", "weight")  # how the last stage scales each microbatch's loss

LossFn = Callable[[Any, Any], torch.Tensor]


def as_tuple(value: Any) -> tuple[Any, ...]:
    return value if isinstance(value, tuple) else (value,)


def _node(t: torch.Tensor) -> Node:
    """The autograd node whose gradient is t's gradient (AccumulateGrad for leaves)."""
    if t.grad_fn is not None:
        return t.grad_fn
    return t.view_as(t).grad_fn.next_functions[0][0]  # type: ignore[union-attr]


@dataclass(slots=True)
class _Saved:
    inputs: tuple[Any, ...]
    outputs: tuple[Any, ...]
    stash: dict[Node, list[Any]] = field(default_factory=dict)
    owned: dict[Node, list[int]] | None = None
    grads: tuple[Any, ...] = ()
    full_backward_at_w: bool = False
    replay: Replay | None = None  # recompute: the forward is run again before B


class StageExecutor:
    """F, B and W of one stage; state is kept per microbatch until its last backward piece."""

    def __init__(self, module: torch.nn.Module, *, stage: int, num_stages: int,
                 loss_fn: LossFn | None, num_microbatches: int, recompute: bool = False,
                 normalize: str = "microbatches", autocast: Any = None,
                 measure: bool = False) -> None:
        self.module = module
        self.recompute = recompute
        self.stage = stage
        self.is_first = stage == 0
        self.is_last = stage == num_stages - 1
        self.loss_fn = loss_fn
        self.num_microbatches = num_microbatches
        self._saved: dict[int, _Saved] = {}
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._param_node_list: list[Node] | None = None
        self.num_split_fallbacks = 0
        self.normalize = normalize
        self.autocast = autocast  # a dtype: forward runs under torch.autocast in this thread
        self.loss_scale = 1.0  # a GradScaler's factor on the backward root, set every step
        self.losses: dict[int, tuple[torch.Tensor, Any]] = {}  # mb -> (loss, weight) this step
        self._bytes: dict[int, int] = {}  # mb -> bytes its last F keeps for backward
        self.measure = measure  # off: no hooks in the forward (a compiled module may refuse them)

    def held_bytes(self, mb: int) -> int:
        """The bytes the last forward of `mb` keeps until its backward (None when not measured:
        a StageExecutor measures with `measure=True`)."""
        return self._bytes.get(mb) if self.measure else None

    def _autocast(self) -> Any:
        """torch.autocast for the module's device: a context opened around `step()` on the
        loop thread does not reach the device's worker thread, so the stage opens its own."""
        if self.autocast is None:
            return contextlib.nullcontext()
        kind = self._params[0].device.type if self._params else "cpu"
        return torch.autocast(kind, dtype=self.autocast)

    def _loss(self, mb: int, out: Any, target: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(the backward root, the loss reported) of microbatch `mb` on the last stage.

        normalize="microbatches": loss / M. normalize="weight": loss_fn returns (loss, weight)
        and the stage reports loss * weight; the Pipeline divides the step's gradients and loss
        by the sum of the weights once every microbatch is known (aioready/dp/cross_stage.py).
        """
        if self.loss_fn is None:
            raise StageError("the last stage needs a loss_fn", expected="a callable", got=None)
        value = self.loss_fn(out, target)
        weighted = isinstance(value, tuple)
        if weighted != (self.normalize == "weight"):
            raise StageError(f"loss_fn of stage {self.stage} returned "
                             f"{'(loss, weight)' if weighted else 'a loss'}", task=f"F{mb}",
                             expected="(loss, weight) with normalize='weight', else a loss",
                             got=f"normalize={self.normalize!r}")
        loss, weight = value if weighted else (value, 1)
        self.losses[mb] = (loss.detach(), weight)
        total = loss * weight if weighted else loss / self.num_microbatches
        return (total * self.loss_scale if self.loss_scale != 1.0 else total), total

    def _prepare_inputs(self, inputs: tuple[Any, ...]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """The module's arguments, and the flat inputs as kept for backward."""
        if inputs and is_schema(inputs[0]):
            args, flat = unflatten(inputs, stage=self.stage, detach=not self.is_first)
            return args, flat
        if self.is_first:
            return inputs, inputs
        flat = tuple(
            x.detach().requires_grad_(x.is_floating_point() or x.is_complex())
            if isinstance(x, torch.Tensor) else x
            for x in inputs
        )
        return flat, flat

    def _run(self, mb: int, args: tuple[Any, ...], target: Any
             ) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """(flat outputs: what travels, or the loss reported on the last stage; what backward
        starts from: the same outputs, or the scaled loss root on the last stage)."""
        try:
            with self._autocast(), microbatch_scope(mb):
                out = self.module(*args)
                if self.is_last:
                    root, total = self._loss(mb, out, target)
                    return as_tuple(total), (root,)
            # without a graph (recompute's F) say which outputs will need a gradient at B
            flat = flatten(out, stage=self.stage, assume_grad=not torch.is_grad_enabled())
            return flat, flat
        except StageError:
            raise
        except Exception as exc:
            raise StageError(f"forward of stage {self.stage} raised "
                             f"{type(exc).__name__}: {exc}", task=f"F{mb}") from exc

    def forward(self, mb: int, inputs: tuple[Any, ...], target: Any = None) -> tuple[Any, ...]:
        """Run F; return what travels to the next stage (the loss on the last stage)."""
        args, flat = self._prepare_inputs(inputs)
        if self.recompute:
            replay = capture(args, target, self.module, flat)
            with torch.no_grad():
                outputs, _ = self._run(mb, args, target)
            self._saved[mb] = _Saved(flat, (), replay=replay)
            if self.measure:
                self._bytes[mb] = tensor_bytes(flat)
            return outputs
        if not self.measure:
            outputs, roots = self._run(mb, args, target)
        else:
            with SavedTensorMeter(self._params) as meter:
                outputs, roots = self._run(mb, args, target)
            self._bytes[mb] = meter.live
        self._saved[mb] = _Saved(flat, roots)
        return tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in outputs)

    def _saved_for_backward(self, mb: int, *, pop: bool) -> _Saved:
        """The microbatch's saved state, its forward recomputed first if F did not keep it."""
        saved = self._saved.pop(mb) if pop else self._saved[mb]
        if saved.replay is not None:
            replay, saved.replay = saved.replay, None
            with replaying(replay):
                _, saved.outputs = self._run(mb, replay.args, replay.target)
        return saved

    def _roots(self, saved: _Saved, grads: Sequence[Any] | None) -> tuple[list, list]:
        if self.is_last:
            return [saved.outputs[0]], [None]
        outs, gs = [], []
        for o, g in zip(saved.outputs, grads or ()):
            if isinstance(o, torch.Tensor) and o.requires_grad and g is not None:
                outs.append(o)
                gs.append(g)
        return outs, gs

    def _input_grads(self, saved: _Saved) -> tuple[Any, ...]:
        return tuple(
            x.grad if isinstance(x, torch.Tensor) and x.requires_grad else None
            for x in saved.inputs
        )

    def backward(self, mb: int, grads: Sequence[Any] | None) -> tuple[Any, ...]:
        """Full backward (B unsplit): accumulate parameter gradients, return input gradients."""
        saved = self._saved_for_backward(mb, pop=True)
        outs, gs = self._roots(saved, grads)
        try:
            if outs:
                torch.autograd.backward(outs, gs if not self.is_last else None)
        except Exception as exc:
            raise StageError(f"backward of stage {self.stage} raised "
                             f"{type(exc).__name__}: {exc}", task=f"B{mb}") from exc
        return self._input_grads(saved)

    def backward_input(self, mb: int, grads: Sequence[Any] | None) -> tuple[Any, ...]:
        """B of split backward: input gradient only; stash what W needs."""
        saved = self._saved_for_backward(mb, pop=False)
        outs, gs = self._roots(saved, grads)
        wanted = [x for x in saved.inputs if isinstance(x, torch.Tensor) and x.requires_grad]
        if not outs:
            return tuple(None for _ in saved.inputs)
        if not wanted or not self._params:
            saved.full_backward_at_w = bool(self._params)
            saved.grads = tuple(grads or ())  # aligned with the outputs, as _roots takes them
            if wanted:
                return self._grad_inputs_only(saved, outs, gs, wanted)
            return tuple(None for _ in saved.inputs)
        try:
            inter, on_path, owned = self._intermediates(outs, wanted)
        except _NoSplit:
            self.num_split_fallbacks += 1
            saved.full_backward_at_w = True
            saved.grads = tuple(grads or ())  # aligned with the outputs, as _roots takes them
            return self._grad_inputs_only(saved, outs, gs, wanted)
        for o, g in zip(outs, gs):  # roots off the input path: their gradient is given
            node = o.grad_fn
            if node in inter and node not in on_path:
                slot = inter[node]
                slot[o.output_nr] = g if g is not None else torch.ones_like(o)
        handles = [n.register_prehook(_stasher(slot)) for n, slot in inter.items()
                   if n in on_path]
        try:
            dx = torch.autograd.grad(outs, wanted, gs if not self.is_last else None,
                                     retain_graph=True, allow_unused=True)
        except Exception as exc:
            raise StageError(f"backward (input) of stage {self.stage} raised "
                             f"{type(exc).__name__}: {exc}", task=f"B{mb}") from exc
        finally:
            for h in handles:
                h.remove()
        saved.stash = inter
        saved.owned = owned
        it = iter(dx)
        return tuple(next(it) if isinstance(x, torch.Tensor) and x.requires_grad else None
                     for x in saved.inputs)

    def _grad_inputs_only(self, saved: _Saved, outs: list, gs: list, wanted: list
                          ) -> tuple[Any, ...]:
        dx = torch.autograd.grad(outs, wanted, gs if not self.is_last else None,
                                 retain_graph=True, allow_unused=True)
        it = iter(dx)
        return tuple(next(it) if isinstance(x, torch.Tensor) and x.requires_grad else None
                     for x in saved.inputs)

    def backward_weight(self, mb: int) -> None:
        """W of split backward: parameter gradients from the stashed intermediate gradients."""
        saved = self._saved.pop(mb)
        try:
            if saved.full_backward_at_w:
                outs, gs = self._roots(saved, saved.grads or None)
                grads = torch.autograd.grad(outs, self._params,
                                            gs if not self.is_last else None,
                                            allow_unused=True)
                self._accumulate(grads)
                return
            if saved.owned is not None:
                self._weight_per_intermediate(saved.stash, saved.owned)
                return
            edges, seeds = _seeds(saved.stash)
            if not edges:
                return
            handles = [n.register_prehook(_replacer(slot)) for n, slot in saved.stash.items()]
            try:
                grads = torch.autograd.grad(edges, self._params, seeds, allow_unused=True)
            finally:
                for h in handles:
                    h.remove()
            self._accumulate(grads)
        except StageError:
            raise
        except Exception as exc:
            raise StageError(f"backward (weight) of stage {self.stage} raised "
                             f"{type(exc).__name__}: {exc}", task=f"W{mb}") from exc

    def _weight_per_intermediate(self, stash: dict[Node, list[Any]],
                                 owned: dict[Node, list[int]]) -> None:
        for node, idx in owned.items():
            edges, seeds = _seeds({node: stash[node]})
            if not edges or not idx:
                continue
            params = [self._params[i] for i in idx]
            grads = torch.autograd.grad(edges, params, seeds, allow_unused=True)
            self._accumulate(grads, params)

    def _accumulate(self, grads: Sequence[torch.Tensor | None],
                    params: Sequence[torch.Tensor] | None = None) -> None:
        with torch.no_grad():
            for p, g in zip(self._params if params is None else params, grads):
                if g is None:
                    continue
                if p.grad is None:
                    p.grad = g.detach().clone()
                else:
                    p.grad.add_(g)

    def _param_nodes(self) -> list[Node]:
        """The parameters' AccumulateGrad nodes, looked up once: holding them keeps torch
        handing out the same node to every later graph, and each lookup costs a view_as."""
        if self._param_node_list is None:
            self._param_node_list = [_node(p) for p in self._params]
        return self._param_node_list

    def _intermediates(self, outs: list[torch.Tensor], wanted: list[torch.Tensor]
                       ) -> tuple[dict[Node, list[Any]], set[Node], dict[Node, list[int]] | None]:
        """Nodes where parameter subgraphs branch off the input-gradient path (with empty
        gradient slots), the input-path nodes, and which parameters each intermediate owns
        (None when a parameter hangs off several intermediates)."""
        roots = [o.grad_fn for o in outs]
        if any(r is None for r in roots):
            raise _NoSplit
        inputs = {_node(x) for x in wanted}
        param_nodes = self._param_nodes()
        children: dict[Node, list[Node]] = {}
        stack = list(dict.fromkeys(roots))
        while stack:
            n = stack.pop()
            if n in children:
                continue
            kids = [c for c, _ in n.next_functions if c is not None]
            children[n] = kids
            stack.extend(k for k in kids if k not in children)
        on_path, to_param = _closures(children, inputs, set(param_nodes))
        root_set = set(roots)
        if any(r in children[n] for n in children for r in root_set):
            raise _NoSplit  # one output feeds another: stashed gradients would be partial
        known = on_path | root_set
        inter: dict[Node, list[Any]] = {}
        for n in children:
            if n in known and any(c not in known and c in to_param for c in children[n]):
                inter[n] = [None] * _num_outputs(n)
        index = {n: i for i, n in enumerate(param_nodes)}
        owned: dict[Node, list[int]] | None = {}
        seen: set[int] = set()
        for n in inter:
            mine = _branch_params(children, n, known, index)
            if seen & set(mine):
                owned = None
                break
            seen.update(mine)
            owned[n] = mine  # type: ignore[index]
        return inter, on_path, owned


class _NoSplit(Exception):
    """The graph has a shape the split method does not handle; fall back to recomputation."""


def _closures(children: dict[Node, list[Node]], *targets: set[Node]) -> list[set[Node]]:
    """For each target set, the nodes from which some node of it is reachable (itself
    included): one post-order walk of the graph serves every target set."""
    order: list[Node] = []  # post-order: every node after all of its children
    done: set[Node] = set()
    for start in children:
        if start in done:
            continue
        stack: list[tuple[Node, int]] = [(start, 0)]
        while stack:
            n, i = stack.pop()
            kids = children.get(n, ())
            while i < len(kids) and kids[i] in done:
                i += 1
            if i < len(kids):  # kids[i] is not done yet: finish it first
                stack.append((n, i + 1))
                stack.append((kids[i], 0))
                continue
            if n not in done:
                done.add(n)
                order.append(n)
    result = []
    for target in targets:
        hit = set(target)
        for n in order:
            if n not in hit:
                for k in children.get(n, ()):
                    if k in hit:
                        hit.add(n)
                        break
        result.append(hit)
    return result


def _branch_params(children: dict[Node, list[Node]], node: Node, known: set[Node],
                   index: dict[Node, int]) -> list[int]:
    """Indices of the parameters reachable from `node` without entering the input path."""
    found: list[int] = []
    stack = [c for c in children[node] if c not in known]
    visited: set[Node] = set()
    while stack:
        n = stack.pop()
        if n in visited:
            continue
        visited.add(n)
        if n in index:
            found.append(index[n])
        stack.extend(c for c in children.get(n, ()) if c not in known and c not in visited)
    return sorted(set(found))


def _seeds(stash: dict[Node, list[Any]]) -> tuple[list[GradientEdge], list[Any]]:
    edges, seeds = [], []
    for node, slot in stash.items():
        for i, g in enumerate(slot):
            if g is not None:
                edges.append(GradientEdge(node, i))
                seeds.append(g)
    return edges, seeds


def _num_outputs(node: Node) -> int:
    meta = getattr(node, "_input_metadata", None)
    if meta is not None:
        return len(meta)
    return 1


def _stasher(slot: list[Any]) -> Callable[[tuple[Any, ...]], None]:
    def hook(grad_outputs: tuple[Any, ...]) -> None:
        for i, g in enumerate(grad_outputs):
            if i < len(slot):
                slot[i] = g
            else:
                slot.append(g)
    return hook


def _replacer(slot: list[Any]) -> Callable[[tuple[Any, ...]], tuple[Any, ...]]:
    def hook(grad_outputs: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(slot[i] if i < len(slot) else g for i, g in enumerate(grad_outputs))
    return hook
