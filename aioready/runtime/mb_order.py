"""A Pipeline's microbatch order per step: which microbatch runs in which slot of the hint.

`Pipeline(microbatch_order="ascending" | "descending" | "middle")` runs each step's microbatches in
`schedulers.order.cost_order` of a cost known before the step (docs/policy.md "The microbatch
order"). The cost is `step(costs=...)`, one number per microbatch in the caller's order (tokens,
images: what the job knows its microbatches by), or by default each microbatch's input bytes,
the size a multimodal microbatch grows with. Gradients are the sum over microbatches, so the
order changes them by float reassociation only; `last_losses` stays in the caller's order.

Under MPI every rank must run the same order and only the first stage's rank holds the inputs,
so there `costs=` is required on every rank (a data loader knows its microbatches' sizes
before it hands them out), and must be the same on every rank: nothing compares them, and a
mismatch pairs the first stage's inputs with another microbatch's targets.
"""

from __future__ import annotations

from typing import Any, Sequence

from ..errors import ConfigError
from ..schedulers.order import ORDERS, check_costs, cost_order

__all__ = ["check_order", "input_bytes", "step_order"]


def check_order(how: object) -> str:
    if how not in ORDERS:
        raise ConfigError("microbatch_order", expected=" | ".join(map(repr, ORDERS)),
                          got=repr(how))
    return how  # type: ignore[return-value]


def input_bytes(value: Any) -> float:
    """Bytes of the tensors (or arrays) in one microbatch, through lists, tuples and dicts."""
    if isinstance(value, dict):
        return sum(input_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(input_bytes(v) for v in value)
    if hasattr(value, "element_size") and hasattr(value, "numel"):
        return float(value.numel() * value.element_size())
    return float(getattr(value, "nbytes", 0))


def step_order(how: str, num_microbatches: int, inputs: list[Any] | None,
               costs: Sequence[float] | None, *, one_process: bool,
               stages: int | None = None, split_backward: bool = True
               ) -> tuple[int, ...] | None:
    """Slot -> the caller's microbatch index for one step, or None to keep the given order.
    `stages`, `split_backward`: the pipeline's (the "middle" order's tail follows them)."""
    if how == "given":
        if costs is not None:
            raise ConfigError("step(costs=...) orders microbatches only under a microbatch "
                              "order", expected="Pipeline(microbatch_order='ascending' or "
                              "'descending')", got="microbatch_order='given'")
        return None
    if costs is None:
        if not one_process:
            raise ConfigError(f"microbatch_order={how!r} across processes needs the costs on "
                              "every rank (only the first stage's rank holds the inputs)",
                              expected="step(..., costs=[one number per microbatch])",
                              got="costs=None")
        if inputs is None:
            raise ConfigError(f"microbatch_order={how!r} without costs= orders by the inputs' "
                              "bytes", expected="inputs, or step(costs=...)", got="inputs=None")
        costs = [input_bytes(mb) for mb in inputs]
    order = cost_order(check_costs(costs, num_microbatches), how, stages, split_backward)
    return None if order == tuple(range(num_microbatches)) else order
