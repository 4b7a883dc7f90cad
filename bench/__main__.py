"""`python -m bench all [--quick]`: run every benchmark, then regenerate bench/RESULTS.md.

`python -m bench NAME [NAME...] [--quick]` runs only those; `python -m bench report` only
regenerates RESULTS.md from bench/results/. Each benchmark also runs alone as
`python -m bench.NAME [--quick]`.

A benchmark is a runnable module of this package (it has a `__main__` block) that is not a
helper of another one (HELPERS); it writes bench/results/NAME.md, and may add PNGs and a NAME.json
there. Each runs in its own subprocess under a timeout, so a hang or a crash costs that benchmark
only and is reported. A module that sets `MPI_RANKS = N` at top level (or is listed in LAUNCH) is
launched as `mpiexec -n N python -m bench.NAME`; `TIMEOUT_S = X` sets its timeout; `NEEDS_GPU =
True` (or LAUNCH) skips it, reported as skipped, where `nvidia-smi` finds no GPU. Constants are read
from the source text, without importing the module.
`all` (not `--quick`) also runs the heavy tests (`pytest -m heavy`), whose outcome is listed.
A benchmark in NAMED_ONLY runs only when named: a repeated measure too long for `all`.
"""

from __future__ import annotations

import argparse
import ast
import datetime as dt
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .common import RESULTS, machine, other_load
from .e2e import mpiexec

__all__ = ["discover", "run_one", "write_report", "interpretation", "main"]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
REPORT = HERE / "RESULTS.md"
ORDER = ["arbiter", "hints", "sim_vs_real", "transport", "telemetry", "scaling", "policy", "tp",
         "faults", "e2e", "gpu_check", "recompute"]
HELPERS = {"common", "e2e_worker", "gpu_mpi_check"}  # launched by another benchmark
NAMED_ONLY = {"e2e_pairs"}  # launch pairs of bench.e2e, ~1 min each: `python -m bench e2e_pairs`
# what a module's own constants would say, for modules written before the convention
LAUNCH: dict[str, dict[str, Any]] = {
    "transport": {"MPI_RANKS": 2},
    "gpu_check": {"NEEDS_GPU": True, "ARGS": ["--out", "bench/results/gpu_check.json"]},
}
DEFAULT_TIMEOUT = {False: 3600.0, True: 900.0}  # by --quick
HEAVY = "tests-heavy"


def _module_constants(path: Path) -> dict[str, Any]:
    """Top-level `NAME = literal` assignments of a module, read without importing it."""
    out: dict[str, Any] = {}
    try:
        tree = ast.parse(path.read_text())
    except SyntaxError:
        return out
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(
                node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                pass
    return out


def discover() -> list[str]:
    """Benchmark modules present in this checkout, in report order."""
    found = [p.stem for p in HERE.glob("*.py")
             if not p.stem.startswith("_") and p.stem not in HELPERS
             and "__main__" in p.read_text()]
    return sorted(found, key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n))


def _constants(name: str) -> dict[str, Any]:
    return {**LAUNCH.get(name, {}), **_module_constants(HERE / f"{name}.py")}


def _has_gpu() -> bool:
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                              timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def command_for(name: str, quick: bool) -> list[str]:
    if name == HEAVY:
        return [sys.executable, "-m", "pytest", "-q", "-m", "heavy", "-p", "no:cacheprovider"]
    consts = _constants(name)
    cmd = ([sys.executable, "-m", f"bench.{name}"] + list(consts.get("ARGS", []))
           + (["--quick"] if quick else []))
    ranks = consts.get("MPI_RANKS")
    if isinstance(ranks, int) and ranks > 1:
        cmd = [mpiexec(), "-n", str(ranks)] + cmd
    return cmd


def _shown(cmd: list[str]) -> str:
    """The command as a reader would type it (python, mpiexec without their paths)."""
    words = ["python" if w == sys.executable else "mpiexec" if w == mpiexec() else w
             for w in cmd]
    return " ".join(words)


