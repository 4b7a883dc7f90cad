"""The durations a held-out auto row chooses on: another draw of the scored step's jitter.

bench.policy scores every row on step 0 of its (jitter, seed). A hindsight auto row simulates its
candidates on those very durations, so it picks the best of them for the noise it is then scored
on. A running pipeline cannot: `Pipeline(hint="auto")` chooses from the spans of steps it already
ran (runtime/autotune.py, a window of one step by default) and runs the choice on later steps,
whose per-task noise is new. What it does know of a coming step is each microbatch's cost from
its inputs (runtime/auto_order.py): under the jitter models, the per-microbatch factor that
`JitterModel.sizes` gives (multimodal: FACTOR for a heavy microbatch), the one thing sim/order.py
lets a candidate reorder by.

A held-out row chooses on step HELD_STEP of the same (jitter, seed): per-task draws are hashes of
(seed, term, step, stage, microbatch, kind) (sim/variability.py), so that step's noise is
independent of step 0's, drawn from the same model, and no row is ever scored on it. Two readings
of what the runtime knows ahead of the scored step:

  "sizes"  the scored step's sizes are known: step HELD_STEP's table with its per-microbatch
           factor replaced by step 0's (every term multiplies, so this is exact). A runtime that
           chooses just before a step, from its inputs' costs and earlier spans, knows this much.
  "step"   nothing of the scored step: step HELD_STEP as drawn, sizes and all; what
           `Pipeline(hint="auto", window=1)` chooses from today. Its chosen microbatch order is
           a rule (ascending, descending), applied to the scored step's own sizes, as the
           runtime applies it to every later step.

Under durations without sizes (lognormal, straggler) the two are the same draw.
"""

from __future__ import annotations

from aioready.placement import Placement
from aioready.sim.traces import Trace
from aioready.sim.variability import JitterModel

__all__ = ["HELD_STEP", "KNOWN", "choice_draw"]

HELD_STEP = 1
KNOWN = ("sizes", "step")


def choice_draw(jitter: str, seed: int, stages: int, microbatches: int, split: bool,
                known: str, step: int = HELD_STEP) -> Trace:
    """Step `step` of the seeded model on S linear ranks (every auto candidate's placement) as
    a one-step trace, with step 0's sizes where `known` is "sizes" (the module's note)."""
    if known not in KNOWN:
        raise ValueError(f"known: expected one of {KNOWN}, got {known!r}")
    model = JitterModel(jitter, seed=seed, placement=Placement.linear(stages),
                        num_microbatches=microbatches, split_backward=split)
    table, sizes = model.table(step), model.sizes(step)
    if known == "sizes" and sizes is not None:
        scored = model.sizes(0)
        assert scored is not None
        table = table * (scored / sizes)[None, :, None]
        sizes = scored
    return Trace(table[None], placement=model.placement, split_backward=split,
                 source=f"{jitter} seed {seed} step {step} ({known} known)",
                 sizes=None if sizes is None else sizes[None])
