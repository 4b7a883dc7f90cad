"""The page, JSON and plot of `python -m bench.e2e --scale` from the summarized blocks
(bench/e2e_scale_report.py); every sentence with a number is filled from the data.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .e2e_scale import DEFAULT

__all__ = ["write_outputs", "goal_lines"]


def _ms(r: dict[str, Any] | None) -> str:
    return "-" if r is None or "median_ms" not in r else f"{r['median_ms']:.0f}"


def _named(r: dict[str, Any] | None) -> str:
    if r is None:
        return "-"
    return (f"{r['name'].replace('Schedule', '')} {_ms(r)} ms, peak {r['peak_act']:.1f}"
            if "median_ms" in r else f"{r['name']} (no result)")


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f} %"


def _machine_share(r: dict[str, Any], cores: int) -> str:
    wall = r["median_ms"] / 1e3
    return (f"{r['name'].replace('Schedule', 'torch ')} {r['cpu_s_all']:.2f} CPU-s in "
            f"{wall:.2f} s ({_pct(r['cpu_s_all'] / (wall * cores))})")


def _what_default(row: dict[str, Any] | None) -> str:
    """What the default row ran: pages measured before `aioready train` chose its schedule
    named Pipeline's own default, 1f1b/ready."""
    if row is not None and row["name"].split("+")[0] != DEFAULT:
        return f"`{row['name']}`: Pipeline's hint, mode, policy and cap"
    chosen = "" if row is None or not row.get("start") else f"; it started from {row['start']}"
    held = row is not None and (row.get("budget") or [0, ""])[1] == "activations"
    return (f"`{DEFAULT}`: what `aioready train` runs with no schedule flags, hint auto on 2 "
            "stages per rank, its placement and split backward chosen before step 0, within "
            + ("the activations ZBV holds at its peak on its busiest rank" if held else
               "the in-flight count ZBV holds on its busiest rank") + chosen)


def _budget_note(row: dict[str, Any]) -> str:
    """The default's budget beside its measured peak, both in linear-stage microbatches."""
    budget, unit = row["budget"]
    if unit != "activations":
        return f"budget {budget} microbatches in flight"
    return f"peak {row.get('peak_act', float('nan')):g} of its budget {budget / 2:g} (activations)"


def goal_lines(blocks: list[dict[str, Any]], cores: int = 2) -> list[str]:
    """The issue's goals at the largest S under multimodal jitter, as measured."""
    multi = [dict(b, cores=cores) for b in blocks if b["scenario"].startswith("multimodal")]
    if not multi:
        return ["No multimodal run: the goals are stated at S=16 under multimodal:0.3:3."]
    b = max(multi, key=lambda b: b["ranks"])
    if "bound" not in b:  # a page summarized before the bound was: from its rows' bounds
        from .e2e_scale_report import add_ceiling
        b = add_ceiling(b, [])
    t, best, default = b["torch_best"], b.get("best_2x"), b["default"]
    lines = [f"Goals, at S={b['ranks']} under `{b['scenario']}` (seeds {b['seeds']}):", ""]
    if t is None:
        return lines + ["- no torch schedule produced a result."]
    sp = b.get("best_2x_speedup")
    lines.append(f"- aioready's best within 2x torch's best peak >= 1.5x torch's best: "
                 f"{_named(best)} against {_named(t)}: {_x(sp)}, "
                 f"{'met' if sp and sp >= 1.5 else _reach(b)}; the simulator's replay of the "
                 f"same two configurations: {_x(b.get('best_2x_sim_speedup'))}.")
    other = b.get("torch_best_at_default_memory")
    dsp = b.get("default_speedup_same_memory")
    lines.append(f"- aioready's default ({_what_default(default)}) never slower than torch's best at the same memory (the fastest torch schedule "
                 f"whose peak is at most the default's): {_named(default)} against "
                 f"{_named(other)}: {_x(dsp)}, "
                 f"{'met' if dsp and dsp >= 1.0 else 'NOT met'}; against torch's best at any "
                 f"memory: {_x(b.get('default_speedup'))}.")
    mine = [default] + ([best] if best is None or default is None  # the default may be
                        or best["name"] != default["name"] else [])  # the best
    shares = [(r["name"], r["overhead_share"]) for r in mine
              if r is not None and r.get("overhead_share") is not None]
    if shares:
        ok = all(s <= 0.05 for _, s in shares)
        lines.append("- runtime overhead (measured - simulated, share of the step) <= 5 % at "
                     f"S={b['ranks']}: " + ", ".join(f"{n} {_pct(s)}" for n, s in shares)
                     + f", {'met' if ok else 'NOT met'}; torch's best "
                     f"{_pct(t.get('overhead_share'))} against the strict form of its schedule.")
    cpu = [(r["name"], r["cpu_us_per_task"]) for r in (t, *mine) if r is not None
           and "cpu_us_per_task" in r]
    lines.append("- CPU per task (each rank's process CPU per step / its tasks): "
                 + ", ".join(f"{n.replace('Schedule', 'torch ')} {c:.0f} us" for n, c in cpu)
                 + ". All ranks together, CPU seconds per step against the step's wall time "
                 "times the machine's cores (the share of the machine the run's own processes "
                 "needed): " + ", ".join(_machine_share(r, b["cores"]) for r in (t, *mine)
                                         if r is not None and "cpu_s_all" in r) + ".")
    return lines + [""]