def run_one(name: str, *, quick: bool, timeout: float | None = None) -> dict[str, Any]:
    """Run one benchmark in a subprocess; return its outcome (never raises for its failure)."""
    consts = _constants(name) if name != HEAVY else {}
    if timeout is None:
        timeout = float(consts.get("TIMEOUT_S", DEFAULT_TIMEOUT[quick]))
    cmd = command_for(name, quick)
    if consts.get("NEEDS_GPU") and not _has_gpu():
        print(f"[bench] {name}: skipped, no CUDA GPU (nvidia-smi -L fails)", flush=True)
        return {"name": name, "command": _shown(cmd), "status": "skipped: no CUDA GPU on this "
                "machine", "seconds": 0.0, "summary": "", "tail": ""}
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    print(f"[bench] {_shown(cmd)} (timeout {timeout:.0f} s)", flush=True)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout, start_new_session=True)
        ok = proc.returncode == 0 or (name == HEAVY and proc.returncode == 5)  # 5: none
        status = "ok" if ok else f"failed (exit {proc.returncode})"
        tail = (proc.stdout + proc.stderr)[-2000:]
    except subprocess.TimeoutExpired as exc:
        status = f"timed out after {timeout:.0f} s"
        out = exc.stdout or b""
        tail = (out.decode() if isinstance(out, bytes) else out)[-2000:]
    seconds = time.perf_counter() - t0
    print(f"[bench] {name}: {status} in {seconds:.0f} s", flush=True)
    if status != "ok":
        print(tail, file=sys.stderr)
    summary = ""
    if name == HEAVY:
        lines = [ln for ln in tail.splitlines() if re.search(r"\d+ (passed|failed|error|"
                                                             r"deselected)", ln)]
        summary = lines[-1].strip("= ") if lines else ("no tests marked heavy" if status == "ok"
                                                        else "")
    return {"name": name, "command": _shown(cmd), "status": status, "seconds": seconds,
            "summary": summary, "tail": tail if status != "ok" else ""}


# -- RESULTS.md ----------------------------------------------------------------------------------
def _demote(text: str) -> str:
    """Inline a result file: headings one level down, image links relative to bench/."""
    text = re.sub(r"^(#{1,5}) ", lambda m: "#" + m.group(1) + " ", text, flags=re.M)
    return re.sub(r"\]\((?!results/|https?:|/)([^)\s]+\.png)\)", r"](results/\1)", text)


def _fmt_ratio(x: float) -> str:
    return f"{x:.2f}x"


def interpretation(results: Path = RESULTS) -> list[str]:
    """Where aioready wins, where not, and why: sentences filled from the measured figures."""
    path = results / "e2e.json"
    if not path.exists():
        return ["No end-to-end results yet (bench/results/e2e.json is missing): run "
                "`python -m bench e2e`."]
    data = json.loads(path.read_text())
    out: list[str] = []
    if data.get("quick"):
        out.append("*These figures come from a `--quick` run (few steps, few configs): "
                   "indicative only.*")
    wins, ties, losses = [], [], []
    for s in data["summaries"]:
        ratio = s.get("speedup_vs_torch")
        if ratio is None:
            continue
        a, t = s["best"]["aioready"], s["best"]["torch"]
        item = (f"`{s['scenario']}`: aioready {a['name']} {a['median_s'] * 1e3:.0f} ms "
                f"(efficiency {a['efficiency']:.2f}) against torch {t['name']} "
                f"{t['median_s'] * 1e3:.0f} ms (efficiency {t['efficiency']:.2f}), "
                f"{_fmt_ratio(ratio)}")
        (wins if ratio > 1.03 else losses if ratio < 0.97 else ties).append(item)
    if wins:
        out.append("**aioready is faster** (torch best / aioready best > 1.03) in: "
                   + "; ".join(wins) + ".")
    if ties:
        out.append("**Parity** (within 3 %) in: " + "; ".join(ties) + ".")
    if losses:
        out.append("**torch.distributed.pipelining is faster** (ratio < 0.97) in: "
                   + "; ".join(losses) + ".")
    out += _readiness(data) + _goals(data) + _load(data) + _scale(results)
    out.append(
        "Why: every task sleeps the same injected duration on both sides, so differences come "
        "from the order tasks run in and from runtime overhead. A fixed order (every torch "
        "schedule, aioready `strict`) makes a rank wait for the next task of its list even when "
        "another task is ready; `ready` runs whatever is ready first, within the hint's "
        "in-flight cap, so under jitter it fills waits that a fixed order leaves idle. With no "
        "jitter the orders coincide and only overhead differs (message handling and polling "
        "for aioready over MPI, blocking gloo calls for torch). A straggler rank bounds every "
        "schedule (the lower bound is its busy time), so the room for any order is small there.")
    none = next((s for s in data["summaries"] if s["scenario"] == "none"), None)
    if none and none.get("speedup_vs_torch") and none["speedup_vs_torch"] < 0.97:
        out.append(
            "With no jitter aioready is slower here, so its overhead shows: each task's compute "
            "runs on a worker thread (two thread hand-offs per task) while the loop polls MPI; "
            "when processes outnumber cores those hand-offs and the polling wait for a core, "
            "which a single-threaded torch rank blocked in gloo does not pay.")
    return out


def _scale(results: Path) -> list[str]:
    """The deep-pipeline goals (bench/e2e_scale.py), as its page states them."""
    path = results / "e2e_scale.json"
    if not path.exists():
        return []
    from .e2e_scale_page import goal_lines
    data = json.loads(path.read_text())
    lines = goal_lines(data["blocks"], data["meta"]["cores"])
    return [f"Deep pipelines (the e2e_scale section; S = 4, 8, 16). {lines[0]}",
            *[ln for ln in lines[1:] if ln]]


