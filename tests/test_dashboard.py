"""The live dashboard: its JSON endpoint answers during a step with the numbers the spans say;
the page draws in a real headless browser (skipped when none is installed); occupancy's
interval arithmetic; `aioready train --dashboard`."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import run_mpi
from torch import nn

import aioready
from aioready.cli import main
from aioready.clock import run_virtual
from aioready.devices.sim import SimDevice
from aioready.tasks import Kind
from aioready.telemetry.metrics import step_metrics
from aioready.telemetry.occupancy import StepWindow, occupancy, subtract, union
from aioready.telemetry.spans import Span, merge_reports
from aioready.testing.helpers import mse_loss

S, M, WIDTH = 4, 4, 8


def _get(url: str) -> dict:  # type: ignore[type-arg]
    with urllib.request.urlopen(url, timeout=30) as res:
        return json.loads(res.read())  # type: ignore[no-any-return]


class _Probe(nn.Module):
    """A stage that, at one forward of one step, reads the dashboard (inline on the loop
    thread, so the step is frozen mid-way while the server thread answers)."""

    def __init__(self, when: tuple[int, int]) -> None:
        super().__init__()
        self.layer = nn.Linear(WIDTH, WIDTH, dtype=torch.float64)
        self.when = when
        self.calls = 0
        self.url = ""
        self.seen: dict | None = None  # type: ignore[type-arg]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.calls == self.when[0] * M + self.when[1]:
            self.seen = _get(self.url + "api/snapshot")
        self.calls += 1
        return self.layer(x)


def _duration(info) -> float:  # type: ignore[no-untyped-def]
    return (1.0 + info.stage) * (1.0 if info.kind is Kind.F else 2.0)


def test_snapshot_during_a_step_matches_the_spans() -> None:
    probe = _Probe((1, 2))  # stage 2, step 1, its third forward
    stages = [nn.Linear(WIDTH, WIDTH, dtype=torch.float64) for _ in range(S)]
    stages[2] = probe

    async def go():  # type: ignore[no-untyped-def]
        pipe = aioready.Pipeline(stages, mse_loss, microbatches=M, dashboard=0,
                                 device=SimDevice(_duration, run_compute=True))
        pipe.dashboard.window = 1e9  # the whole run: the shares are checkable by hand
        probe.url = pipe.dashboard.url
        try:
            for _ in range(2):
                x = torch.randn(M * 2, WIDTH, dtype=torch.float64)
                await pipe.step(x, torch.zeros_like(x))
            return (pipe.history[0], [s for rt in pipe.runtimes for s in rt.reports[1].spans],
                    [rt.cap for rt in pipe.runtimes])
        finally:
            pipe.close()

    first, second, caps = run_virtual(go())
    seen = probe.seen
    assert seen is not None and seen["running"] and seen["step"] == 1
    step0 = merge_reports(first)
    # the finished step, span for span
    got = sorted(tuple(s) for s in seen["last_step"]["spans"])
    want = sorted((s.rank, s.chunk, s.microbatch, s.kind.name, s.ready - step0.start,
                   s.start - step0.start, s.end - step0.start) for s in step0.spans)
    assert got == want
    assert seen["last_step"]["step_time"] == step0.step_time
    assert seen["history"][0]["lower_bound"] == step_metrics(step0).lower_bound
    # busy shares: each rank's span time (step 0, and step 1 up to the probe) over the window
    now = seen["now"]
    stage2_f = [s for s in second if s.stage == 2 and s.kind is Kind.F]
    done1 = [s for s in second if s.end - step0.start <= now and
             (s.stage != 2 or s.kind is not Kind.F or s.microbatch < 2)]
    assert len([s for s in done1 if s.stage == 2 and s.kind is Kind.F]) == 2 < len(stage2_f)
    for r in range(S):
        busy = sum(s.end - s.start for s in [*step0.spans, *done1] if s.rank == r)
        row = seen["ranks"][r]
        assert row["busy"] == pytest.approx(busy / now, rel=1e-9), r
        assert row["busy"] + row["waiting"] + row["gated"] + row["idle"] == pytest.approx(1.0)
        assert row["chunks"]["0"]["busy"] == row["busy"]  # one chunk per rank
        assert row["cap"] == caps[r] and 0 <= row["in_flight"] <= caps[r]
    assert seen["ranks"][2]["running_task"] == "F2"
    # messages per peer in the finished step: M activations down, M gradients up
    msgs = {(m["src"], m["dest"]): m for m in seen["messages"]}
    assert {k: m["messages"] for k, m in msgs.items()} == {
        **{(r, r + 1): M for r in range(S - 1)}, **{(r + 1, r): M for r in range(S - 1)}}
    assert msgs[(0, 1)]["bytes"] >= M * 2 * WIDTH * 8  # float64 activations of 2 rows


def test_occupancy_states_by_hand() -> None:
    assert union([(0, 1), (0.5, 2), (3, 4), (5, 5)]) == [(0, 2), (3, 4)]
    assert subtract([(0, 10)], [(2, 3), (5, 6)]) == [(0, 2), (3, 5), (6, 10)]
    # rank 0: F ready at 0 runs 0-1; B ready at 2 (its gradient came) but held until 3, runs 3-5
    # rank 1: F ready at 1.5 (waiting 0-1.5), runs 1.5-2; its B ready at 2 runs 2-4, then idle
    spans = [Span(0, 0, 0, 0, Kind.F, 0, 0, 1), Span(0, 0, 0, 0, Kind.B, 2, 3, 5),
             Span(1, 1, 0, 0, Kind.F, 1.5, 1.5, 2), Span(1, 1, 0, 0, Kind.B, 2, 2, 4)]
    occ = occupancy([StepWindow(spans, 0.0, 5.0, {0: 2, 1: 2})], [0, 1], 0.0, 5.0)
    r0, r1 = occ
    assert (r0.busy, r0.gated, r0.waiting, r0.idle) == pytest.approx((0.6, 0.2, 0.2, 0.0))
    assert (r1.busy, r1.gated, r1.waiting, r1.idle) == pytest.approx((0.5, 0.0, 0.3, 0.2))
    assert r1.chunks[0] == pytest.approx({"busy": 0.5, "other": 0.0, "waiting": 0.3,
                                          "gated": 0.0, "idle": 0.2})
    # two chunks on one rank: c0's F 0-1, c1's F ready at 1 runs 1-3, c0's B ready at 2 held
    # until 3 (the device ran c1) and runs 3-5
    two = [Span(0, 0, 0, 0, Kind.F, 0, 0, 1), Span(0, 1, 1, 0, Kind.F, 1, 1, 3),
           Span(0, 0, 0, 0, Kind.B, 2, 3, 5), Span(0, 1, 1, 0, Kind.B, 3, 5, 6)]
    (both,) = occupancy([StepWindow(two, 0.0, 6.0, {0: 4})], [0], 0.0, 6.0)
    assert both.busy == 1.0
    assert both.chunks[0] == pytest.approx({"busy": 3 / 6, "other": 3 / 6, "waiting": 0.0,
                                            "gated": 0.0, "idle": 0.0})
    assert both.chunks[1] == pytest.approx({"busy": 3 / 6, "other": 3 / 6, "waiting": 0.0,
                                            "gated": 0.0, "idle": 0.0})
    # a running step: rank 1 still owes a task, so it waits until now
    live = occupancy([StepWindow(spans[:3], 0.0, None, {0: 2, 1: 2})], [1], 0.0, 5.0)[0]
    assert live.waiting == pytest.approx(1.5 / 5 + 3 / 5)


def test_train_serves_the_dashboard(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--stages", "2", "--microbatches", "2", "--steps", "2",
                 "--sleep-only", "--task-ms", "1", "--no-progress", "--dashboard", "0"]) == 0
    assert "rank 0: dashboard on http://127.0.0.1:" in capsys.readouterr().err


BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def _browser() -> str | None:
    return next((p for p in map(shutil.which, BROWSERS) if p), None)


@pytest.mark.skipif(_browser() is None, reason="no headless browser (chromium or chrome) is "
                    "installed; make test-browser installs one")
def test_page_draws_in_a_headless_browser(tmp_path: Path) -> None:
    from PIL import Image
    browser = _browser()
    assert browser is not None

    async def go():  # type: ignore[no-untyped-def]
        pipe = aioready.Pipeline([None] * S, None, microbatches=M, dashboard=0,
                                 device=SimDevice(_duration, run_compute=False))
        for _ in range(3):
            await pipe.step()
        return pipe

    pipe = run_virtual(go())
    try:
        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--window-size=1200,900",
                 "--virtual-time-budget=4000"]
        dom = subprocess.run([browser, *flags, "--dump-dom", pipe.dashboard.url],
                             capture_output=True, text=True, timeout=90).stdout
        shot = tmp_path / "dashboard.png"
        subprocess.run([browser, *flags, f"--screenshot={shot}", pipe.dashboard.url],
                       capture_output=True, timeout=90)
    finally:
        pipe.close()
    assert "<title>aioready dashboard</title>" in dom
    drawn = dom.split('data-drawn="', 1)[1].split('"', 1)[0]
    assert int(drawn) >= S * M * 2  # at least every task of the last step's timeline
    img = Image.open(shot).convert("RGB")
    colors = img.getcolors(maxcolors=1 << 20) or []
    busy = sum(n for n, c in colors if c == (0x4C, 0x78, 0xA8))
    assert busy > 1000  # the busy bars and F boxes are on the screenshot


@pytest.mark.mpi
@pytest.mark.timeout(150)
def test_rank_0_serves_every_rank_under_mpi() -> None:
    with socket.socket() as sock:  # a free port for rank 0 (the only one that serves)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    script = Path(__file__).resolve().parent / "mpi_scripts" / "dashboard.py"
    proc = run_mpi(2, [str(script), str(port)], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    snaps = [line for line in proc.stdout.splitlines() if line.startswith("SNAP")]
    assert len(snaps) == 3, proc.stdout
    for step, line in enumerate(snaps):
        msgs = json.dumps({"0>1": M * (step + 1), "1>0": M * (step + 1)}, sort_keys=True)
        assert line == (f"SNAP step={step} last={step} ranks=[0, 1] spans={2 * M * 2} "
                        f"msgs={msgs} done={step + 1} rows=2"), proc.stdout
