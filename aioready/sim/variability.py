"""Variability: seeded jitter models named by a short spec, turned into task durations.

A spec is one or more terms joined by `+` (docs/architecture.md "Variability and traces"):

  none                          every task takes its base duration
  lognormal:SIGMA               each task x exp(SIGMA*z - SIGMA**2/2): mean-preserving (mean 1,
                                median exp(-SIGMA**2/2)), independent per task
  multimodal:FRACTION:FACTOR[:NOISE]
                                that fraction of microbatches (say, those with images) costs
                                FACTOR x at every stage and kind, drawn per (step, microbatch);
                                plus mean-preserving lognormal noise per task, NOISE=0.1 by default
  straggler:RANK:FACTOR         every task of the stages RANK holds costs FACTOR x
  comm:MEAN_MS[:SIGMA]          each message is delayed MEAN_MS (x mean-preserving lognormal
                                SIGMA per message, 0 by default)

Compute factors multiply; comm delays add. Durations are in ms (the trace unit). Base durations
are parameters: F=1, B=2 unsplit; B=1, W=1 split.

Note [order-free draws]: no generator state is shared between tasks. Every draw is a hash
(splitmix64) of (seed, term, step, stage, microbatch, kind), computed for a whole step at once with
numpy, so the same seed gives the same durations on every rank and every run, whatever order the
tasks run in and whichever rank asks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..errors import TraceError
from ..placement import Placement
from ..tasks import Kind
from ..transports.base import Message, MessageKind

__all__ = ["BaseDurations", "Term", "JitterSpec", "parse_jitter", "JitterModel", "TERMS"]

TERMS = {  # name -> (required params, optional params)
    "none": ((), ()),
    "lognormal": (("SIGMA",), ()),
    "multimodal": (("FRACTION", "FACTOR"), ("NOISE",)),
    "straggler": (("RANK", "FACTOR"), ()),
    "comm": (("MEAN_MS",), ("SIGMA",)),
}
_SPEC_FORMS = ("none | lognormal:SIGMA | multimodal:FRACTION:FACTOR[:NOISE] | "
               "straggler:RANK:FACTOR | comm:MEAN_MS[:SIGMA], joined by '+'")


@dataclass(frozen=True, slots=True, kw_only=True)
class BaseDurations:
    """Durations before jitter, in ms (trace units)."""

    f: float = 1.0
    """forward"""
    b: float = 2.0
    """backward, unsplit (input and weight gradient)"""
    b_split: float = 1.0
    """input-gradient backward when backward is split"""
    w: float = 1.0
    """weight gradient when backward is split"""

    def __post_init__(self) -> None:
        for name in ("f", "b", "b_split", "w"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise TraceError(f"base duration {name} must be a finite number >= 0",
                                 expected=">= 0 ms", got=value)

    def vector(self, split_backward: bool) -> np.ndarray:
        """[F, B, W] in ms; W is 0 when backward is not split."""
        if split_backward:
            return np.array([self.f, self.b_split, self.w])
        return np.array([self.f, self.b, 0.0])


@dataclass(frozen=True, slots=True)
class Term:
    """One term of a jitter spec: its name and numeric parameters."""

    name: str
    params: tuple[float, ...] = ()

    def __str__(self) -> str:
        return ":".join([self.name, *(f"{p:g}" for p in self.params)])


@dataclass(frozen=True, slots=True)
class JitterSpec:
    """A parsed spec: compute terms multiply, comm terms add."""

    terms: tuple[Term, ...] = field(default_factory=tuple)

    @property
    def has_compute(self) -> bool:
        return any(t.name not in ("none", "comm") for t in self.terms)

    @property
    def has_comm(self) -> bool:
        return any(t.name == "comm" for t in self.terms)

    def __str__(self) -> str:
        return "+".join(str(t) for t in self.terms) or "none"


MAX_SIGMA = 4.0  # lognormal: at 40 every duration was ~1e-320 and efficiency 1e11


def _number(text: str, what: str, spec: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise TraceError(f"jitter spec {spec!r}: {what} is not a number",
                         expected=f"a number for {what}", got=repr(text)) from None
    if not math.isfinite(value):
        raise TraceError(f"jitter spec {spec!r}: {what} must be finite", expected="a finite number",
                         got=text)
    return value


def _check_term(term: Term, spec: str) -> None:
    p = term.params
    bad: str | None = None
    if term.name == "lognormal" and not 0 <= p[0] <= MAX_SIGMA:
        bad = f"0 <= SIGMA <= {MAX_SIGMA:g} (the mean-keeping factor exp(-SIGMA^2/2) " \
            "underflows beyond)"
    elif term.name == "multimodal" and not (0 <= p[0] <= 1 and p[1] > 0 and
                                            (len(p) < 3 or p[2] >= 0)):
        bad = "0 <= FRACTION <= 1, FACTOR > 0, NOISE >= 0"
    elif term.name == "straggler" and not (p[0] >= 0 and p[0] == int(p[0]) and p[1] > 0):
        bad = "RANK an integer >= 0, FACTOR > 0"
    elif term.name == "comm" and not (p[0] >= 0 and (len(p) < 2 or p[1] >= 0)):
        bad = "MEAN_MS >= 0, SIGMA >= 0"
    if bad:
        raise TraceError(f"jitter spec {spec!r}: term {str(term)!r} is out of range",
                         expected=bad, got=str(term))


def parse_jitter(spec: str | JitterSpec) -> JitterSpec:
    """Parse `multimodal:0.3:3+comm:0.1` and the like; TraceError names the bad term."""
    if isinstance(spec, JitterSpec):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise TraceError("empty jitter spec", expected=_SPEC_FORMS, got=repr(spec))
    terms = []
    for raw in spec.split("+"):
        name, *args = raw.strip().split(":")
        name = name.strip().lower()
        if name not in TERMS:
            raise TraceError(f"jitter spec {spec!r}: unknown term {name!r}",
                             expected=_SPEC_FORMS, got=raw.strip())
        need, optional = TERMS[name]
        if not len(need) <= len(args) <= len(need) + len(optional):
            form = ":".join([name, *need, *(f"[{o}]" for o in optional)])
            raise TraceError(f"jitter spec {spec!r}: wrong number of parameters for {name}",
                             expected=form, got=raw.strip())
        names = need + optional
        term = Term(name, tuple(_number(a, names[i], spec) for i, a in enumerate(args)))
        _check_term(term, spec)
        terms.append(term)
    return JitterSpec(tuple(t for t in terms if t.name != "none"))


# -- order-free random draws (Note [order-free draws]) ------------------------------------------
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijective, well-mixed hash of 64-bit words."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def _hash(*keys: int | np.ndarray) -> np.ndarray:
    h = np.zeros(1, dtype=np.uint64)  # 1-d: numpy warns on overflow of 0-d scalars only
    for key in keys:
        h = _mix(h ^ (np.asarray(key).astype(np.uint64) + _GOLDEN))
    return np.asarray(h)


def _uniform(*keys: int | np.ndarray) -> np.ndarray:
    """Uniform in (0, 1), one per broadcast element of the keys."""
    return ((_hash(*keys) >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0 ** -53


def _normal(*keys: int | np.ndarray) -> np.ndarray:
    """Standard normal by Box-Muller from two independent uniforms of the same keys."""
    u1, u2 = _uniform(*keys, 1), _uniform(*keys, 2)
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


def _lognormal(sigma: float, *keys: int | np.ndarray) -> np.ndarray:
    """Mean-preserving lognormal factor: E = 1."""
    return np.exp(sigma * _normal(*keys) - 0.5 * sigma * sigma)


def _multimodal_size(params: tuple[float, ...], keys: tuple[int, int, int],
                     mb: np.ndarray) -> np.ndarray:
    """A multimodal term's factor per (step, microbatch), the same at every stage and kind:
    FACTOR where the microbatch is heavy, else 1. One draw for the durations and for the sizes
    a job knows before running it (`JitterModel.sizes`), so the two cannot drift apart."""
    return np.where(_uniform(*keys, mb, 0) < params[0], params[1], 1.0)


class StepTables:
    """Per-step duration tables, each computed once (`_compute`), and `ms` read from a nested
    list copy of the table: on the simulator's per-task path a list index is several times
    cheaper than a numpy scalar. Shared by the jitter model and its reordering (sim/order.py)."""

    def __init__(self) -> None:
        self._tables: dict[int, np.ndarray] = {}
        self._lists: dict[int, list[list[list[float]]]] = {}

    def _compute(self, step: int) -> np.ndarray:
        raise NotImplementedError

    def table(self, step: int) -> np.ndarray:
        table = self._tables.get(step)
        if table is None:
            table = self._tables[step] = self._compute(step)
        return table

    def ms(self, step: int, stage: int, microbatch: int, kind: Kind) -> float:
        rows = self._lists.get(step)
        if rows is None:
            rows = self._lists[step] = self.table(step).tolist()
        return rows[stage][microbatch][kind]  # type: ignore[no-any-return]


class JitterModel(StepTables):
    """Seeded task and message durations of one pipeline shape under a jitter spec."""

    def __init__(self, spec: str | JitterSpec = "none", *, seed: int = 0, placement: Placement,
                 num_microbatches: int, split_backward: bool = False,
                 base: BaseDurations | None = None) -> None:
        self.spec = parse_jitter(spec)
        self.seed = int(seed)
        if self.seed < 0:
            raise TraceError("seed must be >= 0", expected=">= 0", got=seed)
        self.placement = placement
        self.num_microbatches = num_microbatches
        self.split_backward = split_backward
        self.base = base or BaseDurations()
        for term in self.spec.terms:
            if term.name == "straggler" and term.params[0] >= placement.num_ranks:
                raise TraceError(f"jitter term {term}: no such rank", got=int(term.params[0]),
                                 expected=f"a rank in 0..{placement.num_ranks - 1}")
        super().__init__()
        self._comm: dict[int, list[list[list[float]]]] = {}

    def _compute(self, step: int) -> np.ndarray:
        S, M = self.placement.num_stages, self.num_microbatches
        stage = np.arange(S).reshape(S, 1, 1)
        mb = np.arange(M).reshape(1, M, 1)
        kind = np.arange(3).reshape(1, 1, 3)
        out = np.broadcast_to(self.base.vector(self.split_backward), (S, M, 3)).copy()
        for index, term in enumerate(self.spec.terms):
            keys = (self.seed, index, step)
            p = term.params
            if term.name == "lognormal":
                out *= _lognormal(p[0], *keys, stage, mb, kind)
            elif term.name == "multimodal":
                out *= _multimodal_size(p, keys, mb)
                noise = p[2] if len(p) > 2 else 0.1
                if noise > 0:
                    out *= _lognormal(noise, *keys, stage, mb, kind, 1)
            elif term.name == "straggler":
                slow = np.zeros((S, 1, 1))
                slow[list(self.placement.stages_of(int(p[0])))] = 1.0
                out *= np.where(slow > 0, p[1], 1.0)
        return out

    def sizes(self, step: int) -> np.ndarray | None:
        """Each microbatch's size factor in `step`: the product of its per-microbatch terms
        (multimodal: FACTOR when heavy), shared by every stage and kind; no per-task noise.
        What a job knows of a microbatch before running it (sim/order.py). None without a
        per-microbatch term (every size is 1)."""
        if not any(t.name == "multimodal" for t in self.spec.terms):
            return None
        out = np.ones(self.num_microbatches)
        mb = np.arange(self.num_microbatches)
        for index, term in enumerate(self.spec.terms):
            if term.name == "multimodal":
                out *= _multimodal_size(term.params, (self.seed, index, step), mb)
        return out

    def comm_table(self, step: int) -> np.ndarray:
        """Message delays in ms, shape (destination stage, microbatch, 2) indexed by
        MessageKind.ACTIVATION / GRADIENT order (0 activation, 1 gradient)."""
        S, M = self.placement.num_stages, self.num_microbatches
        out = np.zeros((S, M, 2))
        stage = np.arange(S).reshape(S, 1, 1)
        mb = np.arange(M).reshape(1, M, 1)
        which = np.arange(2).reshape(1, 1, 2)
        for index, term in enumerate(self.spec.terms):
            if term.name == "comm":
                sigma = term.params[1] if len(term.params) > 1 else 0.0
                factor = _lognormal(sigma, self.seed, index, step, stage, mb, which, 7) \
                    if sigma > 0 else 1.0
                out = out + term.params[0] * factor
        return out

    def comm_ms(self, step: int, dest_stage: int, microbatch: int, gradient: bool) -> float:
        rows = self._comm.get(step)
        if rows is None:
            rows = self._comm[step] = self.comm_table(step).tolist()
        return rows[dest_stage][microbatch][1 if gradient else 0]  # type: ignore[no-any-return]

    def delay(self, scale: float = 1e-3) -> Callable[[int, int, Message], float] | None:
        """An InprocWorld delay function (loop-clock units: ms x scale), or None without comm."""
        if not self.spec.has_comm:
            return None

        def delay(src: int, dst: int, msg: Message) -> float:
            return scale * self.comm_ms(msg.step, msg.stage, msg.microbatch,
                                        msg.kind is MessageKind.GRADIENT)
        return delay

    def __repr__(self) -> str:
        return (f"<JitterModel {self.spec} seed={self.seed} stages={self.placement.num_stages} "
                f"M={self.num_microbatches}>")
