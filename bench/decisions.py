"""A fingerprint of every decision the arbiter makes, to show that a hot-path change keeps them.

Speeding up the arbiter, the forecast or the notices must not change one decision: on the
simulator's virtual clock (aioready.simulate) the same inputs must give the same schedule, float
for float. This runs simulate over every library hint x policy (and strict) x cap (own, "2x",
a byte budget) x jitter (one with communication delays) x seed, and hint="auto" within "2x",
two steps each (the second with the first step's estimates), and hashes, per case: every span (rank, stage, chunk, microbatch, kind, ready, start, end as
`float.hex`), every message and notice sent (its header and tag, in send order), every backfill
test the reserving policy asked (`fits`: candidate, reserved, answer) and every estimate and
margin the forecast holds at the end, and the result's deterministic JSON.

Run: python -m bench.decisions [--baseline REV] [--quick]; with --baseline it runs the commit's
aioready too, in its own process, and lists the cases whose fingerprints differ (exit 1 if any).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from .common import step_reports
from .oversub import ROOT, baseline_tree

S = 4


def _cases(quick: bool) -> list[dict[str, Any]]:
    from aioready.schedulers import HINTS

    out = []
    seeds = (0,) if quick else (0, 1, 2)
    jitters = ("lognormal:0.5", "multimodal:0.3:3", "lognormal:0.3+comm:0.1:0.5")
    for name, spec in sorted(HINTS.items()):
        splits = (True,) if spec.needs_split else (False,) if spec.needs_split is False else (
            False, True)
        stages = S * spec.chunks
        for split in splits:
            for jitter in jitters:
                for seed in seeds:
                    base = dict(stages=stages, microbatches=2 * S, hint=name, jitter=jitter,
                                seed=seed, split_backward=split, steps=2)
                    out.append({**base, "mode": "strict"})
                    for policy in ("reserve", "greedy", "light"):
                        for gate in ({}, {"cap": "2x"}, {"memory": "2x"}):
                            out.append({**base, "policy": policy, **gate})
    for split in (False, True):  # hint="auto": the choice among every candidate's simulation
        for jitter in jitters[:2]:
            for seed in seeds:
                out.append(dict(stages=S, microbatches=2 * S, hint="auto", cap="2x",
                                jitter=jitter, seed=seed, split_backward=split, steps=2))
    return out


def fingerprints(quick: bool, cases: list[dict[str, Any]] | None = None) -> dict[str, str]:
    """case (its arguments as JSON) -> sha256 of everything it decided (`cases`: instead of
    the grid)."""
    import aioready.sim.simulator as simulator
    from aioready.ready_set import ReadySet
    from aioready.transports.inproc import InprocTransport

    log: list[str] = []
    runtimes: list[Any] = []

    send = InprocTransport.send_nowait

    def spy_send(self: Any, dest: int, msg: Any) -> None:
        log.append(f"s {self.rank}>{dest} {msg.step} {int(msg.kind)} {msg.stage} "
                   f"{msg.microbatch} {msg.tag}")
        send(self, dest, msg)

    init = ReadySet.__init__

    def spy_init(self: Any, *args: Any, fits: Any = None, **kwargs: Any) -> None:
        if fits is not None:
            def fits_logged(candidate: Any, reserved: Any, _fits: Any = fits) -> bool:
                answer = _fits(candidate, reserved)
                log.append(f"f {candidate} {reserved} {answer}")
                return bool(answer)
            fits = fits_logged
        init(self, *args, fits=fits, **kwargs)

    runtime_init = simulator.RankRuntime.__init__

    def spy_runtime(self: Any, *args: Any, **kwargs: Any) -> None:
        runtime_init(self, *args, **kwargs)
        runtimes.append(self)

    InprocTransport.send_nowait = spy_send  # type: ignore[method-assign]
    ReadySet.__init__ = spy_init  # type: ignore[method-assign]
    simulator.RankRuntime.__init__ = spy_runtime  # type: ignore[method-assign]
    try:
        with step_reports() as reports:
            return _fingerprint_each(_cases(quick) if cases is None else cases, log, reports,
                                     runtimes)
    finally:
        InprocTransport.send_nowait = send  # type: ignore[method-assign]
        ReadySet.__init__ = init  # type: ignore[method-assign]
        simulator.RankRuntime.__init__ = runtime_init  # type: ignore[method-assign]


def _fingerprint_each(cases: list[dict[str, Any]], log: list[str], reports: list[Any],
                      runtimes: list[Any]) -> dict[str, str]:
    from aioready.sim.simulator import simulate

    out = {}
    for case in cases:
        log.clear()
        reports.clear()
        runtimes.clear()
        result = simulate(**case)
        h = hashlib.sha256(result.to_json().encode())
        for line in log:
            h.update(line.encode() + b"\n")
        for report in reports:
            for span in report.spans:
                h.update(" ".join([*(str(int(x)) for x in span[:5]),
                                   *(float(x).hex() for x in span[5:])]).encode() + b"\n")
        for rt in runtimes:
            forecast = rt.forecast
            if forecast is None:
                continue
            for task in sorted(rt.hint.priority(rt.rank)):
                h.update(f"e {rt.rank} {task} {_hex(forecast.estimate(task))} "
                         f"{_hex(forecast.margin(task))}\n".encode())
        out[json.dumps(case, sort_keys=True)] = h.hexdigest()
    return out


def _hex(x: float | None) -> str:
    return "-" if x is None else float(x).hex()


def _run(tree: str, quick: bool) -> dict[str, str]:
    cmd = [sys.executable, "-m", "bench.decisions", "--worker", "--tree", tree]
    out = subprocess.run(cmd + ["--quick"] * quick, capture_output=True, text=True, check=True,
                         cwd=ROOT, timeout=1800).stdout
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--baseline", default="", help="a commit to compare against, case by case")
    ap.add_argument("--quick", action="store_true", help="one seed instead of three")
    ap.add_argument("--worker", action="store_true", help="(internal) one tree's fingerprints")
    ap.add_argument("--tree", default="")
    args = ap.parse_args(argv)
    if args.worker:
        sys.path.insert(0, args.tree)
        print(json.dumps(fingerprints(args.quick)))
        return 0
    mine = _run(str(ROOT), args.quick)
    total = hashlib.sha256("".join(mine[k] for k in sorted(mine)).encode()).hexdigest()
    print(f"this tree: {len(mine)} cases, fingerprint {total[:16]}")
    if not args.baseline:
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        theirs = _run(baseline_tree(args.baseline, Path(tmp)), args.quick)
    differ = sorted(k for k in mine if mine[k] != theirs.get(k))
    print(f"commit {args.baseline}: {len(theirs)} cases, {len(differ)} differ")
    for case in differ[:20]:
        print("  differs:", case)
    return 1 if differ or len(mine) != len(theirs) else 0


if __name__ == "__main__":
    sys.exit(main())