def _ceiling(b: dict[str, Any]) -> str:
    """The most any schedule could gain over torch's best (bench/e2e_scale_report.py)."""
    if "ceiling" not in b:
        return "-"
    bound = b["bound"]
    text = (f"{_x(b['ceiling'])} (torch best / {bound['ms']:.0f} ms, the least lower bound of "
            f"the placements measured, {bound['placement']})")
    if "ceiling_any" in b:
        text += (f"; {_x(b['ceiling_any'])} over any placement ({bound['any_ms']:.0f} ms: "
                 "max(the split chain, all work / S))")
    return text


def _reach(b: dict[str, Any]) -> str:
    """Why an unmet speedup goal is unmet: no schedule could reach it on these durations."""
    ceiling = b.get("ceiling_any", b.get("ceiling"))
    if ceiling is None or ceiling >= 1.5:
        return "NOT met"
    where = "for any schedule" if "ceiling_any" in b else "for any schedule of these placements"
    return (f"NOT met, out of reach {where}: bound {_x(ceiling)} < 1.5x (the most any schedule "
            f"could gain over torch's best: {_ceiling(b)})")


def _summary(blocks: list[dict[str, Any]]) -> list[str]:
    lines = ["Speedup = torch's best median step / aioready's; simulated = the same ratio of the "
             "simulator's replays (scheduling alone, no runtime cost; '-' when torch's best is "
             "DualPipeV, which has no twin). Most any schedule could gain = torch's best median "
             "step / the least lower bound (median over steps) of the placements measured; in "
             "brackets, over the bound that holds for any placement of the layer groups on S "
             "ranks. The lower bound (docs/architecture.md \"Lower bound\") assumes a rank runs "
             "one task at a time, each task takes its traced duration whatever the schedule, and "
             "messages cost nothing; it ignores memory, so it caps every budget.", "",
             "| S | scenario | torch best (ms, peak) | aioready default | default / torch best "
             "at its memory | aioready best <= 2x peak | speedup | simulated | aioready best <= "
             "same peak | speedup | simulated | most any schedule could gain |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for b in blocks:
        lines.append(
            f"| {b['ranks']} | `{b['scenario']}` | {_named(b['torch_best'])} | "
            f"{_named(b['default'])} | {_x(b.get('default_speedup_same_memory'))} | "
            f"{_named(b.get('best_2x'))} | {_x(b.get('best_2x_speedup'))} | "
            f"{_x(b.get('best_2x_sim_speedup'))} | {_named(b.get('best_same_memory'))} | "
            f"{_x(b.get('best_same_memory_speedup'))} | "
            f"{_x(b.get('best_same_memory_sim_speedup'))} | {_x(b.get('ceiling'))} "
            f"(any placement {_x(b.get('ceiling_any'))}) |")
    return lines + [""]


def _rows(b: dict[str, Any]) -> list[str]:
    lines = [f"### S={b['ranks']}, M={b['microbatches']}, `{b['scenario']}`, seeds {b['seeds']}",
             "", "| side | config | placement | peak act | median ms | min-max ms | IQR ms | "
             "steps | simulated ms | overhead | lower bound ms | CPU us/task | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(b["rows"], key=lambda r: (r["side"], r.get("median_ms", float("inf")))):
        note = "; ".join(r["errors"] + ([f"started from {r['start']}"] if r.get("start") else [])
                         + ([f"chose {r['chosen']}"] if r.get("chosen") else [])
                         + ([_budget_note(r)] if r.get("budget") else []))
        if "median_ms" not in r:
            lines.append(f"| {r['side']} | {r['name']} | - | - | - | - | - | 0 | - | - | - | - "
                         f"| {note} |")
            continue
        sim = f"{r['sim_ms']:.0f}" if "sim_ms" in r else "- (no twin)"
        lines.append(
            f"| {r['side']} | {r['name']} | {r['placement']}{' split' if r['split'] else ''} | "
            f"{r['peak_act']:.1f} | {r['median_ms']:.0f} | {r['min_ms']:.0f}-{r['max_ms']:.0f}"
            f" | {r['iqr_ms'][0]:.0f}-{r['iqr_ms'][1]:.0f} | {r['n_steps']} | {sim} | "
            f"{_pct(r.get('overhead_share'))} | {r['lower_bound_ms']:.0f} | "
            f"{r['cpu_us_per_task']:.0f} | {note} |")
    return lines + [""]


def _plot(blocks: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    scenarios = sorted({b["scenario"] for b in blocks})
    fig, axes = plt.subplots(1, len(scenarios), figsize=(4.2 * len(scenarios), 3.8),
                             squeeze=False, sharey=True)
    for ax, spec in zip(axes[0], scenarios):
        mine = sorted((b for b in blocks if b["scenario"] == spec), key=lambda b: b["ranks"])
        for key, label, style in (("default_speedup", "default", "o-"),
                                  ("best_2x_speedup", "best, <= 2x torch's peak", "s-")):
            pts = [(b["ranks"], b[key]) for b in mine if b.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), style, label=label)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xticks([b["ranks"] for b in mine], [str(b["ranks"]) for b in mine])
        ax.set_title(spec, fontsize=10)
        ax.set_xlabel("ranks S (M = 4S)")
    axes[0][0].set_ylabel("torch best step / aioready step")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_outputs(blocks: list[dict[str, Any]], runs: list[dict[str, Any]],
                  meta: dict[str, Any], results: Path, name: str = "e2e_scale") -> str:
    """Write NAME.json and .png; return the page's body."""
    (results / f"{name}.json").write_text(json.dumps(
        {"meta": meta, "blocks": blocks, "runs": runs}, indent=1, default=float))
    has_png = _plot(blocks, results / f"{name}.png")
    load, end = meta["load_start"], meta["load_end"]
    lines = [f"Measured by {meta['measured_by']}; this page was rebuilt from those runs by the "
             "command above (no launches).", ""] if meta.get("measured_by") else []
    lines += [
        f"S ranks, M = 4S microbatches, 2S layer groups of a thin model (one {meta['model'][2]}"
        f"-wide linear map each) with injected sleeps of F = B = W = {meta['task_ms'] / 2:g} ms "
        f"per group ({meta['task_ms']:g} ms per linear stage) times the scenario's jitter, the "
        "same durations on both sides. aioready: mpiexec, MPITransport; torch: torchrun, gloo. "
        f"{meta['warmup']} warm-up step(s) on both sides, then {meta['steps']} measured steps "
        f"per seed; seeds {meta['seeds']}. Step time = max over ranks after a barrier; medians "
        "and spreads are over every measured step of every seed. Peak act: the most "
        "microbatches' activations a rank held at once, counted by the injector on both sides, "
        "in linear-stage microbatches (max over ranks and seeds). Simulated: aioready.simulate "
        "replaying the same per-step durations for the same configuration (torch rows: the "
        "strict aioready form of the same schedule; DualPipeV has no twin). Overhead = (measured "
        "- simulated) / measured, median over steps. CPU us/task: each rank's process CPU over "
        f"the measured steps / its tasks, mean over ranks. Machine load average {load[0]:.2f} "
        f"{load[1]:.2f} {load[2]:.2f} when the run started ({meta['started_utc']} UTC), "
        f"{end[0]:.2f} {end[1]:.2f} {end[2]:.2f} at its end, on {meta['cores']} cores.", ""]
    lines += goal_lines(blocks, meta["cores"])
    lines += ["## Summary", "", *_summary(blocks)]
    if has_png:
        lines += [f"![speedup over torch's best schedule against S]({name}.png)", ""]
    lines += ["## Per configuration", ""]
    for b in blocks:
        lines += _rows(b)
    return "\n".join(lines)
