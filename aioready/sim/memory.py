"""Activation bytes in the simulator, where no tensor exists: a model tied to the durations.

A microbatch's F on a stage holds `BYTES_PER_MS` bytes per ms of that F's duration until its
last backward piece on the stage ends: activation memory and forward time both grow with what
the microbatch carries (tokens, images), so a multimodal heavy microbatch (FACTOR x slower at
every stage) also holds FACTOR x the bytes, and a straggler rank holds more per microbatch. With
the default base durations (F = 1 ms) a microbatch holds 1 MiB per stage.

Its input, which the gate scales its prediction by (held_bytes.py), is what the upstream stage's
F produced: the same model at stage - 1 (stage 0: its own, the raw batch). So the prediction is
exact for the microbatch's size (a multimodal factor is the same at every stage) and misses
per-task noise (lognormal terms), as a real gate would.

Where the durations are a run's own (a Trace from a Pipeline's reports) and carry the bytes its
stages measured (`Trace.measured_bytes`: what each F kept for backward, and its rank's entry
input), those replace the model: hint="auto" under memory= in a Pipeline chooses on the bytes
its microbatches really held (runtime/autotune.py).

What it leaves out: weights, gradients and optimizer state (constant per rank, not the gate's
business), the allocator (fragmentation, CUDA's caching), and the transient memory of a running
task (a backward's temporaries, recompute's second forward).
"""

from __future__ import annotations

from ..placement import Placement
from ..runtime.rank import BytesModel
from ..tasks import Kind
from .durations import Durations

__all__ = ["BYTES_PER_MS", "bytes_model", "mean_bytes"]

BYTES_PER_MS = float(2**20)
"""Activation bytes a microbatch holds on a stage per ms of its forward there."""


def bytes_model(durations: Durations, bytes_per_ms: float = BYTES_PER_MS) -> BytesModel:
    """`(step, stage, microbatch) -> (bytes held, input bytes)` for RankRuntime(bytes_model=)."""
    table = getattr(durations, "measured_bytes", None)
    if table is not None:
        rows = table.tolist()

        def measured(step: int, stage: int, microbatch: int) -> tuple[float, float]:
            held, source = rows[step][stage][microbatch]
            return held, source
        return measured
    ms = durations.ms

    def model(step: int, stage: int, microbatch: int) -> tuple[float, float]:
        held = ms(step, stage, microbatch, Kind.F) * bytes_per_ms
        source = ms(step, max(stage - 1, 0), microbatch, Kind.F) * bytes_per_ms
        return held, source
    return model


def mean_bytes(durations: Durations, placement: Placement, steps: int,
               bytes_per_ms: float = BYTES_PER_MS) -> list[float]:
    """Each rank's mean bytes per microbatch over `steps` (every chunk it holds): what the byte
    gate's "Nx" multiplies (held_bytes.py), by the model above."""
    table = getattr(durations, "measured_bytes", None)
    if table is not None:
        return [float(table[:steps, list(placement.stages_of(rank)), :, 0].sum(axis=1).mean())
                for rank in range(placement.num_ranks)]
    tables = [durations.table(step) for step in range(steps)]
    return [sum(float(t[stage, :, Kind.F].mean()) for t in tables
                for stage in placement.stages_of(rank)) * bytes_per_ms / steps
            for rank in range(placement.num_ranks)]
