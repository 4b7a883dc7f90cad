"""Figures of `python -m bench.e2e --scale` (bench/e2e_scale.py): the simulator's step for each
measured run, the rows aggregated over steps and seeds, the goal figures, the tables and the plot.
Every number in the page is computed here from the records; no figure is typed in by hand.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .common import median
from .e2e_scale import HINT_FOR_TORCH
from .e2e_worker import DEFAULT

__all__ = ["simulated", "summarize", "cpu_us_per_task", "add_ceiling"]


def _shape(rec: dict[str, Any], ranks: int, groups: int) -> Any:
    from aioready.placement import Placement

    from .e2e_worker import RunShape
    return RunShape(Placement(rec["num_stages"], ranks, rec["style"]), groups,
                    rec["split_backward"])


def _sim_args(rec: dict[str, Any], M: int) -> dict[str, Any] | None:
    """simulate() arguments for the record's configuration; None where it has no twin."""
    from .e2e_worker import parse_config
    if rec["side"] == "torch":
        hint = HINT_FOR_TORCH.get(rec["name"])
        return None if hint is None else {"hint": hint, "mode": "strict"}
    if rec["name"].split("+")[0] == DEFAULT:  # the same start, then chooses as it did
        from aioready.runtime.autotune import AutoHint
        from aioready.schedulers import make_hint
        start = make_hint(rec["start"]["hint"], num_stages=rec["num_stages"],
                          num_ranks=rec["num_stages"] // 2, num_microbatches=M,
                          split_backward=rec["split_backward"], placement=rec["style"])
        budget = rec["start"]["budget"]  # activations held; records before: in flight
        return {"hint": AutoHint(start=start), **(
            {"activations": budget} if rec["start"].get("budget_unit") == "activations"
            else {"cap": budget})}
    hint, mode, policy, cap = parse_config(rec["name"].split("+")[0])
    if hint == "auto":  # the same start placement and budget; the simulator chooses with
        return {"hint": "auto:1f1b", "mode": mode, "cap": cap}  # the measured steps' durations
    return {"hint": hint, "mode": mode, "policy": policy, "cap": cap}


def simulated(run: dict[str, Any]) -> dict[str, Any]:
    """Add each record's simulated step times (ms, one per measured step) and lower bounds."""
    from aioready.placement import Placement
    from aioready.sim.simulator import simulate
    from aioready.sim.traces import Trace, read_trace
    from aioready.telemetry.bounds import any_placement_bound, lower_bound_table

    from .e2e import split_spec
    from .e2e_worker import parse_straggler, stage_seconds

    S, groups, M, warmup = run["ranks"], run["groups"], run["microbatches"], run["warmup"]
    trace = read_trace(run["trace"], placement=Placement(groups, groups, "linear"))
    straggler = parse_straggler(split_spec(run["scenario"])[1])
    steps = max((len(r["step_s"]) for r in run["records"] if "step_s" in r), default=0)
    # the straggler's factor left out: it only lengthens whatever rank holds its groups
    run["any_bound_ms"] = [any_placement_bound(trace.table(warmup + i), S)
                           for i in range(steps)]
    for rec in run["records"]:
        if "error" in rec:
            continue
        shape = _shape(rec, S, groups)
        steps = len(rec["step_s"])
        tables = np.stack([stage_seconds(trace.table(warmup + i), shape, straggler) * 1e3
                           for i in range(steps)])
        rec["lower_bound_ms"] = [lower_bound_table(shape.placement, t, shape.split_backward)
                                 for t in tables]
        how = _sim_args(rec, M)
        if how is None:
            continue
        sim = simulate(stages=shape.placement.num_stages, ranks=S, microbatches=M,
                       split_backward=shape.split_backward, steps=steps,
                       trace=Trace(tables, placement=shape.placement,
                                   split_backward=shape.split_backward, source="e2e_scale"),
                       **how)
        rec["sim_ms"] = [s.step_time for s in sim.per_step]
        rec["sim_hint"] = sim.hint
    return run


def cpu_us_per_task(rec: dict[str, Any], microbatches: int, ranks: int) -> float:
    """A rank's process CPU per step / the tasks it runs in a step, mean over ranks, us."""
    tasks = microbatches * (3 if rec["split_backward"] else 2) * rec["num_stages"] / ranks
    cpu = rec.get("cpu_s_per_step") or [float("nan")]
    return float(np.mean(cpu)) / tasks * 1e6


