"""bench/__main__.py: discovery, launch commands and RESULTS.md regeneration (no benchmark runs)."""

from __future__ import annotations

import json
from pathlib import Path

import bench.__main__ as runner


def _row(side: str, name: str, ms: float, eff: float) -> dict:
    return {"side": side, "name": name, "median_s": ms / 1e3, "efficiency": eff,
            "lower_bound_s": 0.5, "style": "linear", "num_stages": 4, "split_backward": False}


def _summary(scenario: str, a_ms: float, t_ms: float) -> dict:
    rows = [_row("aioready", "1f1b/ready", a_ms, 0.93), _row("aioready", "1f1b/strict",
                                                              a_ms * 1.2, 0.8),
            _row("torch", "Schedule1F1B", t_ms, 0.7)]
    return {"scenario": scenario, "rows": rows,
            "best": {"aioready": rows[0], "torch": rows[2]}, "speedup_vs_torch": t_ms / a_ms}


def test_discovery_and_commands() -> None:
    names = runner.discover()
    assert "e2e" in names and "arbiter" in names
    assert not {"common", "e2e_worker", "__main__"} & set(names)
    cmd = runner.command_for("e2e", quick=True)
    assert cmd[-3:] == ["-m", "bench.e2e", "--quick"]
    if (runner.HERE / "transport.py").exists():
        assert "-n" in runner.command_for("transport", quick=False)


def test_module_constants_are_read_without_import(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("import does_not_exist\nMPI_RANKS = 2\nTIMEOUT_S = 60.0\nX = f()\n")
    assert runner._module_constants(src) == {"MPI_RANKS": 2, "TIMEOUT_S": 60.0}


def test_report_fills_interpretation_from_figures(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    (results / "e2e.md").write_text("## Summary\n\n![chart](e2e.png)\n")
    (results / "e2e.png").write_bytes(b"")
    data = {"summaries": [_summary("none", 1000.0, 990.0),
                          _summary("multimodal:0.3:3", 1000.0, 1450.0)],
            "quick": False, "load_start": [0.5], "load_end": [0.7], "cores": 2}
    (results / "e2e.json").write_text(json.dumps(data))
    report = runner.write_report(
        [{"name": "e2e", "command": "python -m bench.e2e", "status": "ok", "seconds": 9.0,
          "summary": "", "tail": ""}], results=results, report=tmp_path / "RESULTS.md")
    text = report.read_text()
    assert "### Summary" in text and "](results/e2e.png)" in text  # demoted, relinked
    assert "**aioready is faster**" in text and "1.45x" in text  # multimodal: 1450 / 1000
    assert "**Parity**" in text and "0.99x" in text  # none: 990 / 1000
    assert "under `multimodal:0.3:3`: 1.45x, met" in text
    assert "no jitter: aioready `ready` takes 1.010x torch's time, met" in text
    assert "strict / ready" in text and "1.20x" in text
    assert "Caveat" not in text  # a quiet machine
    assert "| e2e | `python -m bench.e2e` | ok | 9 |" in text


def test_report_without_e2e_says_so(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    text = runner.write_report(results=results, report=tmp_path / "R.md").read_text()
    assert "e2e.json is missing" in text
