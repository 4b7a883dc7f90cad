"""The tuner's budget: what a candidate may hold, in microbatches (`cap=`) or bytes (`memory=`).

The two forms differ only in what a candidate is given and what "fits" compares (the Note
[budget form] of sim/choice.py), so both live here:

- counts: the caller's budget resolved like a Pipeline's `cap` against the reference hint (the
  one an auto pipeline starts from); a candidate at factor f runs under f times its own peak
  in-flight count per rank, clipped to the budget; it fits when its simulated peak in-flight
  count does.
- bytes: the caller's budget in any form of aioready.memory; "Nx" is N times the bytes the
  reference hint's strict order holds at its peak on each rank, simulated: what the pipeline
  would hold without auto, as in the count form, so "1x" always admits the start hint. (The
  byte gate's own "Nx" is the peak count times the mean bytes per microbatch, held_bytes.py;
  with heavy microbatches a strict order holds more than that at its peak.) A ready candidate
  at factor f runs under the byte gate's "fx" of its own order (its peak in-flight count times
  the rank's mean bytes per microbatch), clipped to the budget; a strict one runs
  its order (strict ignores budgets). Either fits when its simulated peak activation bytes do:
  the reserving policy never holds back the order's own entry forward, so under a budget below
  what its order needs it can exceed it, and is then not chosen.

- held activations (`held=True`, the default of `aioready train`): the budget counts (chunk,
  microbatch) activations a rank holds, each alike. A strict candidate holds what its order
  holds (hints.HintOrder.peak_chunk_activations, the same at runtime whatever the durations);
  a ready one runs under a count of budget // chunks microbatches, since a microbatch in flight
  holds at most one activation per chunk of the rank: its bound, chunks x its simulated peak
  in-flight count, is what fits compares, and it holds at runtime too, where the durations
  differ from the simulated ones. (Comparing the simulated held peak of a ready candidate
  instead would admit larger caps that can hold more on another step's durations.)

- count caps within bytes (`Limit.counted`): under a byte budget, each ready candidate also
  runs as the count budget would run it, at each factor of its own peak clipped to COUNTS times
  the reference's peak in-flight count per rank, with the byte gate at the whole budget kept as
  a backstop (memory.Budget `count`: an entry forward is admitted only while both allow it).
  It fits, like the byte-gated ones, when its simulated peak bytes do. The byte gate predicts a
  microbatch's bytes from its input and misses each task's own noise, so a byte-gated candidate
  that uses the whole budget goes over it on noisy durations; a count cap that holds fewer
  microbatches can fit where it does not (docs/policy_measurements.md "Auto at twice the bytes").

`mean_bytes(order)` is each rank's mean bytes per microbatch (every chunk) on the durations
being tuned for; the simulator's comes from its bytes model (sim/memory.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from ..caps import CapSpec, resolve_caps
from ..errors import ConfigError
from ..hints import HintOrder
from ..memory import Budget, MemorySpec, check_one_gate, format_bytes, resolve_memory

__all__ = ["COUNTS", "Limit", "MeanBytes", "gated"]

COUNTS = (1.0, 1.5, 2.0)
"""Under a byte budget, the count limits a count-capped candidate is clipped to, as multiples of
the reference hint's peak in-flight count per rank (cap="2x" is 2 of them)."""

MeanBytes = Callable[[HintOrder], Sequence[float]]
"""order -> each rank's mean activation bytes per microbatch on the durations tuned for."""


