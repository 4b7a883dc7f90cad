"""The GPT-style stages: exact against the unsplit model, variable lengths, deterministic."""

from __future__ import annotations

import pytest
import torch

from aioready.runtime.pipeline import Pipeline
from aioready.testing.helpers import max_grad_diff, reference_step
from aioready.testing.models import gpt_stages, lm_loss


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models: intra-op threads only add contention (restored afterwards)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def microbatches(lengths: tuple[int, ...], vocab: int = 64):
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randint(0, vocab, (2, t), generator=gen) for t in lengths]
    ys = [torch.randint(0, vocab, x.shape, generator=gen) for x in xs]
    return xs, ys


@pytest.mark.parametrize(("mode", "split"), [("ready", True), ("strict", False)],
                         ids=["ready-split", "strict-unsplit"])
async def test_gpt_pipeline_matches_the_unsplit_model(mode: str, split: bool) -> None:
    xs, ys = microbatches((5, 9, 3, 12))  # variable sequence lengths per microbatch
    stages = gpt_stages(3, vocab=64, dim=16, heads=2, seq=16, dtype=torch.float64)
    ref_loss, ref = reference_step(stages, lm_loss, xs, ys)
    pipe = Pipeline(stages, lm_loss, microbatches=4, hint="1f1b", mode=mode,
                    split_backward=split)
    try:
        loss = await pipe.step(xs, ys)
    finally:
        pipe.close()
    assert abs(float(loss) - float(ref_loss)) <= 1e-10
    assert max_grad_diff(stages, ref) <= 1e-10


def test_same_seed_same_weights_in_any_process_layout() -> None:
    a = gpt_stages(4, seed=3, dtype=torch.float64)
    b = gpt_stages(4, seed=3, dtype=torch.float64)
    c = gpt_stages(4, seed=4, dtype=torch.float64)
    pa, pb, pc = ([p for s in m for p in s.parameters()] for m in (a, b, c))
    assert all(torch.equal(x, y) for x, y in zip(pa, pb))
    assert not all(torch.equal(x, y) for x, y in zip(pa, pc))
    assert a[0].tok is not None and a[-1].head is not None
    assert a[1].tok is None and a[1].head is None
    assert all(p.dtype == torch.float64 for p in pa)


def test_too_long_a_sequence_is_refused() -> None:
    (stage,) = gpt_stages(1, seq=8)
    with pytest.raises(ValueError, match="longer than the model's seq=8"):
        stage(torch.zeros(1, 9, dtype=torch.long))


def test_lm_loss_is_cross_entropy_over_tokens() -> None:
    logits = torch.zeros(2, 3, 5)
    assert float(lm_loss(logits, torch.zeros(2, 3, dtype=torch.long))) == pytest.approx(
        float(torch.log(torch.tensor(5.0))))
