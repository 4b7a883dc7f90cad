"""Structured stage boundaries: dicts, tuples, lists and small plain values, as flat tensors.

A stage may return (and the next one receive) any nesting of tuples, lists and dicts with string
keys whose leaves are tensors, None, bools, ints, floats or short strings. The runtime and every
transport only ever move a flat tuple of tensors, so the structure travels as one more tensor:
`flatten` returns `(schema, *tensors)` where `schema` is a 1-D uint8 tensor holding a magic
prefix and a JSON description of the tree (tensors appear in it as placeholders, in order).
JSON, not pickle: decoding builds only containers and plain values, and `unflatten` validates
the size, the depth, the key and value types and the number of tensors before it builds anything.

A plain tensor or a tuple of tensors (and None) needs no schema and travels as before, so
hand-written stages pay nothing. Gradients flow back slot by slot: the schema slot and integer
tensors get None.
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import ProtocolError, StageError

__all__ = ["MAGIC", "MAX_SCHEMA_BYTES", "MAX_DEPTH", "MAX_STRING", "flatten", "unflatten",
           "is_schema"]

MAGIC = b"AIOB\x01"
MAX_SCHEMA_BYTES = 4096  # the JSON tree of one boundary value, magic included
MAX_DEPTH = 16  # nesting of containers
MAX_STRING = 64  # characters of a dict key or a string value
_INT_RANGE = (-(2 ** 63), 2 ** 63 - 1)


def _is_tensor(value: Any) -> bool:
    import torch
    return isinstance(value, torch.Tensor)


def _plain(value: Any) -> bool:
    """A value that needs no schema: a tensor, or a tuple of tensors and None."""
    if value is None or _is_tensor(value):
        return True
    return isinstance(value, tuple) and all(v is None or _is_tensor(v) for v in value)


def flatten(value: Any, *, stage: int, side: str = "output",
            assume_grad: bool = False) -> tuple[Any, ...]:
    """The flat tuple of tensors that carries `value` to the next stage.

    Each tensor is marked as needing a gradient if it requires one (or, with `assume_grad`,
    for a value computed without a graph, if it is floating point).

    Raises StageError naming the stage and the key path of a value that cannot travel.
    """
    if _plain(value):
        return value if isinstance(value, tuple) else (value,)
    leaves: list[Any] = []
    tree = _encode(value, leaves, [], stage, side, assume_grad)
    text = json.dumps(tree, separators=(",", ":"), allow_nan=False).encode()
    if len(MAGIC) + len(text) > MAX_SCHEMA_BYTES:
        raise StageError(f"stage {stage} {side}: the structure of the value is too large to "
                         "cross a stage boundary", expected=f"<= {MAX_SCHEMA_BYTES} bytes of "
                         "structure", got=f"{len(MAGIC) + len(text)} bytes",
                         fix="send fewer plain values, or pack them into a tensor")
    import torch
    schema = torch.frombuffer(bytearray(MAGIC + text), dtype=torch.uint8)
    return (schema, *leaves)


def _path(keys: list[Any]) -> str:
    return "".join(f"[{k!r}]" for k in keys) or "(the whole value)"


def _encode(value: Any, leaves: list[Any], keys: list[Any], stage: int, side: str,
            assume_grad: bool) -> Any:
    def refuse(why: str, got: Any) -> StageError:
        return StageError(f"stage {stage} {side} {_path(keys)} cannot cross a stage boundary: "
                          f"{why}", expected="a tensor, tuple, list, dict with str keys, None, "
                          f"bool, int, float or a str of <= {MAX_STRING} characters", got=got,
                          fix="compute it on the stage that needs it, or send it as a tensor")
    if len(keys) > MAX_DEPTH:
        raise refuse(f"nested deeper than {MAX_DEPTH}", f"depth {len(keys)}")
    if _is_tensor(value):
        leaves.append(value)
        grad = value.is_floating_point() if assume_grad else value.requires_grad
        return ["t", int(grad)]  # 0: the receiver computes no gradient for it
    if value is None:
        return ["n"]
    if isinstance(value, bool):
        return ["b", value]
    if isinstance(value, int):
        if not _INT_RANGE[0] <= value <= _INT_RANGE[1]:
            raise refuse("an int outside int64", value)
        return ["i", value]
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise refuse("a float that is not finite", value)
        return ["f", value]
    if isinstance(value, str):
        if len(value) > MAX_STRING:
            raise refuse("a string too long", f"{len(value)} characters")
        return ["s", value]
    if isinstance(value, (tuple, list)):
        tag = "T" if isinstance(value, tuple) else "L"
        return [tag, [_encode(v, leaves, keys + [i], stage, side, assume_grad)
                      for i, v in enumerate(value)]]
    if isinstance(value, dict):
        items = []
        for k, v in value.items():
            if not isinstance(k, str) or len(k) > MAX_STRING:
                raise refuse("a dict key that is not a short str", repr(k)[:80])
            items.append([k, _encode(v, leaves, keys + [k], stage, side, assume_grad)])
        return ["D", items]
    raise refuse(f"a {type(value).__module__}.{type(value).__qualname__}",
                 type(value).__qualname__)


def is_schema(value: Any) -> bool:
    """Whether a received slot is a structure schema written by `flatten`."""
    import torch
    if not (isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1
            and len(MAGIC) <= value.numel() <= MAX_SCHEMA_BYTES):
        return False
    return bytes(value[:len(MAGIC)].tolist()) == MAGIC


def unflatten(slots: tuple[Any, ...], *, stage: int, detach: bool
              ) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """The positional arguments of a stage from the flat slots it received, and the slots as
    the stage keeps them for backward.

    A tuple value becomes the arguments themselves (as a tuple of tensors always has); any
    other structure is the one argument. With `detach`, each tensor becomes a fresh leaf that
    requires a gradient only if the sender's tensor did.
    """
    tensors = slots[1:]
    raw = bytes(slots[0].tolist())[len(MAGIC):]
    try:
        tree = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _bad(stage, "the structure is not valid JSON", str(exc)[:80]) from None
    kept: list[Any] = [slots[0]]
    it = iter(tensors)
    value = _decode(tree, _Leaves(it, kept, detach), stage, 0)
    if next(it, _END) is not _END:
        raise _bad(stage, "more tensors than the structure names", len(tensors))
    return (value if isinstance(value, tuple) else (value,)), tuple(kept)


class _Leaves:
    """The received tensors in order, made into leaves as the structure asks."""

    def __init__(self, it: Any, kept: list[Any], detach: bool) -> None:
        self.it, self.kept, self.detach = it, kept, detach

    def take(self, grad: Any, stage: int) -> Any:
        value = next(self.it, _END)
        if value is _END:
            raise _bad(stage, "fewer tensors than the structure names", "too few")
        if grad not in (0, 1) or isinstance(grad, bool):
            raise _bad(stage, "a bad tensor node", repr(grad))
        if self.detach and value is not None:
            value = value.detach().requires_grad_(bool(grad) and (
                value.is_floating_point() or value.is_complex()))
        self.kept.append(value)
        return value


_END = object()


def _bad(stage: int, why: str, got: Any) -> ProtocolError:
    return ProtocolError(f"stage {stage} input: {why}", expected="a structure written by "
                         "aioready.transports.structure.flatten", got=got)


def _decode(node: Any, tensors: Any, stage: int, depth: int) -> Any:
    if depth > MAX_DEPTH + 1 or not isinstance(node, list) or not node or \
            not isinstance(node[0], str):
        raise _bad(stage, "a malformed structure node", repr(node)[:80])
    tag, rest = node[0], node[1:]
    if tag == "t" and len(rest) == 1:
        return tensors.take(rest[0], stage)
    if tag == "n" and not rest:
        return None
    if len(rest) != 1:
        raise _bad(stage, "a malformed structure node", repr(node)[:80])
    arg = rest[0]
    kinds = {"b": bool, "i": int, "f": (int, float), "s": str}
    if tag in kinds:
        if not isinstance(arg, kinds[tag]) or (tag != "b" and isinstance(arg, bool)) or \
                (tag == "s" and len(arg) > MAX_STRING) or \
                (tag == "i" and not _INT_RANGE[0] <= arg <= _INT_RANGE[1]):
            raise _bad(stage, f"a bad {tag!r} value", repr(arg)[:80])
        return float(arg) if tag == "f" else arg
    if tag in ("T", "L") and isinstance(arg, list):
        items = [_decode(v, tensors, stage, depth + 1) for v in arg]
        return tuple(items) if tag == "T" else items
    if tag == "D" and isinstance(arg, list):
        out = {}
        for pair in arg:
            if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)):
                raise _bad(stage, "a malformed dict entry", repr(pair)[:80])
            out[pair[0]] = _decode(pair[1], tensors, stage, depth + 1)
        return out
    raise _bad(stage, "an unknown structure node", repr(node)[:80])
