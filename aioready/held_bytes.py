"""HeldBytes: the activation bytes one rank holds, measured per microbatch, predicted before.

Shapes vary per microbatch (a multimodal microbatch holds more), so bytes are kept per
(microbatch, chunk): measured when that chunk's F ends (on real stages, the bytes autograd saved
for backward, runtime/stage.py; in the simulator, a model, sim/memory.py) and dropped when the
chunk's last backward piece ends (B unsplit, W split), which is when its graph is freed.

Before a chunk's F has run, the gate must predict. The prediction is the chunk's bytes per input
byte over the microbatches measured so far (a ratio of sums, kept across steps) times this
microbatch's input bytes (what its entry F receives, known once it arrived): activation memory
grows with the input (sequence length, image count), and the input is the one size known before
the F runs. A chunk not measured yet is predicted like the rank's largest measured chunk, and
before anything is measured there is no prediction (the gate then admits only into an empty
rank). An admitted microbatch counts its predicted bytes for the chunks it has not run yet,
so deeper chunks of a V or interleaved placement cannot overfill the budget later; that count
is derived from the current prediction whenever the gate asks (`held`), so a microbatch admitted
before anything was measured is counted once something is.

The runtime writes (`inputs`, `admit`, `measured`, `release`), the ready set only asks (`fits`,
`fits_ahead`): the same split as forecast.Forecast. Pure Python, no torch.
"""

from __future__ import annotations

import logging

from .memory import Budget, format_bytes
from .tasks import Kind, Task

__all__ = ["HeldBytes"]

log = logging.getLogger(__name__)


