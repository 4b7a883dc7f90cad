"""Priority rules BF and BFW (RRFP, arXiv 2605.18750): a rank per task from the task itself.

From the paper's abstract: BF is RRFP's default hint, BFW its best one. The paper body was not
available; the definitions are our reading (docs/hints.md "Priority rules: bf and bfw"):
  bf   backward before forward over {F, full B}: B first, deeper chunk first, then oldest
       microbatch; then F, oldest microbatch first. With split backward (not in the reading)
       W ranks right after B, so BF with split backward behaves like unsplit BF.
  bfw  input-gradient B > F > W (needs split backward), W deferred as filler; B deeper chunk
       first, F and W oldest microbatch first.
A rule has no fixed peak, so its default cap per rank is documented (our choice):
  bf   min(M, S - e), where e is the rank's entry stage: the 1F1B peak of that stage
       (R - r on the linear placement, the same as the 1f1b hint).
  bfw  min(M, 2 (S - e)): twice that, the extra memory that lets W be deferred (ZB-H2 needs
       up to 2R-1).
Strict mode runs the sequence derived by list-scheduling the rule under unit durations with
these caps (listsched.py); `ready` mode ranks by the rule itself.
"""

from __future__ import annotations

from ..errors import HintError
from ..hints import HintOrder
from ..placement import Placement
from ..tasks import Kind, Task, all_tasks
from .listsched import list_schedule

__all__ = ["bf", "bfw", "rule_orders", "rule_caps", "RULES"]

RULES = ("bf", "bfw")


def _key(rule: str, task: Task) -> tuple[int, int, int]:
    if task.kind is Kind.B:
        return (0, -task.chunk, task.microbatch)
    if rule == "bf":
        cls = 1 if task.kind is Kind.W else 2
    else:
        cls = 1 if task.kind is Kind.F else 2
    return (cls, task.microbatch, -task.chunk)


def rule_orders(placement: Placement, num_microbatches: int, split_backward: bool,
                rule: str) -> tuple[tuple[Task, ...], ...]:
    """Each rank's tasks sorted by the rule (the same ranking on every rank)."""
    tasks = sorted(all_tasks(placement.num_chunks, num_microbatches, split_backward),
                   key=lambda t: _key(rule, t))
    return tuple(tuple(tasks) for _ in range(placement.num_ranks))


def rule_caps(placement: Placement, num_microbatches: int, rule: str) -> tuple[int, ...]:
    """The documented default cap of each rank (module docstring)."""
    factor = 2 if rule == "bfw" else 1
    S = placement.num_stages
    return tuple(min(num_microbatches, factor * (S - placement.stage_of(r, 0)))
                 for r in range(placement.num_ranks))


def _rule(rule: str, placement: Placement, M: int, split: bool) -> HintOrder:
    orders = rule_orders(placement, M, split, rule)
    caps = rule_caps(placement, M, rule)
    derived = list_schedule(placement, M, split, orders, caps)
    return HintOrder(rule, placement, M, split, orders, is_sequence=False, default_caps=caps,
                     sequence=derived.orders, source=f"rule {rule}")


def bf(placement: Placement, num_microbatches: int, *, split_backward: bool) -> HintOrder:
    return _rule("bf", placement, num_microbatches, split_backward)


def bfw(placement: Placement, num_microbatches: int, *, split_backward: bool) -> HintOrder:
    if not split_backward:
        raise HintError("bfw needs split backward (it ranks W apart from B)",
                        expected="split_backward=True", got="split_backward=False",
                        fix="use bf without split backward")
    return _rule("bfw", placement, num_microbatches, True)