def _load(data: dict[str, Any]) -> list[str]:
    """Say when the machine was busier than its cores: then CPU contention, not the injected
    sleeps, sets the step times, and efficiencies are low for every runtime."""
    load, cores = data.get("load_start"), data.get("cores")
    if not load or not cores or load[0] <= cores:  # at the end it counts the run's own ranks
        return []
    return [f"Caveat: the load average was {load[0]:.1f} when the end-to-end run started, on "
            f"{cores} cores: other work competed for the CPU, so these step times measure "
            "contention as much as scheduling. Rerun on a quiet machine."]


def _readiness(data: dict[str, Any]) -> list[str]:
    """ready against strict for the same hint, per scenario."""
    parts = []
    for s in data["summaries"]:
        rows = {r["name"]: r for r in s["rows"] if r["side"] == "aioready"}
        gains = [rows[f"{h}/strict"]["median_s"] / rows[f"{h}/ready"]["median_s"]
                 for h in {n.split("/")[0] for n in rows}
                 if f"{h}/strict" in rows and f"{h}/ready" in rows]
        if gains:
            gains.sort()
            parts.append(f"`{s['scenario']}` {gains[len(gains) // 2]:.2f}x "
                         f"(range {gains[0]:.2f}-{gains[-1]:.2f}, {len(gains)} hint(s))")
    if not parts:
        return []
    return ["Readiness against the same hint in strict order (strict / ready step time, median "
            "over hints): " + "; ".join(parts) + "."]


def _goals(data: dict[str, Any]) -> list[str]:
    """The issue's goals, each with the measured figure and whether it is met."""
    by = {s["scenario"]: s for s in data["summaries"]}
    lines = []

    def best_ready(s: dict[str, Any]) -> dict[str, Any] | None:
        rows = [r for r in s["rows"] if r["side"] == "aioready"
                and r["name"].split("/")[-1].split("@")[0] == "ready"]  # hint/ready[@CAP]
        return min(rows, key=lambda r: r["median_s"]) if rows else None

    def torch_best(s: dict[str, Any]) -> dict[str, Any] | None:
        return s["best"].get("torch")

    multi = next((s for k, s in by.items() if k.startswith("multimodal")), None)
    if multi and best_ready(multi) and torch_best(multi):
        r = torch_best(multi)["median_s"] / best_ready(multi)["median_s"]
        floor = min(row["lower_bound_s"] for row in multi["rows"])
        ceiling = torch_best(multi)["median_s"] / floor
        lines.append(f"- `ready` >= 1.3x the best torch schedule under `{multi['scenario']}`: "
                     f"{_fmt_ratio(r)}, {'met' if r >= 1.3 else 'NOT met'}. Ceiling: a runtime "
                     f"that ran every task back to back with no compute and no overhead (the "
                     f"trace's lower bound, {floor * 1e3:.0f} ms, best placement) would be "
                     f"{ceiling:.2f}x torch's best here, so 1.3x needs an efficiency of "
                     f"{1.3 / ceiling:.2f} against that bound, while every task's real compute "
                     f"adds to its injected sleep (on both sides).")
    none = by.get("none")
    if none and best_ready(none) and torch_best(none):
        r = best_ready(none)["median_s"] / torch_best(none)["median_s"]
        lines.append(f"- within 3 % of the best torch schedule with no jitter: aioready `ready` "
                     f"takes {r:.3f}x torch's time, {'met' if r <= 1.03 else 'NOT met'}.")
    effs = [(s["scenario"], best_ready(s)["efficiency"]) for s in data["summaries"]
            if best_ready(s)]
    if effs:
        text = ", ".join(f"`{k}` {e:.2f}" for k, e in effs)
        ok = all(e >= 0.9 for _, e in effs)
        lines.append(f"- `ready` efficiency >= 0.9 (best ready config per scenario): {text}; "
                     f"{'met' if ok else 'NOT met'}{'' if ok else ' everywhere'}.")
    return (["Goals of the suite, as measured:"] + lines) if lines else []


def _sources(files: list[Path], ran: set[str]) -> list[str]:
    """Each section's command, date and commit, read from its page's header."""
    lines = ["| section | command | date and commit | in this invocation |", "|---|---|---|---|"]
    for p in files:
        text = p.read_text()
        cmd = re.search(r"^Command: `([^`]*)`", text, flags=re.M)
        date = re.search(r"^Date: (.*)$", text, flags=re.M)
        lines.append(f"| {p.stem} | {'`' + cmd.group(1) + '`' if cmd else 'not recorded'} | "
                     f"{date.group(1).strip() if date else 'not recorded'} | "
                     f"{'ran' if p.stem in ran else 'not regenerated'} |")
    return lines + [""]


