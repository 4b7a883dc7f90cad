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

A window (`window=k`, `Pipeline(hint=AutoHint(window=k))`): the chooser sees steps HELD_STEP ..
HELD_STEP + k - 1, each another independent draw, replayed in one k-step simulation whose mean
step time ranks the candidates, as the runtime's SimChooser does with its last k steps' spans.
With "sizes" every step of the window carries the scored step's sizes (a runtime knows the
coming step's inputs, not those of the window it measured: "step" keeps each step's own).
No step of a window is step 0, the scored one.

Resampled (`copies=c`): after the window's steps, c copies of them (round-robin), each with
every (stage, kind)'s durations dealt to the microbatches again in a seeded order, the sizes
staying with their microbatches (aioready/sim/resample.py); the chooser ranks by the mean over
all window + c steps. It sees no more measured steps than the window, only more plausible ones.
"""

from __future__ import annotations

import numpy as np

from aioready.placement import Placement
from aioready.sim.resample import resampled_trace
from aioready.sim.traces import Trace
from aioready.sim.variability import JitterModel

__all__ = ["HELD_STEP", "KNOWN", "RESAMPLE", "WINDOW", "choice_draw"]

HELD_STEP = 1
KNOWN = ("sizes", "step")
WINDOW = 4
"""The held-out window rows' k: tuned on seeds 0-4 (lognormal:0.5, S,M = 4,8 / 4,16 / 8,16),
where the mean regret against hindsight stopped shrinking past 4 steps (docs/policy_measurements.md
"Choosing on a window of steps"); seeds 5-9 validate it."""
RESAMPLE = 8
"""The resampled rows' steps in all: the one measured step and RESAMPLE - 1 copies of it
(docs/policy_measurements.md "Choosing on a window of steps", on resampling)."""


def choice_draw(jitter: str, seed: int, stages: int, microbatches: int, split: bool,
                known: str, step: int = HELD_STEP, window: int = 1, copies: int = 0,
                deal: int = 0) -> Trace:
    """Steps `step` .. `step + window - 1` of the seeded model on S linear ranks (every auto
    candidate's placement) as a trace, with step 0's sizes where `known` is "sizes" (the
    module's note), then `copies` resampled copies of them (seeded by `seed` and `deal`, the
    index of another draw of copies)."""
    if known not in KNOWN:
        raise ValueError(f"known: expected one of {KNOWN}, got {known!r}")
    if window < 1:
        raise ValueError(f"window: expected an integer >= 1, got {window!r}")
    model = JitterModel(jitter, seed=seed, placement=Placement.linear(stages),
                        num_microbatches=microbatches, split_backward=split)
    tables, sized = [], []
    for at in range(step, step + window):
        table, sizes = model.table(at), model.sizes(at)
        if known == "sizes" and sizes is not None:
            scored = model.sizes(0)
            assert scored is not None
            table = table * (scored / sizes)[None, :, None]
            sizes = scored
        tables.append(table)
        sized.append(sizes)
    steps = f"step {step}" if window == 1 else f"steps {step}-{step + window - 1}"
    trace = Trace(np.stack(tables), placement=model.placement, split_backward=split,
                  source=f"{jitter} seed {seed} {steps} ({known} known)",
                  sizes=None if sized[0] is None else np.stack(sized))
    return resampled_trace(trace, window, copies, seed + 7919 * deal) if copies else trace
