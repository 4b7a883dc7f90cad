"""A live dashboard of a pipeline: a page and a JSON endpoint on 127.0.0.1, updated as it runs.

`Dashboard(pipe, port=...)` serves, from its own thread and event loop (aiohttp), so it never
runs on (or slows) the training loop and answers even while a stage computes on the loop thread:

- `/`: a page (`dashboard_static/`, plain canvas drawing in a small script the package ships; the
  browser loads nothing from the network) that polls the endpoint twice a second;
- `/api/snapshot`: the numbers, as JSON (`snapshot()`): per rank, busy / waiting-for-input /
  gated / idle shares of a sliding window and each chunk's busy share (telemetry/occupancy.py);
  the last finished step's spans, step time and lower bound; the recent steps' times and bounds;
  ready tasks, microbatches in flight against the cap, the task on the device; messages per
  peer (counted from the spans: an F sends its activation to the next stage's rank, a B its
  gradient to the previous one's) and payload bytes per peer (seen by a send hook, local ranks).

Every number is read from the runtimes' spans and live counters by copying lists (atomic under
the GIL), so the snapshot needs no lock. Times are the loop clock's, from the first step's start
(seconds on a real loop; `clock_unit_s` converts). Under MPI the finished steps come from the
reports the trainer gathers to rank 0 every step (telemetry/gather.py: float64 rows, no pickle),
passed in through `after_step`; the running step, ready tasks and bytes are rank 0's own.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import deque
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..tasks import Kind
from ..transports.base import Message
from .instruments import Instruments, instrument_pipeline
from .metrics import StepMetrics, step_metrics
from .occupancy import StepWindow, occupancy
from .spans import StepReport, merge_reports

__all__ = ["Dashboard", "STATIC"]

STATIC = Path(__file__).with_name("dashboard_static")
HISTORY = 120  # finished steps kept for the step-time chart


class _Sends:
    """The send hook: payload bytes per (rank, peer)."""

    def __init__(self) -> None:
        self.bytes: dict[tuple[int, int], int] = {}

    def message_sent(self, rank: int, dest: int, msg: Message, nbytes: int) -> None:
        self.bytes[(rank, dest)] = self.bytes.get((rank, dest), 0) + nbytes


class Dashboard:
    """Serve `pipe`'s live numbers on http://host:port/ (port 0: any free one; `.url`)."""

    def __init__(self, pipe: Any, *, port: int = 0, host: str = "127.0.0.1",
                 window: float = 10.0, clock_unit_s: float = 1.0) -> None:
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ConfigError("dashboard port out of range", expected="0..65535 (0: any free "
                              "port)", got=port)
        try:
            from aiohttp import web
        except ImportError:
            raise ConfigError("the dashboard needs aiohttp", expected="aiohttp installed",
                              got="not importable",
                              fix="pip install 'aioready[telemetry]'") from None
        self.pipe = pipe
        self.window = window
        self.clock_unit_s = clock_unit_s
        self._gathered: deque[StepReport] = deque(maxlen=HISTORY)
        self._sends = _Sends()
        self._memo: dict[int, tuple[StepReport, StepMetrics]] = {}  # report id -> metrics
        self._merged: dict[int, StepReport] = {}  # step index -> the local ranks' report
        instrument_pipeline(pipe, Instruments([self._sends]))
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, args=(web, host, port),
                                        name="aioready-dashboard", daemon=True)
        self._thread.start()
        self._ready.wait(timeout=60)
        if self._error is not None or not self._ready.is_set():
            raise ConfigError(f"cannot serve the dashboard on {host}:{port}",
                              expected="a free port", got=repr(self._error),
                              fix="choose another port (or 0 for any free one)") from None
        self.url = f"http://{host}:{self.port}/"

    # -- data ---------------------------------------------------------------------------
    def after_step(self, report: StepReport, metrics: StepMetrics) -> None:
        """A finished step holding every rank (the trainer's gathered report, under MPI)."""
        self._gathered.append(report)

    def _finished(self) -> list[StepReport]:
        if self._gathered:
            return list(self._gathered)
        runtimes = list(self.pipe.runtimes)
        count = min(len(rt.reports) for rt in runtimes)
        keep = range(max(0, count - HISTORY), count)
        for i in keep:  # a finished step's reports never change: merge each once
            if i not in self._merged:
                self._merged[i] = merge_reports([rt.reports[i] for rt in runtimes])
        for i in [i for i in self._merged if i not in keep]:
            del self._merged[i]
        return [self._merged[i] for i in keep]

    def _tasks_per_rank(self) -> dict[int, int]:
        rt = self.pipe.runtimes[0]
        per = 3 if rt.split_backward else 2
        place = rt.placement
        return {r: len(place.stages_of(r)) * rt.num_microbatches * per
                for r in range(place.num_ranks)}

    def _messages(self, reports: list[StepReport]) -> dict[tuple[int, int], int]:
        place = self.pipe.runtimes[0].placement
        out: dict[tuple[int, int], int] = {}
        for rep in reports:
            for s in rep.spans:
                to = (s.stage + 1 if s.kind is Kind.F else s.stage - 1
                      if s.kind is Kind.B else -1)
                if 0 <= to < place.num_stages and place.rank_of(to) != s.rank:
                    key = (s.rank, place.rank_of(to))
                    out[key] = out.get(key, 0) + 1
        return out

    def snapshot(self) -> dict[str, Any]:
        """Every number the page shows; plain JSON data."""
        finished = self._finished()
        lives = [rt.live() for rt in self.pipe.runtimes]
        tasks = self._tasks_per_rank()
        steps = [StepWindow(list(r.spans), r.start, r.end, tasks) for r in finished]
        running = [lv for lv in lives if lv["active"] and lv["report"] is not None]
        if running:
            spans = [s for lv in running for s in list(lv["report"].spans)]
            steps.append(StepWindow(spans, min(lv["report"].start for lv in running), None,
                                    tasks))
        origin = steps[0].start if steps else 0.0
        now = max([origin, *(st.start for st in steps),
                   *(s.end for st in steps for s in st.spans)])
        lo = max(origin, now - self.window)
        inside = [st for st in steps if st.end is None or st.end >= lo]  # the rest adds 0
        occ = occupancy(inside, sorted(tasks), lo, now)
        live = {rt.rank: lv for rt, lv in zip(self.pipe.runtimes, lives)}
        ranks = []
        for o in occ:
            lv = live.get(o.rank, {})
            peak = finished[-1].peak_in_flight.get(o.rank) if finished else None
            ranks.append({**o.as_dict(), "ready": lv.get("ready"),
                          "in_flight": lv.get("in_flight"), "cap": lv.get("cap"),
                          "running_task": lv.get("running"), "peak_in_flight": peak})
        sends = dict(self._sends.bytes)
        messages = [{"src": a, "dest": b, "messages": n, "bytes": sends.get((a, b))}
                    for (a, b), n in sorted(self._messages(finished).items())]
        return {"title": "aioready dashboard", "clock_unit_s": self.clock_unit_s,
                "window": [lo - origin, now - origin], "now": now - origin,
                "running": bool(running), "steps_done": len(finished),
                "step": running[0]["report"].step if running else (
                    finished[-1].step if finished else None),
                "ranks": ranks, "last_step": _last(finished, self._memo), "messages": messages,
                "history": [_brief(r, self._memo) for r in finished]}

    # -- serving ------------------------------------------------------------------------
    def _serve(self, web: Any, host: str, port: int) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        for route, name in (("/", "index.html"), ("/dashboard.js", "dashboard.js")):
            app.router.add_get(route, _static(web, STATIC / name))
        app.router.add_get("/api/snapshot", self._handle_snapshot)
        self._runner = web.AppRunner(app, access_log=None)
        try:
            self._loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, host, port)
            self._loop.run_until_complete(site.start())
            self.port = int(self._runner.addresses[0][1])
        except Exception as exc:  # reported by __init__, in the caller's thread
            self._error = exc
            self._ready.set()
            self._loop.close()
            return
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    async def _handle_snapshot(self, request: Any) -> Any:
        from aiohttp import web
        body = json.dumps(self.snapshot(), allow_nan=False)
        return web.Response(text=body, content_type="application/json",
                            headers={"Cache-Control": "no-store"})

    def close(self) -> None:
        """Stop serving (idempotent)."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    def __repr__(self) -> str:
        return f"<Dashboard {getattr(self, 'url', 'not serving')}>"


def _static(web: Any, path: Path) -> Any:
    async def handle(request: Any) -> Any:
        return web.FileResponse(path)
    return handle


def _brief(report: StepReport, memo: dict[int, tuple[StepReport, StepMetrics]]
           ) -> dict[str, Any]:
    """A finished step's figures; its metrics computed once (every poll asks again)."""
    hit = memo.get(id(report))
    if hit is None or hit[0] is not report:
        if len(memo) > 4 * HISTORY:
            memo.clear()
        hit = memo[id(report)] = (report, step_metrics(report))
    m = hit[1]
    return {"step": report.step, "step_time": m.step_time, "lower_bound": m.lower_bound,
            "efficiency": m.efficiency}


def _last(finished: list[StepReport], memo: dict[int, tuple[StepReport, StepMetrics]]
          ) -> dict[str, Any] | None:
    if not finished:
        return None
    rep = finished[-1]
    return {**_brief(rep, memo), "num_ranks": rep.num_ranks,
            "spans": [[s.rank, s.chunk, s.microbatch, s.kind.name, s.ready - rep.start,
                       s.start - rep.start, s.end - rep.start] for s in rep.spans]}
