"""`aioready.split`: a whole model cut by module names trains exactly like the unsplit model.

The project GPT and a `transformers` Llama decoder (random config, nothing downloaded), in
float64, into S in {2, 4} stages over linear, interleaved and V placements, in-process; loss and
every gradient equal the unsplit model's within 1e-10.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

import aioready
from aioready.errors import ConfigError
from aioready.modeling.balance import partition
from aioready.testing.models import gpt_stages, lm_loss

os.environ.setdefault("HF_HUB_OFFLINE", "1")
TOL = 1e-10
VOCAB, SEQ, M = 32, 8, 4
torch.set_num_threads(1)
# (placement, hint, stages, split backward, recompute)
CASES = [("linear", "1f1b", 2, False, False), ("linear", "zb-h1", 4, True, False),
         ("interleaved", "interleaved-1f1b", 4, False, False), ("v", "zbv", 4, True, False),
         ("v", "zbv", 2, True, True), ("linear", "1f1b", 4, False, True)]
IDS = [f"{p}-S{s}-{h}{'-recompute' if r else ''}" for p, h, s, _, r in CASES]


def gpt(layers: int = 4) -> torch.nn.Module:
    return gpt_stages(1, layers_per_stage=layers, vocab=VOCAB, dim=16, heads=2, seq=SEQ,
                      dtype=torch.float64)[0]


def llama(layers: int = 4) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ, use_cache=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).double()


def batch(seed: int = 1) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randint(0, VOCAB, (2, SEQ), generator=gen) for _ in range(M)]
    ys = [torch.randint(0, VOCAB, (2, SEQ), generator=gen) for _ in range(M)]
    return xs, ys


def logits_of(out: object) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out  # type: ignore[attr-defined]


def unsplit(model: torch.nn.Module, xs: list, ys: list) -> tuple[float, torch.nn.Module]:
    ref = copy.deepcopy(model)
    total = 0.0
    for x, y in zip(xs, ys):
        loss = lm_loss(logits_of(ref(x)), y) / M
        loss.backward()
        total += float(loss.detach())
    return total, ref


NAMES = {"gpt": dict(layers="blocks", before=["tok", "pos"], after=["ln_f", "head"]),
         "llama": dict(layers="model.layers", before=["model.embed_tokens", "model.rotary_emb"],
                       after=["model.norm", "lm_head"])}


def run_split(model: torch.nn.Module, names: dict, placement: str, hint: str, S: int,
              split_b: bool, recompute: bool) -> float:
    stages = aioready.split(model, stages=S, placement=placement, **names)

    async def main() -> torch.Tensor:
        pipe = aioready.Pipeline(list(stages), lm_loss, microbatches=M, hint=hint,
                                 split_backward=split_b, recompute=recompute)
        try:
            return await pipe.step(*batch())  # type: ignore[no-any-return]
        finally:
            pipe.close()
    return float(aioready.run(main()))


def check(make: object, name: str, case: tuple) -> None:
    model = make()  # type: ignore[operator]
    ref_loss, ref = unsplit(model, *batch())
    loss = run_split(model, NAMES[name], *case)
    assert abs(loss - ref_loss) <= TOL
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None, n
        assert float((p.grad - q.grad).abs().max()) <= TOL, n


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gpt_split_matches_unsplit(case: tuple) -> None:
    check(gpt, "gpt", case)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_llama_split_matches_unsplit(case: tuple) -> None:
    check(llama, "llama", case)


def test_stages_share_the_models_parameters_and_own_each_once() -> None:
    model = gpt()
    stages = aioready.split(model, stages=2, **NAMES["gpt"])
    ids = [id(p) for s in stages for p in s.parameters()]
    assert len(ids) == len(set(ids))
    assert set(ids) == {id(p) for p in model.parameters()}


def test_context_travels_once_per_rank() -> None:
    """V placement: a rank's second chunk reads the context its first chunk received."""
    stages = aioready.split(gpt(), stages=4, placement="v", **NAMES["gpt"])
    assert [s._send for s in stages] == [True, False, False, False]
    assert [s._keep for s in stages] == [True, True, False, False]
    assert stages.of_rank(0) == [stages[0], stages[3]]
    linear = aioready.split(gpt(), stages=4, **NAMES["gpt"])
    assert [s._send for s in linear] == [True, True, True, False]


def test_missing_context_names_the_stage() -> None:
    """A rank that never saw the microbatch (the pipeline's placement is not the split's, over
    MPI) is told which stage and what to fix."""
    stages = aioready.split(gpt(), stages=4, placement="v", **NAMES["gpt"])
    with pytest.raises(aioready.StageError, match="stage 2 on rank 1 has no context") as info:
        stages[2](torch.zeros(2, SEQ, 16, dtype=torch.float64))
    assert "placement" in str(info.value)


def test_balance_by_params_gives_heavy_ends_fewer_blocks() -> None:
    assert partition([1.0] * 8, 4) == [2, 2, 2, 2]
    assert partition([1.0] * 8, 2, first=4.0) == [2, 6]
    model = gpt_stages(1, layers_per_stage=6, vocab=4096, dim=16, heads=2, seq=SEQ)[0]
    counts = aioready.split(model, stages=3, **NAMES["gpt"]).counts
    assert sum(counts) == 6 and counts[0] < counts[1] and counts[2] < counts[1]


