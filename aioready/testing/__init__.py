"""Test helpers a user can import: tiny real models, the unsplit reference, sleep injection.

`helpers` (reference step and gradient parity), `models` (a tiny GPT split into stages),
`inject` (durations slept inside a stage, so any runtime replays one trace), `loopback` (an
ordered byte plane in one process with NCCL's matching rule). They need torch.
"""

from __future__ import annotations

from .helpers import Block, grads_of, make_mlp_stages, max_grad_diff, mse_loss, reference_step

__all__ = ["Block", "make_mlp_stages", "reference_step", "max_grad_diff", "grads_of", "mse_loss"]
