"""Which rank holds which stage: linear, interleaved (loop) and V placements.

A rank's chunks are numbered in the order a microbatch's forward visits them, which is also
ascending stage order, so chunk 0 is the rank's entry stage (where a microbatch first arrives).
Placements (docs/hints.md "Placements"):
  linear       S = R, rank r holds stage r
  interleaved  S = v*R, rank r holds stages r, r+R, ..., chunk c = stage c*R + r (Megatron VPP)
  v            S = 2R, rank r holds stages r and 2R-1-r (ZBV, DualPipeV)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import ConfigError

__all__ = ["Placement", "STYLES", "MAX_STAGES"]

STYLES = ("linear", "interleaved", "v")
MAX_STAGES = 65535


@dataclass(frozen=True, slots=True)
class Placement:
    """Stage-to-rank map of one pipeline."""

    num_stages: int
    num_ranks: int
    style: str = "linear"
    _rank_of: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _stages_of: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.style not in STYLES:
            raise ConfigError(
                "unknown placement style", expected=" | ".join(STYLES), got=repr(self.style)
            )
        if self.num_ranks < 1 or self.num_stages < 1:
            raise ConfigError(
                "placement needs at least one stage and one rank",
                expected="stages >= 1 and ranks >= 1",
                got=f"stages={self.num_stages}, ranks={self.num_ranks}",
            )
        if self.num_stages > MAX_STAGES:
            raise ConfigError(
                "too many stages", got=f"stages={self.num_stages}",
                expected=f"<= {MAX_STAGES} (a message's stage field is 16 bits)",
            )
        rank_of = [self._compute_rank(s) for s in range(self.num_stages)]
        buckets: list[list[int]] = [[] for _ in range(self.num_ranks)]  # one pass, not S x R
        for s, r in enumerate(rank_of):
            buckets[r].append(s)
        stages_of = tuple(tuple(b) for b in buckets)
        if any(not stages for stages in stages_of):
            raise ConfigError(
                "placement leaves a rank without a stage",
                expected=f"every one of {self.num_ranks} ranks holds a stage",
                got=f"stages per rank {[len(x) for x in stages_of]}",
            )
        object.__setattr__(self, "_rank_of", tuple(rank_of))
        object.__setattr__(self, "_stages_of", stages_of)

    def _compute_rank(self, stage: int) -> int:
        S, R = self.num_stages, self.num_ranks
        if self.style == "linear":
            if S != R:
                raise ConfigError(
                    "linear placement needs one stage per rank",
                    expected=f"stages == ranks ({R})",
                    got=f"stages={S}",
                    fix="use style='interleaved' or 'v' for several chunks per rank",
                )
            return stage
        if self.style == "interleaved":
            if S % R:
                raise ConfigError(
                    "interleaved placement needs stages to be a multiple of ranks",
                    expected=f"a multiple of {R}",
                    got=f"stages={S}",
                )
            return stage % R
        if S != 2 * R:
            raise ConfigError(
                "V placement needs exactly two stages per rank",
                expected=f"stages == 2*ranks ({2 * R})",
                got=f"stages={S}",
            )
        return stage if stage < R else 2 * R - 1 - stage

    @property
    def num_chunks(self) -> int:
        """Chunks per rank (the same on every rank for the supported styles)."""
        return self.num_stages // self.num_ranks

    def rank_of(self, stage: int) -> int:
        return self._rank_of[stage]

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages a rank holds, in chunk order."""
        return self._stages_of[rank]

    def stage_of(self, rank: int, chunk: int) -> int:
        return self._stages_of[rank][chunk]

    def chunk_of(self, stage: int) -> int:
        return self._stages_of[self._rank_of[stage]].index(stage)

    @classmethod
    def linear(cls, num_stages: int) -> "Placement":
        return cls(num_stages, num_stages, "linear")
