"""`aioready train` with hint "auto" and nothing fixed: where the pipeline starts, agreed by
all ranks.

The default run (`aioready train` with no --hint) is hint="auto": after its first step the
pipeline simulates its candidate schedules on the measured durations and switches to the
fastest (runtime/autotune.py). Two things it cannot switch in a running pipeline are chosen
before step 0 by sim/start.py, on the durations model the run paces its tasks by: the
placement style when a rank holds several stages (--stages = 2 x ranks: interleaved or V), and
split backward when neither --split-backward nor --no-split-backward was given. Rank 0
simulates and sends the choice to the others as integers (no pickle); every rank then builds
its stages for that placement.

Its budget is activations held, one number for every rank (sim/start.default_budget: 1F1B's
peak on one stage per rank, ZBV's on two), unless --cap gives a count instead: the start and
every later choice are held to it (sim/budget.py, "held activations"), and the pipeline starts
under the start's own caps.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ..caps import CapSpec
from ..errors import ConfigError
from ..placement import Placement
from ..runtime.autotune import parse_auto
from ..sim.durations import base_durations
from ..sim.start import Start, choose_start, default_budget, unmodelled_start
from ..sim.tune import SimChooser

__all__ = ["default_auto", "auto_budget", "auto_chooser", "agreed_start", "needs_start"]


def default_auto(*, mode: str, memory: object, dp: int, tp: int) -> bool:
    """Whether `aioready train` with no --hint runs "auto": not where the caller fixed the
    order (--mode strict), gates by bytes (--memory: "--hint auto" chooses within the bytes,
    docs/policy.md "Choosing within the bytes in a Pipeline") or runs a process grid (--dp,
    --tp: the chooser agrees over one line); those keep 1F1B, the default of a Pipeline."""
    return mode == "ready" and memory is None and dp == 1 and tp == 1


def auto_budget(cfg: Any, num_ranks: int | None, start: Start | None = None) -> CapSpec:
    """The cap of a plain "auto" run: the caller's, else the start's caps, else (one stage per
    rank, where activations and microbatches are one) `default_budget` for every rank; None
    under --memory (auto chooses within the bytes)."""
    if cfg.memory is not None:
        return None
    if cfg.cap is not None or parse_auto(cfg.hint) != "":
        return cfg.cap  # type: ignore[no-any-return]
    if start is not None:
        return list(start.choice.cap)
    return default_budget(cfg.stages, num_ranks or cfg.stages, cfg.microbatches,
                          cfg.split_backward)


def auto_chooser(cfg: Any, start: Start | None) -> Any:
    """The chooser after step 1 of a plain "auto" run from a start, held to the start's
    activations (None: the default chooser, under the caller's --cap or --memory)."""
    if start is None or cfg.cap is not None or cfg.memory is not None:
        return None
    return SimChooser(activations=start.budget)


def _durations(cfg: Any) -> Any:
    """simulate()'s duration keywords for a shape, the model the run's tasks are paced by
    (sim/durations.paced_duration): the trace, or the jitter over base durations of F =
    task_ms."""
    def keywords(placement: Placement, split: bool) -> dict[str, Any]:
        if cfg.trace is not None:
            from ..sim.traces import read_trace
            loaded = read_trace(cfg.trace, placement=placement)
            if loaded.split_backward != split:
                raise ConfigError("the trace's backward", expected=f"split_backward={split}",
                                  got=f"split_backward={loaded.split_backward}")
            return {"trace": loaded}
        return {"jitter": cfg.jitter or "none", "seed": cfg.seed,
                "base": base_durations(cfg.task_ms)}
    return keywords


def needs_start(cfg: Any, num_ranks: int | None) -> bool:
    """A plain "auto" with something only the start can choose: the split, or the style."""
    ranks = num_ranks or cfg.stages
    return parse_auto(cfg.hint) == "" and (cfg.split_backward is None or cfg.stages != ranks)


async def agreed_start(cfg: Any, *, num_ranks: int | None, comm: Any) -> Start | None:
    """The start of a plain "auto" run (None when nothing is open); under a communicator of
    several ranks rank 0 chooses and broadcasts it."""
    if not needs_start(cfg, num_ranks):
        return None

    def choose() -> Start:
        if cfg.trace is None and cfg.task_ms == 0:  # compute only: nothing to simulate
            return unmodelled_start(num_stages=cfg.stages, num_ranks=num_ranks,
                                    num_microbatches=cfg.microbatches,
                                    split_backward=cfg.split_backward)
        return choose_start(num_stages=cfg.stages, num_ranks=num_ranks,
                            num_microbatches=cfg.microbatches,
                            split_backward=cfg.split_backward, durations=_durations(cfg),
                            cap=cfg.cap)
    if comm is None or comm.Get_size() == 1:
        return await asyncio.to_thread(choose)
    from ..telemetry.gather import root_decides

    async def decide() -> Start:  # in a thread: the loop keeps serving the transport meanwhile
        return await asyncio.to_thread(choose)
    return await root_decides(comm, decide if comm.Get_rank() == 0 else None,
                              Start.width(num_ranks or cfg.stages),
                              encode=Start.encode, decode=Start.decode,
                              what="schedule to start from")
