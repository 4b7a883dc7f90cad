"""`aioready train --sized-microbatches`: sequence lengths that follow the jitter model's sizes.

The synthetic microbatches of `aioready train` are all `--seq` long, so their input bytes, the
costs a microbatch order goes by (runtime/mb_order.py), are equal and say nothing of the
durations the jitter model gives them. With this option a microbatch's length follows its size
in the model (sim/order.py `known_costs`: a multimodal heavy one FACTOR times a light one's,
the longest `--seq`), as a multimodal batch's image or long document makes it both bigger and
slower: the bytes then know what the durations will be, and `--hint auto` can choose an order
from them as a real job's would.
"""

from __future__ import annotations

from typing import Callable

from ..errors import ConfigError
from ..placement import Placement
from ..sim.order import known_costs
from ..sim.variability import JitterModel

__all__ = ["sequence_lengths"]


def sequence_lengths(jitter: str, *, seed: int, seq: int, placement: Placement,
                     num_microbatches: int, split_backward: bool
                     ) -> Callable[[int], list[int]]:
    """lengths(step): each microbatch's sequence length, `seq` times its size over the step's
    largest; ConfigError where the model gives microbatches no sizes."""
    model = JitterModel(jitter, seed=seed, placement=placement,
                        num_microbatches=num_microbatches, split_backward=split_backward)
    if known_costs(model, 0) is None:
        raise ConfigError("sized_microbatches: the jitter model gives microbatches no sizes",
                          expected="a multimodal term (multimodal:FRACTION:FACTOR)",
                          got=repr(jitter))

    def lengths(step: int) -> list[int]:
        sizes = known_costs(model, step) or [1.0]
        return [max(1, round(seq * s / max(sizes))) for s in sizes]
    return lengths
