"""Structured stage boundaries: dicts, tuples and small plain values cross as flat tensors.

The codec (transports/structure.py) round-trips every allowed leaf kind, refuses what cannot
travel naming the stage and the key, and validates what it receives; a pipeline whose stages pass
dicts and tuples with plain values trains exactly like the same stages composed by hand.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import aioready
from aioready.errors import ProtocolError, StageError
from aioready.transports.structure import MAGIC, MAX_SCHEMA_BYTES, flatten, is_schema, unflatten

TOL = 1e-10


def test_plain_values_need_no_schema() -> None:
    x, y = torch.ones(2), torch.zeros(3)
    assert flatten(x, stage=0) == (x,)
    assert flatten((x, None, y), stage=0) == (x, None, y)


def test_every_leaf_kind_round_trips() -> None:
    a = torch.randn(2, 3, requires_grad=True)
    b = torch.arange(4)
    value = {"h": a, "ctx": {"ids": b, "flags": [True, False], "n": -7, "scale": 0.5,
                             "name": "rope", "none": None, "pair": (b, 3)}}
    slots = flatten(value, stage=1)
    assert is_schema(slots[0]) and len(slots) == 4  # schema, a, b, b
    args, kept = unflatten(slots, stage=2, detach=False)
    assert len(args) == 1 and args[0]["h"] is a and args[0]["ctx"]["pair"][0] is b
    got = dict(args[0]["ctx"])
    assert got["flags"] == [True, False] and got["n"] == -7 and got["scale"] == 0.5
    assert got["name"] == "rope" and got["none"] is None and got["pair"][1] == 3
    assert kept[1:] == (a, b, b)


def test_a_tuple_becomes_the_next_stages_arguments() -> None:
    h = torch.randn(2)
    args, _ = unflatten(flatten((h, {"k": 1}), stage=0), stage=1, detach=False)
    assert args[0] is h and args[1] == {"k": 1}


def test_only_tensors_that_needed_a_gradient_get_one() -> None:
    h = torch.randn(2, requires_grad=True) * 2
    cos = torch.randn(2)  # computed without a graph, like a rotary cache
    args, kept = unflatten(flatten({"h": h, "cos": cos}, stage=0), stage=1, detach=True)
    assert args[0]["h"].requires_grad and args[0]["h"].is_leaf
    assert not args[0]["cos"].requires_grad
    with torch.no_grad():  # recompute's F: floating tensors are assumed to need one
        slots = flatten({"h": h.detach()}, stage=0, assume_grad=True)
    assert unflatten(slots, stage=1, detach=True)[0][0]["h"].requires_grad


class Cache:
    pass


@pytest.mark.parametrize("value, key, why", [
    ({"kw": {"cache": Cache()}}, "['kw']['cache']", "a test_structure.Cache"),
    ((torch.ones(1), "x" * 65), "[1]", "a string too long"),
    ({1: torch.ones(1)}, "(the whole value)", "a dict key that is not a short str"),
    ({"n": 2 ** 64}, "['n']", "an int outside int64"),
    ({"f": float("nan")}, "['f']", "a float that is not finite"),
])
def test_what_cannot_travel_is_named(value: object, key: str, why: str) -> None:
    with pytest.raises(StageError) as info:
        flatten(value, stage=3)
    text = str(info.value)
    assert f"stage 3 output {key} cannot cross a stage boundary: {why}" in text


def test_too_deep_and_too_large_are_refused() -> None:
    deep: object = torch.ones(1)
    for _ in range(20):
        deep = [deep]
    with pytest.raises(StageError, match="nested deeper than 16"):
        flatten(deep, stage=0)
    with pytest.raises(StageError, match=f"<= {MAX_SCHEMA_BYTES} bytes"):
        flatten({f"k{i}": i for i in range(600)}, stage=0)


def schema(tree: object) -> torch.Tensor:
    return torch.frombuffer(bytearray(MAGIC + json.dumps(tree).encode()), dtype=torch.uint8)


@pytest.mark.parametrize("slots, what", [
    ((schema(["D", [["h", ["t", 1]]]]),), "fewer tensors"),
    ((schema(["t", 1]), torch.ones(1), torch.ones(1)), "more tensors"),
    ((schema(["X", 1]),), "unknown structure node"),
    ((schema(["i", 2 ** 70]),), "bad 'i' value"),
    ((schema(["t", 7]), torch.ones(1)), "bad tensor node"),
    ((torch.frombuffer(bytearray(MAGIC + b"{nope"), dtype=torch.uint8),), "not valid JSON"),
])
def test_received_structures_are_validated(slots: tuple, what: str) -> None:
    with pytest.raises(ProtocolError, match=f"stage 4 input: .*{what}"):
        unflatten(slots, stage=4, detach=True)


class DictOut(nn.Module):
    """Returns the hidden state with a context: a mask, an int and a flag."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6).double()

    def forward(self, x: torch.Tensor) -> dict:
        return {"h": self.lin(x), "ctx": {"mask": x > 0, "scale": 3, "on": True, "nothing": None}}


class DictIn(nn.Module):
    def __init__(self, last: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6).double()
        self.last = last

    def forward(self, d: dict) -> object:
        ctx = d["ctx"]
        assert ctx["on"] is True and ctx["nothing"] is None
        h = self.lin(d["h"]).masked_fill(~ctx["mask"], 0.0) * ctx["scale"]
        return h if self.last else (h, ctx["scale"])


class TupleIn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6).double()

    def forward(self, h: torch.Tensor, scale: int) -> torch.Tensor:
        return self.lin(h) / scale


def dict_stages(seed: int) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [DictOut(), DictIn(last=False), TupleIn()]


def by_hand(stages: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    d = stages[0](x)
    return stages[2](*stages[1](d))


@pytest.mark.parametrize("split", [False, True])
async def test_dict_and_tuple_boundaries_train_exactly(split: bool) -> None:
    gen = torch.Generator().manual_seed(2)
    xs = [torch.randn(3, 6, generator=gen, dtype=torch.float64) for _ in range(4)]
    ys = [torch.randn(3, 6, generator=gen, dtype=torch.float64) for _ in range(4)]
    ref, stages = dict_stages(5), dict_stages(5)
    total = 0.0
    for x, y in zip(xs, ys):
        loss = nn.functional.mse_loss(by_hand(ref, x), y) / 4
        loss.backward()
        total += float(loss.detach())
    pipe = aioready.Pipeline(stages, nn.functional.mse_loss, microbatches=4, hint="1f1b",
                             split_backward=split)
    try:
        loss = await pipe.step(xs, ys)
    finally:
        pipe.close()
    assert abs(float(loss) - total) <= TOL
    for s, r in zip(stages, ref):
        for p, q in zip(s.parameters(), r.parameters()):
            assert float((p.grad - q.grad).abs().max()) <= TOL


async def test_a_stage_output_that_cannot_travel_fails_the_step_by_name() -> None:
    class Leaky(nn.Module):
        def forward(self, x: torch.Tensor) -> dict:
            return {"h": x * 2, "past_key_values": Cache()}

    pipe = aioready.Pipeline([Leaky(), nn.Identity()], nn.functional.mse_loss, microbatches=2)
    try:
        with pytest.raises(StageError, match=r"stage 0 output \['past_key_values'\] cannot "
                                             r"cross a stage boundary"):
            await pipe.step(torch.randn(4, 3), torch.randn(4, 3))
    finally:
        pipe.close()
