"""The arbiter policy against strict order, the lower bound and the offline optimum.

For S stages, M = 4S microbatches, each jitter and seed, every configuration in CONFIGS runs at
every budget in BUDGETS on the virtual clock (aioready.simulate, the real runtime), beside the
same hint in strict order at its default cap and strict 1F1B (unsplit). Reported per (S, jitter,
configuration, budget), over seeds:

  speedup       strict step time of the row's baseline / the row's step time (> 1: ready
                faster), median and worst seed
  vs 1f1b       strict 1F1B step time / the row's step time, median
  efficiency    lower bound / step time (aioready.telemetry.bounds), median
  in-order      in_order_bound / step time, median: the bound for schedules that keep each
                stage's forwards in microbatch order, as every hint does (with unlimited memory
                no such policy exceeds 1.000; the lower bound can be out of reach of them all)
  peak          the largest in-flight count any rank reached over the seeds (memory, in
                microbatches), beside the cap it ran under on rank 0

For the (S, M) of OPT_CASES, a few seeds, the offline optimum (bench/optimum.py, CP-SAT, a time
limit per instance) of each distinct (placement, split, caps) is computed on durations quantised
to 0.01 ms; every configuration of that placement and those caps is read against it:
optimum / step time, and the solver's proven bound / step time (the true optimum lies between).
The search starts from the simulated schedules, so it never reports worse than one of them.

Auto rows come in two readings. Hindsight (`auto`, `auto split`, ...): the candidates are
simulated on the very durations the row is scored on, the best of them in hindsight. Held-out
(`..., held-out`): the choice is made on another draw of the same jitter, step 1 of the seed,
with the scored step's microbatch sizes (`, last step`: without them, as Pipeline(hint="auto")
chooses from the step it measured), and the chosen hint, mode, policy, caps and order rule then
run on the scored durations (bench/policy_held.py); `..., held-out, window 4` chooses on steps
1-4 (their mean step time, as Pipeline(hint=AutoHint(window=4))). A held-out row is never
faster than its hindsight row: the hindsight row is the fastest fitting candidate of the same
set.

`auto bytes` rows give auto the column's budget in activation bytes (`memory="2x"`: twice
strict 1F1B's peak bytes per rank, sim/budget.py; held out: those bytes as a number), and
`--peak-bytes` adds a section with every row's peak bytes against strict 1F1B's on the same
durations, so that equal memory is measured (docs/policy_measurements.md "Auto at twice the
bytes").

A row is one line in CONFIGS (a new policy: `Config("auto", hint="auto", baseline="1f1b")`); a
budget is one entry of BUDGETS (keyword arguments to simulate and Pipeline). Within one (S,
jitter, seed) each distinct configuration is simulated once: the auto rows (sim/choice.py, with
its exact pruning) reuse the fixed rows' runs, since a run is a pure function of its
configuration; a candidate stopped past a bound is reused under any lower bound; auto rows that
differ only in their label (the given order where the durations carry no sizes) are one choice;
and the given-order auto rows run first, so the rows that also reorder reuse their candidates
(docs/policy_measurements.md "What a choice costs"). The points, then the optimum instances,
run in a pool of `--jobs` processes (one CP-SAT worker each when there are two).

Timing (2-core machine): the whole grid, `--seeds 10`, takes about an hour of two free cores,
most of it in the auto rows at S=32 (the held-out rows, whose choices reuse no fixed row's
run, add about as much again: at S = 4-16, 10 seeds, the auto rows took 159 s of CPU on
lognormal and 725 s on multimodal); the report's last line gives the wall time and the CPU
seconds the simulations took.

Some rows only, into the page: `--rows 'auto*' --update` reruns the rows whose label matches
and replaces exactly those rows in every table of policy.md and policy.json, its header naming
the command and commit they came from (bench/policy_page.py); `--merge NAME` does the same from
a rows page made earlier (`--rows ... --out NAME`).

Run: python -m bench.policy [--quick] [--seeds N] [--time-limit S] [--jobs N] [--opt-cases 4x8,..]
     [--rows LABEL[*],.. [--update | --out NAME]] [--rows .. --merge NAME,..]
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable, Sequence

from aioready.caps import parse_factor, resolve_caps
from aioready.clock import run_virtual
from aioready.devices import SimDevice
from aioready.hints import HintOrder
from aioready.placement import Placement
from aioready.runtime.pipeline import Pipeline
from aioready.schedulers import HINTS, make_hint
from aioready.schedulers.order import cost_order
from aioready.sim.budget import gated
from aioready.sim.choice import choose_auto
from aioready.sim.cutoff import Exceeded
from aioready.sim.durations import device_duration
from aioready.sim.memory import mean_bytes
from aioready.sim.order import known_costs
from aioready.sim.simulator import simulate
from aioready.sim.variability import JitterModel
from aioready.telemetry.bounds import in_order_bound

from .common import RESULTS, lean_gc, median, write_result
from .optimum import Instance, instance, schedule_of, solve
from .policy_held import KNOWN, RESAMPLE, WINDOW, choice_draw
from .policy_page import matches, update


@dataclass(frozen=True)
class Config:
    """One row: a hint run in `mode`, compared with `baseline` (default: the same hint) strict."""

    hint: str
    mode: str = "ready"
    label: str = ""
    baseline: str = ""
    split: bool | None = None  # None: what the hint needs (split for ZB-family hints)
    kwargs: tuple[tuple[str, Any], ...] = field(default=())
    budgets: tuple[str, ...] | None = None  # None: every budget of BUDGETS
    max_stages: int | None = None  # a costly row (auto simulates every candidate) stops here

    def runs(self, budget: str, S: int) -> bool:
        return ((self.budgets is None or budget in self.budgets)
                and (self.max_stages is None or S <= self.max_stages))

    @property
    def name(self) -> str:
        return self.label or f"{self.mode} {self.hint}"

    @property
    def split_backward(self) -> bool:
        return self.split if self.split is not None else _needs_split(self.hint)


def _needs_split(hint: str) -> bool:
    spec = HINTS.get(hint)
    return spec is not None and spec.needs_split is True


_HINTS = ("1f1b", "bf", "zb-h1", "bfw", "zbv", "interleaved-1f1b", "zb-h2", "interleaved-zb",
          "gpipe")
CONFIGS: list[Config] = [
    *(Config(h) for h in _HINTS),  # ready, the default (reserving) policy
    *(Config(h, label=f"greedy {h}", kwargs=(("policy", "greedy"),)) for h in _HINTS),
    *(Config(h, label=f"light {h}", kwargs=(("policy", "light"),)) for h in _HINTS),
    Config("auto", label="auto", baseline="1f1b", split=False, budgets=("2x",)),
    Config("auto", label="auto split", baseline="1f1b", split=True, budgets=("2x",)),
    # the same memory on every rank: twice what strict 1F1B holds on its fullest rank (2S), the
    # budget of devices that are all alike (hints like zb-h2 hold about 2S on every rank)
    Config("auto", label="auto split, 2S each", baseline="1f1b", split=True, budgets=("2x",),
           kwargs=(("uniform", True),)),
    # auto before the microbatch order (schedulers/order.py) was a candidate: the given order
    *(Config("auto", label=f"{label}, given order", baseline="1f1b", split=split,
             budgets=("2x",), kwargs=(*extra, ("order", "given")))
      for label, split, extra in (("auto", False, ()), ("auto split", True, ()),
                                  ("auto split, 2S each", True, (("uniform", True),)))),
    # held out: chosen on another draw of the same jitter, run on the scored one
    # (bench/policy_held.py); "known sizes" keeps the scored step's per-microbatch sizes
    *(Config("auto", label=f"{label}, held-out{suffix}", baseline="1f1b", split=split,
             budgets=("2x",), kwargs=(*extra, ("held", known)))
      for label, split, extra in (("auto", False, ()), ("auto split", True, ()),
                                  ("auto split, 2S each", True, (("uniform", True),)))
      for known, suffix in (("sizes", ""), ("step", ", last step"))),
    # a budget in activation bytes, not microbatches: the column's "2x" as memory="2x", twice
    # what strict 1F1B holds at its peak on each rank on the durations chosen on (sim/budget.py),
    # so a light microbatch costs less than a heavy one; hindsight and held out ("sizes")
    *(Config("auto", label=f"auto bytes{label}{suffix}", baseline="1f1b", split=split,
             budgets=("2x",), kwargs=(("bytes", True), *held))
      for label, split in (("", False), (" split", True))
      for held, suffix in (((), ""), ((("held", "sizes"),), ", held-out"))),
    # held out over a window: chosen on steps 1..WINDOW (their mean step time), as
    # Pipeline(hint=AutoHint(window=WINDOW)) chooses from its last steps (bench/policy_held.py)
    *(Config("auto", label=f"{label}, held-out, window {WINDOW}", baseline="1f1b", split=split,
             budgets=("2x",), kwargs=(*extra, ("held", "sizes"), ("window", WINDOW)))
      for label, split, extra in (("auto", False, ()), ("auto split", True, ()),
                                  ("auto split, 2S each", True, (("uniform", True),)))),
    # held out on one step and RESAMPLE - 1 resampled copies of it (aioready/sim/resample.py)
    *(Config("auto", label=f"{label}, held-out, resample {RESAMPLE}", baseline="1f1b",
             split=split, budgets=("2x",),
             kwargs=(*extra, ("held", "sizes"), ("copies", RESAMPLE - 1)))
      for label, split, extra in (("auto", False, ()), ("auto split", True, ()),
                                  ("auto split, 2S each", True, (("uniform", True),)))),
]
BUDGETS: dict[str, dict[str, Any]] = {"default": {}, "2x": {"cap": "2x"}}
JITTERS = ("lognormal:0.5", "multimodal:0.3:3", "lognormal:0.2+straggler:1:1.5")
STAGES = (4, 8, 16, 32)
# (S, M) where the optimum is computed; at S=8, M=32 the solver rarely improved on the
# simulated schedules within its time limit (docs/policy_measurements.md), so it is left out:
# --opt-cases
OPT_CASES = ((4, 8), (4, 16), (8, 16))
QUICK = {"stages": (4, 8), "seeds": 3, "opt_cases": ((4, 8), (8, 16)), "opt_seeds": 1}
UNIT_MS = 1e-2


@lru_cache(maxsize=None)
def _hint(name: str, S: int, M: int, split: bool) -> HintOrder | str:
    """Built once per process (a rule's derived sequence costs); a name the registry does not
    know (say, "auto") goes to simulate as it is."""
    if name not in HINTS:
        return name
    return make_hint(name, num_stages=S, num_microbatches=M, split_backward=split)


@lru_cache(maxsize=64)
def _in_order(hint: str, S: int, M: int, split: bool, jitter: str, seed: int) -> float:
    """The in-order bound (telemetry.bounds.in_order_bound) of these durations on `hint`'s
    placement: the simulator's durations, drawn from the same seeded model."""
    order = _hint(hint, S, M, split)
    assert isinstance(order, HintOrder)
    model = JitterModel(jitter, seed=seed, placement=order.placement, num_microbatches=M,
                        split_backward=split)
    return in_order_bound(order.placement, model.table(0), split)


def _held(cfg: Config) -> str | None:
    """What a held-out auto row knows of the scored step (bench/policy_held.py), else None."""
    return dict(cfg.kwargs).get("held")


def _strict(hint: str) -> Config:
    return Config(hint, mode="strict")


def sim_unit(S: int, jitter: str, seed: int) -> dict[str, Any]:
    """Every configuration and baseline for one (S, jitter, seed)."""
    M = 4 * S
    rows: dict[str, Any] = {}
    strict: dict[str, float] = {}
    strict_bytes: dict[str, list[int]] = {}  # peak activation bytes per rank (sim/memory.py)
    memo: dict[tuple[object, ...], Any] = {}  # one simulation per distinct configuration
    began = time.process_time()
    # auto rows in the given order first: their runs (finished, or stopped past a bound the
    # search over every order only lowers) are then reused by the rows that also reorder
    # (held-out rows last: their choice, run on these durations, is often one of these runs)
    for cfg in sorted(CONFIGS, key=lambda c: (c.hint not in HINTS and "held" in dict(c.kwargs),
                                              c.hint not in HINTS
                                              and dict(c.kwargs).get("order") != "given")):
        for budget, extra in BUDGETS.items():
            if not cfg.runs(budget, S):
                continue
            if cfg.hint in HINTS:
                r = _simulate(cfg, S, M, jitter, seed, extra, memo)
                rows[f"{cfg.name}|{budget}"] = {
                    "t": r.step_time, "eff": r.efficiency, "peak": max(r.peak_in_flight),
                    "cap0": r.cap[0], "ranks": r.ranks, "chosen": r.hint,
                    "pkb": list(r.peak_activation_bytes),
                    "ord": _in_order(cfg.hint, S, M, cfg.split_backward, jitter, seed)
                    / r.step_time}
            else:
                row = rows[f"{cfg.name}|{budget}"] = _auto(cfg, S, M, jitter, seed, extra, memo)
                row["ord"] = _in_order(row.pop("hint"), S, M, cfg.split_backward, jitter,
                                       seed) / row["t"]
        for base in (cfg.baseline or cfg.hint, "1f1b"):  # strict on the same durations
            key = f"{base}/{int(cfg.split_backward)}"
            if key not in strict:
                r = _simulate(Config(base, mode="strict", split=cfg.split_backward), S, M,
                              jitter, seed, {}, memo)
                strict[key], strict_bytes[key] = r.step_time, list(r.peak_activation_bytes)
    return {"rows": rows, "strict": strict, "strict_bytes": strict_bytes, "ranks_1f1b": S,
            "cpu_s": time.process_time() - began}


def _memo_key(order: HintOrder, mode: str, caps: Any, policy: str) -> tuple[object, ...]:
    """Strict runs its order whatever the cap (at or above its peak) and has no policy."""
    if mode == "strict":
        return (order.name, order.placement.style, order.split_backward, mode)
    return (order.name, order.placement.style, order.split_backward, mode, tuple(caps), policy)


def _simulate(cfg: Config, S: int, M: int, jitter: str, seed: int, extra: dict[str, Any],
              memo: dict[tuple[object, ...], Any]) -> Any:
    split = cfg.split_backward
    order = _hint(cfg.hint, S, M, split)
    assert isinstance(order, HintOrder)
    kwargs = dict(cfg.kwargs)
    policy = kwargs.pop("policy", "reserve")
    caps = resolve_caps(extra.get("cap"), order)
    return _reuse(memo, _memo_key(order, cfg.mode, caps, policy), None, lambda: simulate(
        stages=S, microbatches=M, hint=order, mode=cfg.mode, jitter=jitter, seed=seed,
        split_backward=split, policy=policy, cap=list(caps), **kwargs))


def _auto_budget(cfg: Config, S: int, M: int, extra: dict[str, Any]) -> Any:
    """An auto row's budget: the column's, or with `uniform` its largest per-rank value (of
    strict 1F1B's peaks) on every rank."""
    budget = extra.get("cap")
    if dict(cfg.kwargs).get("uniform"):
        return max(resolve_caps(budget, _hint("1f1b", S, M, cfg.split_backward)))  # type: ignore
    return budget


def auto_gate(cfg: Config, S: int, M: int, extra: dict[str, Any],
              scored_peak: Callable[[], Sequence[int]]) -> dict[str, Any]:
    """The keyword simulate(hint="auto") takes for an auto row's budget: `cap=`, or for a
    `bytes` row `memory=`. Hindsight: the column's "2x" as it is, twice the start hint's
    (1F1B's) strict peak bytes per rank on the durations chosen on, which are the scored ones
    (sim/budget.py). Held out: the same bytes as a number per rank, from `scored_peak()`
    (strict 1F1B's peak bytes per rank on the scored step): a device's memory is known before
    the step, and "2x" of the choice draw's own strict peak would be another budget, 9 %
    larger on one rank at S=4 in a trial (seeds 0-1)."""
    budget = _auto_budget(cfg, S, M, extra)
    kwargs = dict(cfg.kwargs)
    if not kwargs.get("bytes"):
        return {"cap": budget}
    if not kwargs.get("held"):
        return {"memory": budget}
    factor = parse_factor(budget, "bytes row budget", "'Nx'")
    return {"memory": [int(factor * b) for b in scored_peak()]}


def _gated(caps: Any, memory: Any) -> dict[str, Any]:
    """simulate's gate keyword for a candidate (sim/budget.py `gated`)."""
    return gated(caps, memory)


def _auto(cfg: Config, S: int, M: int, jitter: str, seed: int, extra: dict[str, Any],
          memo: dict[tuple[object, ...], Any]) -> dict[str, Any]:
    """What simulate(hint="auto") returns, with the unit's simulations reused: the choice
    is the same (every run is a pure function of its configuration). A held-out row (kwarg
    `held`, bench/policy_held.py) chooses on another draw instead, with its own memo, and its
    choice then runs on the scored durations."""
    split = cfg.split_backward
    kwargs = dict(cfg.kwargs)
    sized = known_costs(JitterModel(jitter, seed=seed, placement=Placement.linear(S),
                                    num_microbatches=M), 0) is not None
    # without sizes both held-out readings choose on the same draw: one choice
    held = kwargs.get("held") and (kwargs["held"] if sized else KNOWN[0])
    window, copies = kwargs.get("window", 1), kwargs.get("copies", 0)
    source: dict[str, Any] = ({"jitter": jitter, "seed": seed} if not held else
                              {"trace": choice_draw(jitter, seed, S, M, split, held,
                                                    window=window, copies=copies),
                               "steps": window + copies})
    draw = memo if not held else memo.setdefault(("draw", held, window, copies), {})

    def run(order: HintOrder, mode: str, caps: tuple[int, ...], policy: str,
            bound: float | None = None, memory: tuple[int, ...] | None = None,
            **how: str) -> Any:
        mb_order = how.get("microbatch_order", "given")
        key = _memo_key(order, mode, caps, policy) + ((mb_order,) if how else ()) + (
            (("memory", memory),) if memory else ())
        return _reuse(draw, key, bound, lambda: simulate(
            stages=S, microbatches=M, hint=order, mode=mode, split_backward=split,
            policy=policy, stop_after=bound, order=mb_order, **_gated(caps, memory), **source))
    reorder = None if kwargs.get("order") == "given" or not sized else (lambda order: True)
    gate = auto_gate(cfg, S, M, extra, lambda: _simulate(
        Config("1f1b", mode="strict", split=split), S, M, jitter, seed, {},
        memo).peak_activation_bytes)
    durations = source["trace"] if held else JitterModel(
        jitter, seed=seed, placement=Placement.linear(S), num_microbatches=M, split_backward=split)
    # what decides the choice (the unit's S, jitter and seed fix the durations): rows that
    # differ only in their label ("auto split" and "auto split, given order" where the
    # durations carry no sizes) are one choice
    row_key = ("auto", cfg.hint, split, str(gate), reorder is not None, held, window, copies)
    if row_key not in memo:
        tuning = choose_auto(run, cfg.hint, num_stages=S, num_ranks=None, num_microbatches=M,
                             split_backward=split, budget=gate.get("cap"),
                             memory=gate.get("memory"), reorder=reorder,
                             mean_bytes=lambda o: mean_bytes(durations, o.placement, 1))
        best = tuning.best
        choice, order = best.candidate.choice, best.candidate.order
        scored: Any = best
        if held:  # the choice, run on the scored durations (reused where a row ran it)
            hint = _hint(choice.hint, S, M, split)
            assert isinstance(hint, HintOrder)
            key = _memo_key(hint, choice.mode, choice.cap, choice.policy) + (
                (order,) if order != "given" else ()) + (
                (("memory", choice.memory),) if choice.memory else ())
            scored = _reuse(memo, key, None, lambda: simulate(
                stages=S, microbatches=M, hint=hint, mode=choice.mode, jitter=jitter,
                seed=seed, split_backward=split, policy=choice.policy, order=order,
                **_gated(choice.cap, choice.memory)))
        else:
            scored = draw[_memo_key(_hint(choice.hint, S, M, split), choice.mode,  # type: ignore
                                    choice.cap, choice.policy) + (
                (order,) if order != "given" else ()) + (
                (("memory", choice.memory),) if choice.memory else ())]
        memo[row_key] = {
            "t": scored.step_time, "eff": scored.efficiency,
            "peak": max(scored.peak_in_flight), "cap0": choice.cap[0], "ranks": len(choice.cap),
            "pkb": list(scored.peak_activation_bytes),
            # the byte budget per rank it was chosen within (None: a count budget)
            "limit_bytes": list(tuning.limit) if tuning.in_bytes else None,
            "memory": None if choice.memory is None else list(choice.memory),
            "chosen": f"auto:{best.candidate.label}", "hint": choice.hint,
            "mode": choice.mode, "policy": choice.policy, "order": order,
            "stopped": sum(r.stopped for r in tuning.rows), "candidates": len(tuning.rows),
            # what the chooser expected: the step time on the durations it chose on
            "t_chosen_on": best.step_time, "chosen_on": "scored" if not held else held}
    return dict(memo[row_key])


def _reuse(memo: dict[tuple[object, ...], Any], key: tuple[object, ...], bound: float | None,
           simulate_it: Any) -> Any:
    """One candidate's run, simulated at most once per unit where the answer is known: a
    finished run is its own answer under any bound (the tuner reads a step time over its bound
    as slower than the best, as a stopped one), and a run stopped past bound b1 exceeds any
    bound b <= b1 too (the tuner reads only "stopped" of it; its `at_least` stays a true lower
    bound). Otherwise it runs, and what it gave is kept."""
    known = memo.get(key)
    if isinstance(known, Exceeded):
        if bound is not None and bound <= known.bound:
            raise Exceeded(bound, known.at_least)
    elif known is not None:
        return known
    try:
        memo[key] = simulate_it()
    except Exceeded as stop:
        # a fresh one: the raised one's traceback holds the stopped run's every frame (the
        # runtimes, the loop), about 10 GB over an S=32 multimodal unit
        memo[key] = Exceeded(stop.bound, stop.at_least)
        raise
    return memo[key]


def _pipeline_run(cfg: Config, S: int, M: int, trace: Any, extra: dict[str, Any]) -> Any:
    """One step through Pipeline (for its spans and caps) on a trace's durations."""
    split = cfg.split_backward

    async def main() -> Any:
        pipe = Pipeline([None] * S, None, microbatches=M, hint=_hint(cfg.hint, S, M, split),
                        mode=cfg.mode, split_backward=split, **dict(cfg.kwargs), **extra,
                        device=SimDevice(device_duration(trace, 1.0), run_compute=False))
        await pipe.step()
        return pipe, pipe.last_step
    return run_virtual(main())


def _probe(jitter: str, seed: int, placement: Placement, M: int, split: bool) -> Instance:
    """The quantised durations of one step and the microbatches' known sizes (caps are set
    later, from the run)."""
    model = JitterModel(jitter, seed=seed, placement=placement, num_microbatches=M,
                        split_backward=split)
    return instance(model.table(0), placement=placement, split_backward=split,
                    caps=(1,) * placement.num_ranks, unit_ms=UNIT_MS, sizes=model.sizes(0))


def _placement(cfg: Config, S: int, M: int, extra: dict[str, Any], linear: Instance) -> Placement:
    """The placement a row runs on: its hint's, or for a hint chosen at run time (say,
    "auto"), the one it chose in a run on the linear placement's durations."""
    hint = _hint(cfg.hint, S, M, cfg.split_backward)
    if isinstance(hint, HintOrder):
        return hint.placement
    auto = Config(cfg.hint, mode=cfg.mode, split=cfg.split_backward)
    pipe, _ = _pipeline_run(auto, S, M, linear.trace(), {"cap": _auto_budget(cfg, S, M, extra)})
    return pipe.hint.placement  # type: ignore[no-any-return]


def _as_chosen(cfg: Config, S: int, M: int, probe: Instance, extra: dict[str, Any],
               jitter: str, seed: int) -> tuple[Config, dict[str, Any], tuple[int, ...] | None]:
    """A row chosen at run time ("auto") as the fixed configuration it chooses on these
    durations (a Pipeline's auto would run its start hint first), or a held-out row's on its
    other draw, else the row itself; and the microbatch order it chose (slot -> microbatch,
    from the probe's sizes), None for the given one."""
    if cfg.hint in HINTS:
        return cfg, extra, None
    order = dict(cfg.kwargs).get("order")
    held, window = _held(cfg), dict(cfg.kwargs).get("window", 1)
    copies = dict(cfg.kwargs).get("copies", 0)
    trace = probe.trace() if held is None else choice_draw(
        jitter, seed, S, M, cfg.split_backward, held, window=window, copies=copies)
    best = simulate(stages=S, microbatches=M, hint=cfg.hint, trace=trace,
                    split_backward=cfg.split_backward, cap=_auto_budget(cfg, S, M, extra),
                    order=order, steps=window + copies if held else 1).tuning.best.candidate
    chosen = best.choice
    slots = (None if best.order == "given" or probe.sizes is None
             else cost_order(list(probe.sizes), best.order, S, cfg.split_backward))
    return (Config(chosen.hint, mode=chosen.mode, split=cfg.split_backward,
                   kwargs=(("policy", chosen.policy),)), {"cap": list(chosen.cap)}, slots)


def _relabel(schedule: dict[Any, tuple[int, int]], slots: tuple[int, ...] | None
             ) -> dict[Any, tuple[int, int]]:
    """A schedule of reordered microbatches (slot i ran microbatch slots[i]) in the given
    order's labels, so that every run of a key is a start for the same instance."""
    if slots is None:
        return schedule
    return {(kind, stage, slots[mb]): span for (kind, stage, mb), span in schedule.items()}


def opt_unit(S: int, M: int, jitter: str, seed: int, time_limit: float,
             workers: int = 2) -> dict[str, Any]:
    """Each configuration against the optimum at its own placement, split and caps."""
    runs: dict[str, Any] = {}
    for cfg in [*CONFIGS, *{_strict(c.baseline or c.hint) for c in CONFIGS}]:
        for budget, extra in (BUDGETS.items() if cfg.mode != "strict" else [("default", {})]):
            if not cfg.runs(budget, S) or dict(cfg.kwargs).get("bytes"):
                continue  # the optimum's memory bound is a count (bench/optimum.py)
            split = cfg.split_backward
            placement = _placement(cfg, S, M, extra, _probe(jitter, seed, Placement.linear(S),
                                                           M, split))
            probe = _probe(jitter, seed, placement, M, split)
            run_cfg, run_extra, slots = _as_chosen(cfg, S, M, probe, extra, jitter, seed)
            ran = probe if slots is None else probe.permuted(slots)
            pipe, report = _pipeline_run(run_cfg, S, M, ran.trace(), run_extra)
            caps = tuple(min(rt.cap, M) for rt in pipe.runtimes)
            key = f"{placement.style}/{placement.num_ranks}/{int(split)}/{caps}"
            runs[f"{cfg.name}|{budget}"] = {"t": report.step_time, "key": key, "caps": caps,
                                            "inst": probe, "report": report, "slots": slots}
    out: dict[str, Any] = {"rows": {}, "optima": {}}
    for key in sorted({r["key"] for r in runs.values()}):
        mine = [r for r in runs.values() if r["key"] == key]
        inst = instance(mine[0]["inst"].table_ms(), placement=mine[0]["inst"].placement,
                        split_backward=mine[0]["inst"].split_backward, caps=mine[0]["caps"],
                        unit_ms=UNIT_MS)
        same = [r for r in runs.values() if r["key"].rsplit("/", 1)[0] == key.rsplit("/", 1)[0]]
        starts = [_relabel(schedule_of(r["report"].spans, UNIT_MS, r["report"].start),
                           r["slots"]) for r in same]
        opt = solve(inst, time_limit_s=time_limit, workers=workers, start_from=starts)
        out["optima"][key] = opt.as_dict()
    for name, r in runs.items():
        opt = out["optima"][r["key"]]
        out["rows"][name] = {"t": r["t"], "key": r["key"], "opt_eff": opt["makespan_ms"] / r["t"],
                             "bound_eff": opt["bound_ms"] / r["t"]}
    return out


def _summary(units: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for cfg in CONFIGS:
        split = int(cfg.split_backward)
        base = f"{cfg.baseline or cfg.hint}/{split}"
        for budget in BUDGETS:
            name = f"{cfg.name}|{budget}"
            if name not in units[0]["rows"]:
                continue
            speed = [u["strict"][base] / u["rows"][name]["t"] for u in units]
            same = units[0]["rows"][name]["ranks"] == units[0]["ranks_1f1b"]
            out[name] = {"speedup": median(speed), "worst": min(speed),
                         "chosen": sorted({u["rows"][name]["chosen"] for u in units}),
                         "vs_1f1b": median(u["strict"][f"1f1b/{split}"] / u["rows"][name]["t"]
                                           for u in units) if same else None,
                         "eff": median(u["rows"][name]["eff"] for u in units),
                         "ord": median(u["rows"][name]["ord"] for u in units),
                         # per seed, in seed order (policy.json;
                         # docs/policy_measurements.md reads tuning and validation seeds apart)
                         "eff_seeds": [u["rows"][name]["eff"] for u in units],
                         "speedup_seeds": speed,
                         "peak": max(u["rows"][name]["peak"] for u in units),
                         "cap0": units[0]["rows"][name]["cap0"],
                         **_bytes_summary(units, name, f"1f1b/{split}", same)}
    return out


def _bytes_summary(units: list[dict[str, Any]], name: str, base: str, same: bool
                   ) -> dict[str, Any]:
    """Peak activation bytes against strict 1F1B's on the same durations, per seed the
    largest ratio over ranks (rank r's peak / 1F1B's on rank r; the machine's ranks must
    match), and the most bytes any rank held (the model's, sim/memory.py)."""
    if not same or "strict_bytes" not in units[0]:
        return {}
    ratios = [max(p / max(b, 1) for p, b in zip(u["rows"][name]["pkb"], u["strict_bytes"][base]))
              for u in units]
    limits = [u["rows"][name].get("limit_bytes") for u in units]
    return {"bytes_vs_1f1b": median(ratios), "bytes_vs_1f1b_max": max(ratios),
            "bytes_vs_1f1b_seeds": ratios,
            "peak_bytes": max(max(u["rows"][name]["pkb"]) for u in units),
            "strict_peak_bytes": max(max(u["strict_bytes"][base]) for u in units),
            # a byte row: the most any rank held over its own budget (<= 1: within it)
            "bytes_vs_limit_max": None if None in limits else max(
                max(p / m for p, m in zip(u["rows"][name]["pkb"], lim))
                for u, lim in zip(units, limits))}


def bytes_table(results: dict[str, Any]) -> str:
    """Every row's peak activation bytes against strict 1F1B's on the same durations (split
    backward where the row's is), per jitter: the equal-memory check of the byte rows."""
    lines = []
    for jitter in dict.fromkeys(k.rsplit("@", 1)[0] for k in results):
        head = ["S", "configuration", "budget", "peak bytes / strict 1f1b's, rank by rank: "
                "median (worst seed)", "most held on a rank (MiB)", "strict 1f1b's (MiB)",
                "peak / own byte budget, worst"]
        lines += [f"### peak bytes: {jitter}", "", "| " + " | ".join(head) + " |",
                  "|" + "---|" * len(head)]
        for key in sorted((k for k in results if k.rsplit("@", 1)[0] == jitter),
                          key=lambda k: int(k.rsplit("@", 1)[1])):
            for cfg in CONFIGS:
                for budget in BUDGETS:
                    v = results[key].get(f"{cfg.name}|{budget}")
                    if v is None or "bytes_vs_1f1b" not in v:
                        continue
                    own = v["bytes_vs_limit_max"]
                    lines.append("| " + " | ".join([
                        key.rsplit("@", 1)[1], cfg.name, budget,
                        f"{v['bytes_vs_1f1b']:.3f} ({v['bytes_vs_1f1b_max']:.3f})",
                        f"{v['peak_bytes'] / 2**20:.1f}", f"{v['strict_peak_bytes'] / 2**20:.1f}",
                        "-" if own is None else f"{own:.3f}"]) + " |")
        lines.append("")
    return "\n".join(lines)


def sim_table(results: dict[str, Any]) -> str:
    lines = []
    for jitter in dict.fromkeys(k.rsplit("@", 1)[0] for k in results):
        head = ["S", "configuration"] + [f"{b}: {w}" for b in BUDGETS
                                          for w in ("speedup (worst)", "vs 1f1b", "eff",
                                                    "in-order", "peak/cap0")]
        lines += [f"### {jitter}", "", "| " + " | ".join(head) + " |",
                  "|" + "---|" * len(head)]
        for key in sorted((k for k in results if k.rsplit("@", 1)[0] == jitter),
                          key=lambda k: int(k.rsplit("@", 1)[1])):
            S = key.rsplit("@", 1)[1]
            for cfg in CONFIGS:
                cells = [S, cfg.name]
                if not any(f"{cfg.name}|{b}" in results[key] for b in BUDGETS):
                    continue
                for budget in BUDGETS:
                    v = results[key].get(f"{cfg.name}|{budget}")
                    if v is None:
                        cells += ["-"] * 5
                        continue
                    vs = "-" if v["vs_1f1b"] is None else f"{v['vs_1f1b']:.3f}"
                    cells += [f"{v['speedup']:.3f} ({v['worst']:.3f})", vs,
                              f"{v['eff']:.3f}", f"{v['ord']:.3f}", f"{v['peak']}/{v['cap0']}"]
                lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def opt_table(units: dict[str, list[dict[str, Any]]]) -> str:
    head = ["S, M", "jitter", "configuration"] + [f"{b}: {w}" for b in BUDGETS
                                                  for w in ("opt/t (bound/t)", "proven")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows = [*CONFIGS, *sorted({_strict(c.baseline or c.hint) for c in CONFIGS},
                              key=lambda c: c.hint)]
    for case, found in units.items():
        S, M, jitter = case.split("@")
        for cfg in rows:
            cells = [f"{S}, {M}", jitter, cfg.name]
            for b in BUDGETS:
                name = f"{cfg.name}|{b}"
                mine = [(u["rows"][name], u["optima"][u["rows"][name]["key"]]) for u in found
                        if name in u["rows"]]
                if not mine:
                    cells += ["-", "-"]
                    continue
                cells += [f"{median(r['opt_eff'] for r, _ in mine):.3f} "
                          f"({median(r['bound_eff'] for r, _ in mine):.3f})",
                          f"{sum(o['status'] == 'OPTIMAL' for _, o in mine)}/{len(mine)}"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def opt_seeds_list(units: dict[str, list[dict[str, Any]]]) -> str:
    """opt/t of each auto row over its seeds: median, the worst seed, how many reach 0.95. A
    list, not a table: bench/policy_page.py merges tables that policy.md has, and only those."""
    lines = []
    for case, found in units.items():
        S, M, jitter = case.split("@")
        for cfg in (c for c in CONFIGS if c.hint not in HINTS):
            name = f"{cfg.name}|2x"
            mine = [(u["seed"], u["rows"][name]["opt_eff"]) for u in found if name in u["rows"]]
            if not mine:
                continue
            seed, worst = min(mine, key=lambda sv: sv[1])
            lines.append(f"- S, M = {S}, {M}, {jitter}, {cfg.name}: opt/t median "
                         f"{median(v for _, v in mine):.3f}, worst {worst:.3f} (seed {seed}), "
                         f"{sum(v >= 0.95 for _, v in mine)}/{len(mine)} seeds >= 0.95 "
                         f"(seeds {mine[0][0]}-{mine[-1][0]})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"a reduced grid: {QUICK}")
    ap.add_argument("--seeds", type=int, default=None, help="seeds per point (default 10)")
    ap.add_argument("--opt-seeds", type=int, default=None, help="seeds per optimum case (2)")
    ap.add_argument("--time-limit", type=float, default=1.5,
                    help="CP-SAT seconds per optimum instance (default 1.5)")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes (at most 2)")
    ap.add_argument("--stages", default=None, help=f"comma-separated S values ({STAGES})")
    ap.add_argument("--opt-cases", default=None,
                    help="optimum cases as SxM, comma-separated (default 4x8,4x16,8x16); "
                    "'none': no optimum (say, for rows at an S it is not computed at)")
    ap.add_argument("--jitters", default=None,
                    help=f"comma-separated jitter specs (default {','.join(JITTERS)})")
    ap.add_argument("--rows", default=None,
                    help="only these rows, by label, comma-separated (a comma and a space "
                    "belong to a label); 'auto*' all whose label starts with 'auto'; results "
                    "then go to policy_rows.md/.json")
    ap.add_argument("--update", action="store_true",
                    help="with --rows: then put those rows into bench/results/policy.md and "
                    ".json in place of their old figures, the header saying which command and "
                    "commit they came from (bench/policy_page.py)")
    ap.add_argument("--merge", default=None, metavar="NAME[,NAME]",
                    help="with --rows: put the rows of pages made earlier with --rows --out "
                    "NAME into policy.md and .json, without running anything")
    ap.add_argument("--seed-from", type=int, default=0,
                    help="the first seed (say 5: held-out seeds 5.. when 0-4 tuned a change)")
    ap.add_argument("--peak-bytes", action="store_true",
                    help="add a section with every row's peak activation bytes against strict "
                    "1F1B's on the same durations (not in policy.md: --update would refuse "
                    "its tables)")
    ap.add_argument("--out", default=None, help="bench/results/OUT.md and .json (default "
                    "policy, or policy_rows with --rows)")
    args = ap.parse_args(argv)
    if (args.update or args.merge) and not args.rows:
        ap.error("--update and --merge replace the rows named by --rows")
    # a comma followed by a space is part of a label ("auto bytes, held-out")
    wanted = re.split(r",(?! )", args.rows) if args.rows else []
    order = [c.name for c in CONFIGS] + [c.name for c in sorted(
        {_strict(c.baseline or c.hint) for c in CONFIGS}, key=lambda c: c.hint)]
    if args.merge:
        notes = [update(RESULTS, name, wanted, order) for name in args.merge.split(",")]
        print("\n".join(notes))
        return "\n".join(notes)
    if args.rows:  # before the pool forks: the workers read CONFIGS
        CONFIGS[:] = [c for c in CONFIGS if matches(c.name, wanted)]
    out = args.out or ("policy_rows" if args.rows else "policy")
    stages = (tuple(int(s) for s in args.stages.split(",")) if args.stages
              else QUICK["stages"] if args.quick else STAGES)
    seeds = args.seeds or (QUICK["seeds"] if args.quick else 10)
    cases = (() if args.opt_cases == "none" else
             tuple(tuple(int(v) for v in c.split("x")) for c in args.opt_cases.split(","))
             if args.opt_cases else QUICK["opt_cases"] if args.quick else OPT_CASES)
    opt_seeds = args.opt_seeds or (QUICK["opt_seeds"] if args.quick else 2)
    cmd = shlex.join(["python", "-m", "bench.policy",
                      *(argv if argv is not None else sys.argv[1:])])
    began = time.perf_counter()
    jitters = tuple(args.jitters.split(",")) if args.jitters else JITTERS
    first = args.seed_from
    points = [(S, j, seed) for S in stages for j in jitters
              for seed in range(first, first + seeds)]
    points.sort(key=lambda p: -p[0])  # the largest first: the pool ends evenly
    jobs = max(1, min(2, args.jobs))
    with ProcessPoolExecutor(jobs, initializer=lean_gc) as pool:
        done = list(pool.map(sim_unit, *zip(*points)))
        results = {f"{j}@{S}": _summary([u for u, p in zip(done, points) if p[:2] == (S, j)])
                   for S in stages for j in jitters}
        sim_s = time.perf_counter() - began
        # one CP-SAT worker per process: the processes fill the cores, as the solver's own
        # workers would, and the per-instance time limit stays the same
        opt_points = [(S, M, j, seed) for S, M in cases for j in jitters
                      for seed in range(first, first + opt_seeds)]
        found = list(pool.map(opt_unit, *zip(*opt_points), [args.time_limit] * len(opt_points),
                              [2 if jobs == 1 else 1] * len(opt_points))) if opt_points else []
    optimum: dict[str, list[dict[str, Any]]] = {}
    for (S, M, jitter, seed), unit in zip(opt_points, found):
        optimum.setdefault(f"{S}@{M}@{jitter}", []).append({**unit, "seed": seed})
    opt_s = time.perf_counter() - began - sim_s
    body = "\n".join([
        f"M = 4S, {seeds} seeds per point (from seed {first}), jitters {', '.join(jitters)}; budgets: "
        + ", ".join(f"{b} {kw or '(the hint own cap)'}" for b, kw in BUDGETS.items()) + ".",
        "speedup: strict step time of the same hint / step time (> 1: faster than strict), "
        "median (worst seed); vs 1f1b: strict 1F1B step time on the same durations (split "
        "backward when the row's is) / step time, median; eff: lower "
        "bound / step time, median; in-order: "
        "the in-order bound (forwards in microbatch order on each stage, as every hint keeps "
        "them) / step time, median; peak/cap0: the largest in-flight count on any rank over "
        "the seeds / the cap of rank 0. Two-chunk hints (zbv, interleaved-*) put S stages on "
        "S/2 ranks, so their `vs 1f1b` is left out (`-`: another machine size). Split and "
        "unsplit rows draw different durations (the kinds differ). Auto rows choose on the "
        "scored durations themselves (hindsight); `..., held-out` rows choose on step 1 of "
        "the same seed with the scored step's microbatch sizes, `..., held-out, last step` on "
        f"step 1 as drawn, `..., held-out, window {WINDOW}` on steps 1-{WINDOW} with the scored "
        "step's sizes (their mean step time), and run their choice on the scored step "
        "(bench/policy_held.py).", "",
        sim_table(results),
        *(["## Peak activation bytes against strict 1F1B", "",
            "Per seed, the largest over ranks of the row's peak activation bytes on rank r over "
            "strict 1F1B's on rank r, same durations (split backward where the row's is; the "
            "simulator's model, 1 MiB per ms of a forward, sim/memory.py); median over seeds "
            "(worst seed). A row at or under 2.000 held at most twice 1F1B's bytes on every "
            "rank. The last column, for rows with a byte budget: the peak over the budget it "
            "was chosen within, on the rank and seed where it is largest.", "",
            bytes_table(results)] if args.peak_bytes else []),
        "## Against the offline optimum (bench/optimum.py)", "",
        f"CP-SAT, {args.time_limit:g} s per instance, {2 if jobs == 1 else 1} worker(s) in "
        f"each of {jobs} processes, durations quantised to "
        f"{UNIT_MS:g} ms, each configuration against the optimum at its own placement, split "
        "and caps. opt/t: median of best schedule found / step time; bound/t: median of the "
        "solver's proven bound / step time; the true efficiency lies between, and equals "
        "opt/t where every instance is proven optimal (proven: how many were). The search "
        "starts from the simulated schedules, so opt/t <= 1: a 1.000 can mean the solver did "
        "not improve on the policy in its time.", "", opt_table(optimum), "",
        "Per seed, the auto rows (opt/t):", "", opt_seeds_list(optimum), "",
        f"Running time: simulations {sim_s:.0f} s ({len(points)} points, {jobs} processes, "
        f"{sum(u['cpu_s'] for u in done):.0f} s of CPU), optimum {opt_s:.0f} s."])
    (RESULTS / f"{out}.json").write_text(json.dumps(
        {"command": cmd, "simulated": results, "optimum": optimum, "sim_s": sim_s,
         "opt_s": opt_s}, indent=1) + "\n")
    write_result(out, body, cmd)
    print(body)
    if args.update:
        print(update(RESULTS, out, wanted, order))
    return body


if __name__ == "__main__":
    main()
