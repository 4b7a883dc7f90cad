"""A checkpoint's content digest: SHA-256 over everything a rank's file holds, in one order.

Why over the content and not over the file bytes: the digest travels inside the file it
protects (a rank writes one file, under MPI without talking to the others), and a digest cannot
cover the bytes that hold it. So it covers what loading the file gives back: every tensor's
dtype, shape and bytes and every other value's type and text, walked in a fixed order (mapping
keys sorted by their text). A flipped byte in any tensor or in the manifest changes it; a flip
in the container's framing makes the file unreadable instead. Either way the file is refused,
by name, before anything is loaded (runtime/checkpoint.py).
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping

__all__ = ["content_digest"]


def content_digest(obj: Any) -> str:
    """The hex SHA-256 of `obj` (tensors, mappings, sequences and primitives)."""
    h = hashlib.sha256()
    _walk(obj, h)
    return h.hexdigest()


def _walk(obj: Any, h: Any) -> None:
    if isinstance(obj, Mapping):
        h.update(b"{%d" % len(obj))
        for key in sorted(obj, key=repr):
            _walk(key, h)
            _walk(obj[key], h)
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(b"[%d" % len(obj))
        for item in obj:
            _walk(item, h)
        h.update(b"]")
    elif hasattr(obj, "dtype") and hasattr(obj, "untyped_storage"):  # a torch tensor
        t = obj.detach().cpu().contiguous().reshape(-1)
        h.update(f"T{t.dtype}{tuple(obj.shape)}".encode())
        import torch
        if t.numel():
            h.update(t.view(torch.uint8).numpy())  # no copy
    else:
        h.update(f"{type(obj).__name__}:{obj!r};".encode())