def _row(recs: list[dict[str, Any]], M: int, S: int) -> dict[str, Any]:
    """One configuration over its seeds: errors kept, figures over every measured step."""
    ok = [r for r in recs if "error" not in r]
    row: dict[str, Any] = {"name": recs[0]["name"], "side": recs[0]["side"],
                           "errors": [r["error"] for r in recs if "error" in r],
                           "seeds_ok": len(ok)}
    if not ok:
        return row
    steps = [t * 1e3 for r in ok for t in r["step_s"]]
    q1, q3 = np.percentile(steps, [25, 75])
    row.update(placement=f"{ok[0]['style']} x{ok[0]['num_stages']}",
               split=ok[0]["split_backward"], median_ms=median(steps), min_ms=min(steps),
               max_ms=max(steps), iqr_ms=[float(q1), float(q3)], n_steps=len(steps),
               peak_act=max(max(p for p in r["peak_activations"]) for r in ok),
               cpu_us_per_task=float(np.mean([cpu_us_per_task(r, M, S) for r in ok])),
               cpu_s_all=float(np.mean([sum(r["cpu_s_per_step"]) for r in ok])),
               lower_bound_ms=median([b for r in ok for b in r["lower_bound_ms"]]),
               chosen=next((r["chosen"] for r in ok if r.get("chosen")), None),
               start=next((r["start"]["label"] for r in ok if r.get("start")), None),
               budget=next(([r["start"]["budget"], r["start"].get("budget_unit", "in flight")]
                            for r in ok if r.get("start")), None))
    if all("sim_ms" in r for r in ok):
        sims = [s for r in ok for s in r["sim_ms"]]
        shares = [(t * 1e3 - s) / (t * 1e3) for r in ok for t, s in zip(r["step_s"], r["sim_ms"])]
        row.update(sim_ms=median(sims), overhead_share=median(shares),
                   sim_hint=ok[0].get("sim_hint"))
    return row


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One block per (S, scenario): its rows, torch's best, aioready's default and best."""
    blocks = []
    keys = sorted({(r["ranks"], r["scenario"]) for r in runs}, key=lambda k: (k[0], k[1]))
    for S, spec in keys:
        mine = [r for r in runs if (r["ranks"], r["scenario"]) == (S, spec)]
        M = mine[0]["microbatches"]
        names: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for run in mine:
            for rec in run["records"]:
                names.setdefault((rec["side"], rec["name"]), []).append(rec)
        rows = [_row(recs, M, S) for recs in names.values()]
        block = _block(S, spec, M, sorted(r["seed"] for r in mine), rows)
        blocks.append(add_ceiling(block, [b for r in mine for b in r.get("any_bound_ms", [])]))
    return blocks


def add_ceiling(block: dict[str, Any], any_bounds: list[float]) -> dict[str, Any]:
    """The most any schedule could gain over torch's best: its median step over the lower
    bound (telemetry/bounds.py), the smallest over the placements measured, and the one that
    holds for any placement of the layer groups on these ranks (median over steps)."""
    measured = [r for r in block["rows"] if "lower_bound_ms" in r]
    if not measured:
        return block
    low = min(measured, key=lambda r: r["lower_bound_ms"])
    block["bound"] = {"ms": low["lower_bound_ms"],
                      "placement": f"{low['placement']}{' split' if low['split'] else ''}"}
    if any_bounds:
        block["bound"]["any_ms"] = median(any_bounds)
    t = block["torch_best"]
    if t is not None:
        block["ceiling"] = t["median_ms"] / low["lower_bound_ms"]
        if any_bounds:
            block["ceiling_any"] = t["median_ms"] / median(any_bounds)
    return block


def _best(rows: list[dict[str, Any]], side: str, peak_at_most: float | None = None
          ) -> dict[str, Any] | None:
    ok = [r for r in rows if r["side"] == side and "median_ms" in r
          and (peak_at_most is None or r["peak_act"] <= peak_at_most + 1e-9)]
    return min(ok, key=lambda r: r["median_ms"]) if ok else None


def _block(S: int, spec: str, M: int, seeds: list[int], rows: list[dict[str, Any]]
           ) -> dict[str, Any]:
    torch_best = _best(rows, "torch")
    out: dict[str, Any] = {"ranks": S, "scenario": spec, "microbatches": M, "seeds": seeds,
                           "rows": rows, "torch_best": torch_best}
    default = next((r for r in rows if r["name"] == DEFAULT and "median_ms" in r), None)
    out["default"] = default
    if torch_best is not None:
        t, peak = torch_best["median_ms"], torch_best["peak_act"]
        out["best_2x"] = _best(rows, "aioready", 2 * peak)
        out["best_same_memory"] = _best(rows, "aioready", peak)
        out["torch_best_at_default_memory"] = (
            None if default is None else _best(rows, "torch", default["peak_act"]))
        for key in ("best_2x", "best_same_memory"):
            if out[key] is not None:
                out[f"{key}_speedup"] = t / out[key]["median_ms"]
                if "sim_ms" in out[key] and "sim_ms" in torch_best:  # scheduling alone
                    out[f"{key}_sim_speedup"] = torch_best["sim_ms"] / out[key]["sim_ms"]
        other = out["torch_best_at_default_memory"]
        if default is not None and other is not None:
            out["default_speedup_same_memory"] = other["median_ms"] / default["median_ms"]
        if default is not None:
            out["default_speedup"] = t / default["median_ms"]
    return out