def test_balance_by_time_and_by_counts() -> None:
    model = gpt(6)
    timed = aioready.split(model, stages=2, balance="time", sample=(batch()[0][0],),
                           **NAMES["gpt"])
    assert sum(timed.counts) == 6 and min(timed.counts) >= 1
    assert all(p.grad is None for p in model.parameters())  # measuring left no gradient
    assert aioready.split(model, stages=2, balance=[1, 5], **NAMES["gpt"]).counts == [1, 5]
    with pytest.raises(ConfigError, match="blocks of each stage"):
        aioready.split(model, stages=2, balance=[2, 2], **NAMES["gpt"])


def test_bad_names_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="no module 'nope'"):
        aioready.split(gpt(), stages=2, layers="nope")
    with pytest.raises(ConfigError, match="parameters in no stage") as info:
        aioready.split(gpt(), stages=2, layers="blocks", before=["tok"], after=["ln_f", "head"])
    assert "pos.weight" in str(info.value)
    model = gpt()
    model.head.weight = model.tok.weight  # tied embedding and head
    with pytest.raises(ConfigError, match="'tok.weight' belongs to stages 0 and 1, on different "
                                          "ranks.*placement='v'"):
        aioready.split(model, stages=2, **NAMES["gpt"])
    with pytest.raises(ConfigError, match="more stages than blocks"):
        aioready.split(gpt(2), stages=3, **NAMES["gpt"])


class PerBlockMask(torch.nn.Module):
    """Blocks get different extra arguments: one context cannot serve them all."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 4)
        self.blocks = torch.nn.ModuleList(Scaled() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for i, block in enumerate(self.blocks):
            h = block(h, scale=torch.tensor(float(i + 1)))
        return h


class Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, h: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.lin(h) * scale


def test_a_sample_shows_blocks_that_need_their_own_context() -> None:
    x = batch()[0][0]
    with pytest.raises(ConfigError, match=r"block 1 is called with another context.*'scale'"):
        aioready.split(PerBlockMask(), stages=2, layers="blocks", before=["emb"], sample=(x,))
    aioready.split(gpt(), stages=2, sample=(x,), **NAMES["gpt"])  # one context: accepted


def test_llama_blocks_share_one_context_and_balance_by_time() -> None:
    stages = aioready.split(llama(), stages=2, balance="time", sample=(batch()[0][0],),
                            **NAMES["llama"])
    assert sum(stages.counts) == 4 and min(stages.counts) >= 1


def test_split_stages_checkpoint_and_restore() -> None:
    """A pipeline of split stages saves and loads like any other: the stage modules' state
    holds exactly the model's parameters."""
    model, other = gpt(), gpt_stages(1, layers_per_stage=4, vocab=VOCAB, dim=16, heads=2,
                                     seq=SEQ, seed=9, dtype=torch.float64)[0]
    pipes = [aioready.Pipeline(list(aioready.split(m, stages=2, **NAMES["gpt"])), lm_loss,
                               microbatches=M) for m in (model, other)]
    pipes[1].load_state_dict(copy.deepcopy(pipes[0].state_dict()))
    for p, q in zip(model.state_dict().values(), other.state_dict().values()):
        assert torch.equal(p, q)
    for pipe in pipes:
        pipe.close()


def test_v_placement_sends_the_context_on_first_hops_only() -> None:
    """Counted on the wire: the hop into a rank's first chunk carries the hidden state and the
    context (schema, hidden, position ids, cos, sin); the hops into later chunks the hidden
    state alone. Gradients never carry the context back."""
    stages = aioready.split(llama(), stages=4, placement="v", **NAMES["llama"])
    sent: dict[tuple[str, int], set[int]] = {}

    async def main() -> None:
        pipe = aioready.Pipeline(list(stages), lm_loss, microbatches=M, hint="zbv",
                                 split_backward=True)
        for rt in pipe.runtimes:
            def spy(dest: int, msg: object, send: object = rt.transport.send_nowait) -> None:
                key = (msg.kind.name, msg.stage)  # type: ignore[attr-defined]
                tensors = [t for t in msg.tensors if t is not None]  # type: ignore[attr-defined]
                sent.setdefault(key, set()).add(len(tensors))
                send(dest, msg)  # type: ignore[operator]
            rt.transport.send_nowait = spy  # type: ignore[method-assign]
        try:
            await pipe.step(*batch())
        finally:
            pipe.close()
    aioready.run(main())
    assert sent[("ACTIVATION", 1)] == {5}
    assert sent[("ACTIVATION", 2)] == {1} and sent[("ACTIVATION", 3)] == {1}
    assert all(sent[("GRADIENT", s)] == {1} for s in range(3))  # the hidden state's only


@pytest.mark.parametrize("make, name", [(gpt, "gpt"), (llama, "llama")])
def test_tied_embedding_and_head_train_exactly_on_the_v_placement(make: object,
                                                                  name: str) -> None:
    """V puts the first and last stage on rank 0: a tied parameter gets both contributions."""
    model = make()  # type: ignore[operator]
    if name == "gpt":
        model.head.weight = model.tok.weight
    else:
        model.lm_head.weight = model.model.embed_tokens.weight
    ref_loss, ref = unsplit(model, *batch())
    stages = aioready.split(model, stages=4, placement="v", **NAMES[name])
    assert len(stages.parameters_of(0)) == len({id(p) for s in stages.of_rank(0)
                                                for p in s.parameters()})
    loss = run_split(model, NAMES[name], "v", "zbv", 4, True, False)
    assert abs(loss - ref_loss) <= TOL
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert float((p.grad - q.grad).abs().max()) <= TOL, n