class HeldBytes:
    """One rank's ledger of activation bytes and its budget (None: measure only, never gate)."""

    __slots__ = ("budget", "peak_count", "_chunks", "_last", "_sum_bytes", "_sum_in", "_n",
                 "_input", "_measured", "_released", "_admitted", "live", "peak", "_warned")

    def __init__(self, budget: Budget | None, *, peak_count: int, num_chunks: int,
                 split_backward: bool) -> None:
        self.budget = budget
        self.peak_count = peak_count  # the hint's own peak in-flight count on this rank
        self._chunks = num_chunks
        self._last = Kind.W if split_backward else Kind.B
        self._sum_bytes = [0.0] * num_chunks  # learnt across steps
        self._sum_in = [0.0] * num_chunks
        self._n = [0] * num_chunks
        self._warned = False
        self.new_step()

    def new_step(self) -> None:
        """Forget the last step's microbatches; keep what was learnt of their sizes."""
        self._input: dict[int, float] = {}
        self._measured: dict[tuple[int, int], float] = {}  # (microbatch, chunk) -> bytes
        self._released: set[tuple[int, int]] = set()  # measured chunks whose graph was freed
        self._admitted: dict[int, int] = {}  # admitted microbatch -> its chunks not released
        self.live = 0.0  # measured bytes held now
        self.peak = 0.0  # most measured bytes held at once this step

    @property
    def held(self) -> float:
        """Live bytes plus the predicted bytes of admitted microbatches' chunks not run yet."""
        return self.live + sum(self.predict(m) or 0.0 for m in self._admitted)

    # -- what the runtime tells ------------------------------------------------------------
    def inputs(self, microbatch: int, nbytes: float) -> None:
        """The entry F's input of `microbatch` arrived, `nbytes` big (the prediction's scale)."""
        self._input[microbatch] = float(nbytes)

    def admit(self, microbatch: int) -> None:
        """Its entry F starts: it counts its predicted bytes until each chunk is measured."""
        self._admitted[microbatch] = self._chunks
        total = self.predict(microbatch) or 0.0
        budget = self.budget_bytes()
        if budget is not None and total > budget and not self._warned:
            self._warned = True
            log.warning("microbatch %d alone is predicted to hold %s of activations, more than "
                        "the memory budget of %s: it runs when nothing else is in flight, so "
                        "the budget is exceeded rather than the step hung (said once per rank)",
                        microbatch, format_bytes(total), format_bytes(budget))

    def measured(self, microbatch: int, chunk: int, nbytes: float) -> None:
        """F(microbatch, chunk) ended holding `nbytes` for backward."""
        key = (microbatch, chunk)
        self._measured[key] = self._measured.get(key, 0.0) + nbytes
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        self._sum_bytes[chunk] += nbytes
        self._sum_in[chunk] += self._input.get(microbatch, 0.0)
        self._n[chunk] += 1

    def release(self, task: Task) -> None:
        """After `task` ran: its chunk's graph is freed when its last backward piece ends."""
        if task.kind is not self._last:
            return
        key = (task.microbatch, task.chunk)
        if key in self._measured and key not in self._released:
            self._released.add(key)
            self.live -= self._measured[key]
        left = self._admitted.get(task.microbatch)
        if left is not None:
            if left > 1:
                self._admitted[task.microbatch] = left - 1
            else:
                del self._admitted[task.microbatch]

    def input_of(self, microbatch: int) -> float:
        """The entry input's bytes of `microbatch` this step (0 where not known)."""
        return self._input.get(microbatch, 0.0)

    # -- what the gate asks ----------------------------------------------------------------
    def _chunk_guess(self, microbatch: int, chunk: int) -> float:
        known = [c for c in range(self._chunks) if self._n[c]]
        if not known:
            return 0.0
        if not self._n[chunk]:
            return max(self._chunk_guess(microbatch, c) for c in known)
        size = self._input.get(microbatch)
        if size and self._sum_in[chunk] > 0:
            return self._sum_bytes[chunk] / self._sum_in[chunk] * size
        return self._sum_bytes[chunk] / self._n[chunk]

    def predict(self, microbatch: int) -> float | None:
        """Bytes `microbatch` is expected to hold on this rank (every chunk); None before any
        measurement."""
        if not any(self._n):
            return None
        return sum(self._chunk_guess(microbatch, c) for c in range(self._chunks)
                   if (microbatch, c) not in self._measured)

    def mean_bytes(self) -> float | None:
        """A microbatch's mean bytes on this rank (every chunk), from what was measured."""
        known = [self._sum_bytes[c] / self._n[c] for c in range(self._chunks) if self._n[c]]
        if not known:
            return None
        return sum(known) + max(known) * (self._chunks - len(known))

    def budget_bytes(self) -> float | None:
        """The budget in bytes now: fixed, or factor x the hint's peak count x the mean bytes
        per microbatch (None: no budget, or a factor before anything was measured)."""
        budget = self.budget
        if budget is None:
            return None
        if budget.bytes is not None:
            return float(budget.bytes)
        mean = self.mean_bytes()
        return None if mean is None else budget.factor * self.peak_count * mean  # type: ignore

    def fits(self, microbatch: int) -> bool:
        """Whether admitting `microbatch` keeps the predicted held bytes within the budget (and
        the microbatches in flight below the budget's `count`, where it has one)."""
        budget, guess = self.budget_bytes(), self.predict(microbatch)
        count = self.budget.count if self.budget is not None else None
        if count is not None and len(self._admitted) >= count:
            return False  # the chosen count cap; the bytes are its backstop
        return budget is not None and guess is not None and self.held + guess <= budget

    def fits_ahead(self, microbatch: int, ahead: set[int]) -> bool:
        """Whether `microbatch` may be admitted ahead of the hint's order: within the budget,
        and the microbatches held ahead stay within the room above what the order itself holds
        at its peak (its peak count x the mean bytes): the byte form of `cap - peak`; with a
        budget's `count`, also fewer than `count - peak` microbatches held ahead."""
        if not self.fits(microbatch):
            return False
        count = self.budget.count if self.budget is not None else None
        if count is not None and sum(m in self._admitted for m in ahead) >= \
                count - self.peak_count:
            return False  # the count form's room, `cap - peak`: the order itself holds the rest
        room = self.budget_bytes() - self.peak_count * self.mean_bytes()  # type: ignore
        held_ahead = sum(v for key, v in self._measured.items()
                         if key[0] in ahead and key not in self._released) + sum(
            self.predict(m) or 0.0 for m in ahead if m in self._admitted)
        return held_ahead + self.predict(microbatch) <= room  # type: ignore[operator]

    def __repr__(self) -> str:
        return (f"<HeldBytes live={format_bytes(self.live)} held={format_bytes(self.held)} "
                f"peak={format_bytes(self.peak)} budget={self.budget}>")