@dataclass(frozen=True, slots=True)
class Limit:
    """The caller's budget per rank: counts, or bytes (`in_bytes`)."""

    per_rank: tuple[int, ...]
    in_bytes: bool = False
    mean_bytes: MeanBytes | None = None
    held: bool = False  # per_rank counts (chunk, microbatch) activations held, not microbatches
    reference: tuple[int, ...] = ()  # bytes: the reference's peak in-flight count per rank

    @classmethod
    def resolve(cls, budget: CapSpec, memory: MemorySpec, reference: HintOrder,
                mean_bytes: MeanBytes | None,
                reference_peak: Callable[[], Sequence[int]]) -> Limit:
        """`reference_peak()`: the reference's strict peak bytes per rank (asked only for an
        "Nx" byte budget)."""
        check_one_gate(budget, memory)
        if memory is None:
            return cls(tuple(resolve_caps(budget, reference)))
        if mean_bytes is None:
            raise ConfigError("a memory budget needs the bytes per microbatch",
                              expected="choose_schedule(..., mean_bytes=...)", got="none")
        budgets = resolve_memory(memory, reference.num_ranks) or []
        held = reference_peak() if any(b.bytes is None for b in budgets) else ()
        per_rank = [max(1, int(b.bytes if b.bytes is not None else b.factor * held[r]))
                    for r, b in enumerate(budgets)]  # type: ignore[operator]
        return cls(tuple(per_rank), True, mean_bytes,
                   reference=tuple(reference.peak(r) for r in range(reference.num_ranks)))

    def gate(self, order: HintOrder, mode: str, factor: float
             ) -> tuple[tuple[int, ...], tuple[int, ...] | None] | None:
        """(caps, byte budgets or None) of `order` at `factor` in `mode`; None: strict under a
        count budget below its own peak, which cannot run."""
        if self.held:
            if mode == "strict":
                if any(order.peak_chunk_activations(r) > m for r, m in enumerate(self.per_rank)):
                    return None
                return tuple(resolve_caps(None, order)), None
            chunks = order.placement.num_chunks
            own = resolve_caps(f"{factor:g}x", order)
            return tuple(max(1, min(c, m // chunks)) for c, m in zip(own, self.per_rank)), None
        if self.in_bytes:
            if mode == "strict":
                return tuple(resolve_caps(None, order)), None
            mean = self.mean_bytes(order)  # type: ignore[misc]
            memory = tuple(max(1, int(min(factor * order.peak(r) * mean[r], limit)))
                           for r, limit in enumerate(self.per_rank))
            return (order.num_microbatches,) * order.num_ranks, memory
        own = resolve_caps(f"{factor:g}x", order)
        caps = tuple(min(c, m) for c, m in zip(own, self.per_rank))
        if mode == "strict" and any(c < order.peak(r) for r, c in enumerate(caps)):
            return None
        return caps, None

    def counted(self, order: HintOrder, factor: float, counts: float
                ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Under a byte budget, (caps, byte budgets) of a count-capped ready candidate of
        `order`: `factor` times its own peak, clipped to `counts` times the reference's peak,
        with the whole byte budget as its backstop (the module's note)."""
        within = Limit(tuple(max(1, int(counts * p)) for p in self.reference))
        caps, _ = within.gate(order, "ready", factor)  # type: ignore[misc]
        return caps, self.per_rank

    def whole(self, order: HintOrder) -> float:
        """The smallest whole factor at which `gate` gives a ready candidate of `order` the
        whole budget on every rank: the budget itself as a candidate. A hint's own peak can be
        far below the budget on some ranks (1F1B's last rank holds 1, BFW's 2), where 2x of it
        leaves most of the memory unused; greedy BFW with the budget on every rank is the
        fastest candidate on many lognormal steps (docs/policy_measurements.md "The whole
        budget")."""
        if self.held:
            room = [m // order.placement.num_chunks for m in self.per_rank]
        elif self.in_bytes:
            mean = self.mean_bytes(order)  # type: ignore[misc]
            room = [m / max(mean[r], 1e-9) for r, m in enumerate(self.per_rank)]
        else:
            room = list(self.per_rank)
        return float(max(1, *(math.ceil(m / max(1, order.peak(r)) - 1e-9)
                              for r, m in enumerate(room))))

    def peak(self, peak_in_flight: Sequence[int], peak_bytes: Sequence[int],
             order: HintOrder | None = None, mode: str = "ready") -> tuple[int, ...]:
        """What is compared with the budget: the peak count or the peak bytes per rank; held
        activations: the strict order's own, or chunks x the peak count (the module's note)."""
        if self.held and order is not None:
            if mode == "strict":
                return tuple(order.peak_chunk_activations(r) for r in range(order.num_ranks))
            return tuple(order.placement.num_chunks * p for p in peak_in_flight)
        return tuple(peak_bytes if self.in_bytes else peak_in_flight)

    def fits(self, peak: Sequence[int]) -> bool:
        return all(p <= m for p, m in zip(peak, self.per_rank))

    def text(self, values: Sequence[int]) -> str:
        return (f"[{', '.join(format_bytes(v) for v in values)}]" if self.in_bytes
                else str(list(values)))

    @property
    def what(self) -> str:
        if self.held:
            return "peak (chunk, microbatch) activations held"
        return "peak activation bytes" if self.in_bytes else "peak in-flight"


def gated(caps: Sequence[int], memory: Sequence[int] | None) -> dict[str, object]:
    """simulate's (or Pipeline's) gate keyword for a candidate: its caps alone, or its byte
    budgets with its caps as each budget's `count` (a byte-gated candidate's caps are the
    microbatch count, which never binds: the same gate as the bytes alone)."""
    if not memory:
        return {"cap": list(caps)}
    return {"memory": [Budget(bytes=int(m), count=int(c)) for m, c in zip(memory, caps)]}
