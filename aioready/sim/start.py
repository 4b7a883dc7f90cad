"""Where an auto pipeline starts: its placement style and split backward, chosen before step 0.

A running Pipeline can switch its hint, mode and caps between steps (runtime/autotune.py), but
not which stages a rank holds (the placement style: with two stages per rank, interleaved or V)
nor whether backward is split (a different set of tasks). Zero-bubble schedules need both: ZBV
runs on a V placement with split backward. So when the caller left them open (`aioready train`
with no --hint and no --split-backward/--no-split-backward), they are chosen here, once, from
the same durations model the run paces its tasks by (jitter and seed, or the trace): every
candidate of every open (style, split) is simulated under the same budget (sim/choice.py), and
the fastest wins. Ties go to unsplit backward (one autograd call per backward, not two), then
to the style order of runtime/choosers.STYLES. After its first measured step the pipeline
chooses again within that style and split, from what it measured.

The budget: activations, not microbatches. One number for every rank: the (chunk, microbatch)
activations the least-holding start hint of the open (style, split) holds at its peak on its
busiest rank in its strict order: 1F1B's min(ranks, M) with one stage per rank, ZBV's 2 min(ranks,
M) with two and split backward open (torch's ZBVZeroBubble holds the same). A count of
microbatches in flight would not do: on two chunks a microbatch in flight holds one or two
chunks' activations, so another schedule at ZBV's count holds up to twice ZBV's activations
(bench/results/e2e_scale_default16.md measured it). How a candidate is held to it (strict: its
order's own peak; ready: a count of budget // chunks) is sim/budget.py's "held activations".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..caps import CapSpec
from ..errors import AioreadyError, ConfigError
from ..hints import HintOrder
from ..placement import Placement
from ..runtime.autotune import AutoHint, start_hint
from ..runtime.choosers import STYLES, Choice
from ..schedulers import make_hint
from .simulator import simulate

__all__ = ["Start", "choose_start", "default_budget", "open_styles", "unmodelled_start"]

Durations = Callable[[Placement, bool], dict[str, Any]]
"""durations(placement, split_backward): the duration keywords of `simulate` for that shape
(`jitter`, `seed`, `base`, or `trace`); raise an AioreadyError where they have none for it (a
trace recorded with the other split or placement)."""


@dataclass(frozen=True, slots=True)
class Start:
    """The schedule an auto pipeline starts from, its split, its budget and why."""

    choice: Choice  # the fastest candidate: its hint on its placement style, mode, policy, caps
    split_backward: bool
    budget: int  # (chunk, microbatch) activations held per rank, every rank alike
    step_ms: float  # its simulated step time
    table: str = ""  # one line per (style, split) simulated

    def order(self, *, num_stages: int, num_ranks: int | None, num_microbatches: int
              ) -> HintOrder:
        return self.choice.build(num_stages=num_stages, num_ranks=num_ranks or num_stages,
                                 num_microbatches=num_microbatches,
                                 split_backward=self.split_backward)

    def encode(self) -> list[int]:
        """Integers that cross ranks (no pickle): split, budget, then Choice.encode."""
        return [int(self.split_backward), self.budget, *self.choice.encode()]

    @staticmethod
    def width(num_ranks: int) -> int:
        """How many integers `encode` gives for a pipeline of `num_ranks` ranks."""
        return 2 + Choice.width(num_ranks)

    @classmethod
    def decode(cls, values: Sequence[int]) -> Start:
        return cls(Choice.decode(values[2:]), bool(values[0]), int(values[1]), float("nan"))

    @property
    def label(self) -> str:
        return (f"{self.choice.label} {self.choice.how}, "
                f"{'split' if self.split_backward else 'unsplit'} backward")


def open_styles(num_stages: int, num_ranks: int) -> list[str]:
    """The placement styles of this many stages per rank (the ones a chooser may pick)."""
    chunks, rest = divmod(num_stages, num_ranks)
    if rest or chunks < 1:
        raise ConfigError("stages must be a multiple of the pipeline ranks", expected=f"a "
                          f"multiple of {num_ranks}", got=num_stages)
    return [s for s in STYLES if (s == "linear") == (chunks == 1) and (s != "v" or chunks == 2)]


def _start_orders(num_stages: int, num_ranks: int, num_microbatches: int,
                 split_backward: bool | None) -> list[tuple[bool, str, HintOrder]]:
    """(split, style, start hint) for each open (style, split); `split_backward` None: both."""
    splits = (False, True) if split_backward is None else (split_backward,)
    return [(split, style, make_hint(start_hint(style, split), num_stages=num_stages,
                                     num_ranks=num_ranks, num_microbatches=num_microbatches,
                                     split_backward=split, placement=style))
            for split in splits for style in open_styles(num_stages, num_ranks)]


def _least_held(starts: list[tuple[bool, str, HintOrder]]) -> int:
    return min(max(order.peak_chunk_activations(r) for r in range(order.num_ranks))
               for _, _, order in starts)


def default_budget(num_stages: int, num_ranks: int, num_microbatches: int,
                   split_backward: bool | None = None) -> int:
    """The (chunk, microbatch) activations of the least-holding start hint among the open
    (style, split), at its strict peak on its busiest rank (1F1B's on one chunk; ZBV's on two
    when split backward is open)."""
    return _least_held(_start_orders(num_stages, num_ranks, num_microbatches, split_backward))


def choose_start(*, num_stages: int, num_ranks: int | None, num_microbatches: int,
                 split_backward: bool | None, durations: Durations, cap: CapSpec = None
                 ) -> Start:
    """Simulate each open (style, split) with hint="auto" from its start hint, on one step of
    `durations`, under the count `cap` (None: `default_budget` activations); the fastest.
    `split_backward` None: both."""
    ranks = num_ranks or num_stages
    starts = _start_orders(num_stages, ranks, num_microbatches, split_backward)
    budget = _least_held(starts)
    tried: list[tuple[tuple[float, int, int], Start]] = []
    lines, skipped = [], []
    for split, style, start in starts:
        try:
            how = durations(start.placement, split)
        except AioreadyError as exc:  # none for this shape (a trace of another)
            skipped.append(f"{style} {'split' if split else 'unsplit'}: {exc.what}")
            continue
        sim = simulate(stages=num_stages, microbatches=num_microbatches, ranks=ranks,
                       hint=AutoHint(start=start), split_backward=split,  # type: ignore[arg-type]
                       cap=cap, activations=budget if cap is None else None, steps=1,
                       order="given", **how)  # a training run keeps its microbatch order
        choice = sim.tuning.choice
        tried.append(((sim.step_time, int(split), STYLES.index(style)),
                      Start(choice, split, budget, sim.step_time)))
        lines.append(f"{style:<11} {'split' if split else 'unsplit':<7} best "
                     f"{choice.label} {choice.how}: {sim.step_time:.4g} ms")
    if not tried:
        raise ConfigError("no placement style and split to start an auto pipeline from",
                          expected="durations for split or unsplit backward",
                          got="; ".join(skipped))
    best = min(tried, key=lambda t: t[0])[1]
    table = "\n".join(lines + [f"skipped {s}" for s in skipped])
    return Start(best.choice, best.split_backward, budget, best.step_ms, table)


def unmodelled_start(*, num_stages: int, num_ranks: int | None, num_microbatches: int,
                     split_backward: bool | None) -> Start:
    """Where there is no durations model to simulate (tasks take their compute time only):
    what every tie gives, unsplit backward (unless fixed) on the first open style, from its
    start hint in ready mode under budget // chunks microbatches (sim/budget.py); the first
    measured step then chooses the schedule."""
    ranks = num_ranks or num_stages
    split = bool(split_backward)
    style = open_styles(num_stages, ranks)[0]
    budget = default_budget(num_stages, ranks, num_microbatches, split_backward)
    choice = Choice(start_hint(style, split), style, "ready",
                    (max(1, budget // (num_stages // ranks)),) * ranks)
    return Start(choice, split, budget, float("nan"),
                 "no durations model (compute time only): nothing simulated")
