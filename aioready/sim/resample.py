"""More steps from the steps measured: each (stage, kind)'s durations dealt to the microbatches
again, so a choice can rank candidates by a mean over plausible steps.

Why: `hint="auto"` chooses the candidate fastest on the steps it measured. Under per-task noise the
candidates that matter are within a few percent of each other, and on one step several tie exactly
(the extra memory of one was never used on that draw; docs/policy_measurements.md "Choosing on a
window of steps", on resampling), so the one chosen is often not the fastest on the next step. A
window of real steps (`AutoHint(window=k)`) helps but costs k - 1 steps under the start hint first.
Dealing a measured step's durations to the microbatches in a seeded random order, per (stage,
kind), is another plausible step wherever the noise is drawn per task; the microbatch's known size
factor (sim/order.py, what its inputs tell) stays with the microbatch, only the rest is dealt. The
measured steps come first, unchanged.

What it assumes: noise independent of the microbatch beyond its size (a per-microbatch effect
the sizes do not carry, a slow input, is spread over the others). It moves no duration from one
stage or kind to another, so each stage's total work is the measured one.
"""

from __future__ import annotations

import numpy as np

from .traces import Trace

__all__ = ["resampled_tables", "resampled_trace"]


def resampled_tables(table: np.ndarray, sizes: np.ndarray | None, copies: int, seed: int
                     ) -> list[np.ndarray]:
    """`copies` tables (stages, M, kinds), each with every (stage, kind)'s durations divided by
    the microbatch's size, dealt to the microbatches in a random order drawn from `seed`, and
    multiplied by the size of the microbatch it lands on."""
    if copies < 0:
        raise ValueError(f"copies: expected an integer >= 0, got {copies!r}")
    table = np.asarray(table, dtype=np.float64)
    scale = (np.ones(table.shape[1]) if sizes is None
             else np.asarray(sizes, dtype=np.float64))[None, :, None]
    noise = table / scale
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(copies):
        deal = np.argsort(rng.random(noise.shape), axis=1, kind="stable")
        out.append(np.take_along_axis(noise, deal, axis=1) * scale)
    return out


def resampled_trace(trace: Trace, steps: int, copies: int, seed: int = 0) -> Trace:
    """The first `steps` steps of `trace`, then `copies` resampled copies of each in turn
    (round-robin over the measured steps), as one trace of steps + copies steps that
    `simulate(hint="auto", trace=..., steps=...)` ranks candidates on by their mean."""
    if steps < 1:
        raise ValueError(f"steps: expected an integer >= 1, got {steps!r}")
    tables = [trace.table(s) for s in range(steps)]
    sizes = [trace.sizes(s) for s in range(steps)]
    extra, extra_sizes = [], []
    for i in range(copies):
        s = i % steps
        extra += resampled_tables(tables[s], sizes[s], 1, seed * 1_000_003 + i)
        extra_sizes.append(sizes[s])
    known = None if sizes[0] is None else np.stack(sizes + extra_sizes)
    return Trace(np.stack(tables + extra), placement=trace.placement,
                 split_backward=trace.split_backward,
                 source=f"{trace.source} + {copies} resampled", sizes=known)