def write_report(runs: list[dict[str, Any]] | None = None, *, quick: bool = False,
                 results: Path = RESULTS, report: Path = REPORT) -> Path:
    """Regenerate RESULTS.md from results/*.md (+ PNGs) and this invocation's run log."""
    files = sorted(results.glob("*.md"),
                   key=lambda p: (ORDER.index(p.stem) if p.stem in ORDER else len(ORDER), p.stem))
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, timeout=10,
                                capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = "?"
    now = dt.datetime.now(dt.timezone.utc)
    ran = {r["name"] for r in runs or ()}
    how = (f"after running {', '.join(sorted(ran))} (`python -m bench "
           f"{'all' if len(ran) > 1 else ' '.join(ran)}{' --quick' if quick else ''}`)"
           if ran else "by `python -m bench report`, which runs no benchmark")
    lines = ["# aioready benchmark results", "",
             f"Assembled from bench/results/*.md {how}. A section is only as new as its own "
             "run: the table below gives the command, date and commit of each, as its page "
             "says. Run one benchmark alone with `python -m bench.NAME [--quick]`; `make bench` "
             "runs them all.", "",
             f"Machine: {machine()}; {other_load()} when this report was written  ",
             f"Date: {now:%Y-%m-%d %H:%M} UTC, commit {commit}", "",
             *_sources(files, ran), "## Index", ""]
    lines += ["- [Interpretation](#interpretation)"]
    lines += [f"- [{p.stem}](#{p.stem.lower()})" for p in files]
    if runs:
        lines.append("- [Run log](#run-log)")
    lines += ["", "## Interpretation", ""]
    for paragraph in interpretation(results):
        if paragraph.startswith("- "):
            lines[-1:] = ["", paragraph, ""] if lines[-1] == "" and not lines[-2].startswith(
                "- ") else [paragraph, ""]
        else:
            lines += [paragraph, ""]
    for p in files:
        lines += [f"## {p.stem}", "", _demote(p.read_text().rstrip()), ""]
        linked = set(re.findall(r"\(results/([^)]+\.png)\)", _demote(p.read_text())))
        longer = [o.stem for o in files if o.stem != p.stem and o.stem.startswith(p.stem)]
        extra = sorted(q.name for q in results.glob(f"{p.stem}*.png") if q.name not in linked
                       and not any(q.stem.startswith(o) for o in longer))  # another page's
        lines += [f"![{name}](results/{name})" for name in extra]
        if extra:
            lines.append("")
    for q in sorted(results.glob("*.json")):
        if not (results / f"{q.stem}.md").exists():
            lines += [f"## {q.stem}", "", f"Raw output only: [results/{q.name}](results/{q.name})"
                      " (this benchmark writes no summary page).", ""]
    if runs:
        lines += ["## Run log", "", "| benchmark | command | outcome | seconds |",
                  "|---|---|---|---|"]
        for r in runs:
            outcome = r["status"] + (f": {r['summary']}" if r.get("summary") else "")
            lines.append(f"| {r['name']} | `{r['command']}` | {outcome} | {r['seconds']:.0f} |")
        lines.append("")
        failed = [r for r in runs if r["status"] != "ok" and r.get("tail")]
        for r in failed:
            lines += [f"Output of {r['name']} (last lines):", "", "```",
                      r["tail"].strip()[-1500:], "```", ""]
    report.write_text("\n".join(lines).rstrip() + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="+", help="'all', 'report', or benchmark names: "
                    + ", ".join(discover()))
    ap.add_argument("--quick", action="store_true", help="the small size of every benchmark")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per benchmark")
    ap.add_argument("--backend", choices=("mpi", "gloo"), default="mpi",
                    help="transport benchmark over MPI (default) or torch.distributed gloo")
    args = ap.parse_args(argv)
    if args.backend == "gloo":  # the torch.distributed twin of `transport`
        args.names = ["transport_torch" if n == "transport" else n for n in args.names]
    known = discover()
    if args.names == ["report"]:
        print(write_report(quick=args.quick))
        return 0
    names = ([n for n in known if n not in NAMED_ONLY] + ([] if args.quick else [HEAVY])
             if args.names == ["all"] else args.names)
    unknown = [n for n in names if n not in known and n != HEAVY]
    if unknown:
        ap.error(f"unknown benchmark(s) {unknown}; expected 'all', 'report' or some of {known}")
    runs = [run_one(n, quick=args.quick, timeout=args.timeout) for n in names]
    path = write_report(runs, quick=args.quick)
    print(f"[bench] wrote {path.relative_to(ROOT)}")
    return 0 if all(r["status"] == "ok" or r["status"].startswith("skipped") for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
