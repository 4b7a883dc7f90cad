"""bench/e2e_pairs.py: CPU per task, aioready against torch, in launch pairs of alternating order.

The arithmetic and the page are checked exactly on made-up records (the launches stubbed, the
trace and bench.e2e's summarize real); the real launches (mpiexec and torchrun) run at the
smallest size, and the page is checked against its own JSON. No timing asserted.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Any

import pytest
from conftest import requires_mpi

import bench.common as common
import bench.e2e_pairs as pairs
from bench.e2e import cpu_us_per_task, generate_trace

M, STEPS, WARMUP, RANKS = 8, 2, 1, 4
TASKS = M * 2 * 4 // RANKS  # 1F1B unsplit, 4 stages on 4 ranks: F and B of each microbatch


def _record(side: str, name: str, cpu_ms: float, compute_ms: float) -> dict[str, Any]:
    return {"side": side, "name": name, "style": "linear", "num_stages": 4,
            "split_backward": False, "step_s": [0.5] * STEPS, "loss": 1.0,
            "cpu_s_per_step": [cpu_ms / 1e3] * RANKS,
            "compute_s_per_step": [compute_ms / 1e3] * RANKS,
            "peak_activations": [4, 3, 2, 1],
            **({"caps": [4, 3, 2, 1]} if side == "aioready" else {})}


def test_runs_when_named_not_in_all() -> None:
    import bench.__main__ as runner
    assert "e2e_pairs" in runner.discover() and "e2e_pairs" in runner.NAMED_ONLY
    assert runner.command_for("e2e_pairs", quick=True)[-3:] == ["-m", "bench.e2e_pairs",
                                                                  "--quick"]
    assert runner._constants("e2e_pairs")["TIMEOUT_S"] == pairs.TIMEOUT_S


def test_order_alternates() -> None:
    assert [pairs.order_of(i) for i in range(4)] == [
        ("aioready", "torch"), ("torch", "aioready"), ("aioready", "torch"), ("torch", "aioready")]


def test_pair_ratios_are_the_pairs_own_figures() -> None:
    rows = [_record("aioready", "1f1b/strict", 16.0, 8.0),
            _record("aioready", "1f1b/ready@2x", 1.0, 0.5),  # other caps than torch's: no twin
            _record("aioready", "bfw/ready", 1.0, 0.5),  # no same-schedule torch row
            _record("torch", "Schedule1F1B", 32.0, 8.0)]
    (fig,) = pairs.pair_ratios(rows, M, RANKS)
    assert fig["config"] == "1f1b/strict" and fig["torch"] == "Schedule1F1B"
    assert fig["aioready_us"] == pytest.approx(16e3 / TASKS) == cpu_us_per_task(rows[0], M)
    assert fig["torch_us"] == pytest.approx(32e3 / TASKS)
    assert fig["ratio"] == pytest.approx(0.5)
    assert fig["aioready_beyond_us"] == pytest.approx(8e3 / TASKS)
    assert fig["torch_beyond_us"] == pytest.approx(24e3 / TASKS)
    assert fig["ratio_beyond"] == pytest.approx(1 / 3)
    assert fig["caps"] == [4, 3, 2, 1]


def test_e2e_page_pairs_the_same_rows() -> None:
    """bench.e2e's one-run table and this module pick the same twins (bench.e2e.same_schedule)."""
    from bench.e2e import _per_task
    rows = [_record("aioready", "1f1b/strict", 16.0, 8.0),
            _record("aioready", "1f1b/ready@2x", 1.0, 0.5),
            _record("torch", "Schedule1F1B", 32.0, 8.0)]
    table = [ln for ln in _per_task([{"scenario": "none", "rows": rows}], M) if ln.startswith(
        "| `none`")]
    assert table == ["| `none` | 1f1b | 1f1b/strict | 1000 | 2000 | 0.50 | 500 | 1500 | 0.33 |"]


def test_config_stats_are_medians_and_counts() -> None:
    ratios = [0.8, 1.0, 1.3, 0.9, 1.1]
    made = [{"scenario": "none", "order": list(pairs.order_of(i)), "figures": [
        {"config": "1f1b/strict", "torch": "Schedule1F1B", "aioready_us": 100 * r,
         "torch_us": 100.0, "ratio": r, "aioready_beyond_us": 50 * r * r,
         "torch_beyond_us": 50.0, "ratio_beyond": r * r}]} for i, r in enumerate(ratios)]
    (st,) = pairs.config_stats(made)
    assert st["pairs"] == 5 and st["torch"] == "Schedule1F1B"
    assert st["ratio"] == {"median": 1.0, "min": 0.8, "max": 1.3}
    assert st["aioready_us"]["median"] == pytest.approx(100.0)
    assert st["ratio_beyond"]["median"] == pytest.approx(1.0)
    assert st["torch_us"] == {"median": 100.0, "min": 100.0, "max": 100.0}
    assert st["at_or_below"] == 3 and st["at_or_below_beyond"] == 3  # 0.8, 1.0, 0.9
    # beyond compute by the side that went first: pairs 0, 2, 4 (0.64, 1.69, 1.21) and 1, 3
    assert st["beyond_by_first"]["aioready"] == pytest.approx(1.21)
    assert st["beyond_by_first"]["torch"] == pytest.approx((1.0 + 0.81) / 2)


def _stub_launches(calls: list[str], fail_at: int = 0) -> Any:
    """A run_scenario that launches nothing: made-up records whose CPU changes with every
    launch (the n-th launch reads 10 + n ms a step for aioready, twice that for torch), over a
    real trace; the `fail_at`-th launch fails as a launch does."""
    def fake_run(spec: str, *, workdir: Path, aioready_configs: list[str],
                 torch_configs: list[str], **kw: Any) -> dict[str, Any]:
        side = "aioready" if aioready_configs else "torch"
        assert not (aioready_configs and torch_configs)
        calls.append(side)
        if len(calls) == fail_at:
            raise RuntimeError("exit 1: a launch failed")
        workdir.mkdir(parents=True, exist_ok=True)
        trace = workdir / "trace.csv"
        generate_trace(spec, seed=0, groups=8, microbatches=M, steps=WARMUP + STEPS,
                       task_ms=2.0, path=trace)
        cpu = 10.0 + len(calls)
        recs = ([_record("aioready", c, cpu, 4.0) for c in aioready_configs]
                + [_record("torch", c, 2 * cpu, 16.5) for c in torch_configs])
        return {"scenario": spec, "trace": str(trace), "records": recs}
    return fake_run


def test_main_pairs_launches_and_writes_page(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The launches stubbed: the page and the JSON give each pair's own ratio, in the
    alternating order, and their medians."""
    calls: list[str] = []
    fake_run = _stub_launches(calls)
    monkeypatch.setattr(pairs, "run_scenario", fake_run)
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    data = pairs.main(["--pairs", "3", "--steps", str(STEPS), "--aioready", "1f1b/strict",
                       "--torch", "Schedule1F1B", "--out", "p"])
    assert calls == ["aioready", "torch", "torch", "aioready", "aioready", "torch"]
    assert [p["order"] for p in data["pairs"]] == [list(pairs.order_of(i)) for i in range(3)]
    cpu = {"aioready": [11, 14, 15], "torch": [2 * 12, 2 * 13, 2 * 16]}  # by launch number
    want = [a / t for a, t in zip(cpu["aioready"], cpu["torch"])]
    want_beyond = [(a - 4) / (t - 16.5) for a, t in zip(cpu["aioready"], cpu["torch"])]
    got = [p["figures"][0] for p in data["pairs"]]
    assert [f["ratio"] for f in got] == pytest.approx(want)
    assert [f["ratio_beyond"] for f in got] == pytest.approx(want_beyond)
    (st,) = data["configs"]
    assert st["ratio"]["median"] == pytest.approx(statistics.median(want))
    assert st["ratio_beyond"]["median"] == pytest.approx(statistics.median(want_beyond))
    assert st["at_or_below"] == 3 and st["at_or_below_beyond"] == 2  # pair 1: 10 / 9.5 beyond
    assert st["beyond_by_first"] == {"aioready": pytest.approx(statistics.median(
        [want_beyond[0], want_beyond[2]])), "torch": pytest.approx(want_beyond[1])}
    saved = json.loads((tmp_path / "p.json").read_text())
    assert saved["configs"] == data["configs"]
    _check_page((tmp_path / "p.md").read_text(), saved)


def test_a_late_failure_keeps_the_pairs_done(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(pairs, "run_scenario", _stub_launches(calls, fail_at=4))
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    with pytest.raises(RuntimeError, match="a launch failed"):
        pairs.main(["--pairs", "3", "--steps", str(STEPS), "--aioready", "1f1b/strict",
                    "--torch", "Schedule1F1B", "--out", "p"])
    saved = json.loads((tmp_path / "p.json").read_text())
    assert [p["pair"] for p in saved["pairs"]] == [0] and saved["pairs_asked"] == 3
    assert saved["pairs"][0]["figures"][0]["ratio"] == pytest.approx(11 / 24)
    text = (tmp_path / "p.md").read_text()
    assert "1 of the 3 asked" in text
    _check_page(text, saved)


def _check_page(text: str, data: dict[str, Any]) -> None:
    """Every pair's row on the page shows its own figures, first side and ratio; the median
    row and the summary show the medians of the JSON."""
    assert text.startswith("Command: `python -m bench.e2e_pairs ")
    for st in data["configs"]:
        head = f"### `{st['scenario']}`: {st['config']} against {st['torch']}"
        table = text.split(head, 1)[1].split("\n\n", 2)[1].splitlines()[2:]
        figs = [(p, f) for p in data["pairs"] for f in p["figures"]
                if f["config"] == st["config"] and p["scenario"] == st["scenario"]]
        assert len(table) == len(figs) + 1
        for line, (p, f) in zip(table, figs):
            cells = [c.strip() for c in line.strip("|").split("|")]
            assert cells[:2] == [str(p["pair"]), p["order"][0]]
            a, t, r = float(cells[2]), float(cells[3]), float(cells[4])
            assert a == round(f["aioready_us"]) and t == round(f["torch_us"])
            assert r == round(f["ratio"], 2)
            assert float(cells[7]) == round(f["ratio_beyond"], 2)
        med = table[-1]
        assert med.startswith("| median [min-max] |")
        assert (f"{st['ratio']['median']:.2f} [{st['ratio']['min']:.2f}-"
                f"{st['ratio']['max']:.2f}]") in med
        assert f"{st['ratio_beyond']['median']:.2f} [" in med
        first = "; ".join("-" if x is None else f"{x:.2f}"
                          for x in (st["beyond_by_first"][s] for s in pairs.SIDES))
        assert (f"| `{st['scenario']}` | {st['config']} | {st['torch']} | {st['pairs']} | "
                f"{st['ratio']['median']:.2f} [") in text
        assert f"| {st['at_or_below_beyond']} | {first} |" in text
        assert (f"Pairs at or below 1.00: {st['at_or_below']} of {st['pairs']} (plain), "
                f"{st['at_or_below_beyond']} of {st['pairs']} (beyond compute).") in text
    for p in data["pairs"]:  # the launches table: each pair's order and its load readings
        assert re.search(rf"\| {p['pair']} \| `{p['scenario']}` \| "
                         rf"{' then '.join(p['order'])} \| \d+\.\d\d, \d+\.\d\d \|", text)
    assert "## Not measured here" in text and "CUDA" in text


@pytest.mark.mpi
@requires_mpi
@pytest.mark.timeout(600)
@pytest.mark.parametrize("n", [1, pytest.param(2, marks=pytest.mark.heavy)])
def test_e2e_pairs_real_launches(n: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Real pairs (mpiexec, then torchrun, then the other way round), 1F1B strict against
    Schedule1F1B: each pair's ratio is that pair's own figures, and the page says so. One pair
    on 2 ranks a side in `make test`, so the harness cannot rot; two, the swapped order too,
    heavy."""
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    data = pairs.main(["--pairs", str(n), "--steps", "1", "--warmup", "1", "--task-ms", "1",
                       "--ranks", "2",
                       "--aioready", "1f1b/strict", "--torch", "Schedule1F1B", "--out", "p",
                       "--timeout", "250"])
    want = [["aioready", "torch"], ["torch", "aioready"]][:n]
    assert [p["order"] for p in data["pairs"]] == want
    for p in data["pairs"]:
        rows = {r["name"]: r for r in p["rows"]}
        (f,) = p["figures"]
        a, t = rows["1f1b/strict"], rows["Schedule1F1B"]
        assert f["aioready_us"] == cpu_us_per_task(a, 8, 2) > 0
        assert f["torch_us"] == cpu_us_per_task(t, 8, 2) > 0
        assert f["ratio"] == f["aioready_us"] / f["torch_us"]
        assert f["ratio_beyond"] == (cpu_us_per_task(a, 8, 2, beyond_compute=True)
                                     / cpu_us_per_task(t, 8, 2, beyond_compute=True))
        assert set(p["load"]) == {"aioready", "torch"}
    (st,) = data["configs"]
    assert st["ratio"]["median"] == pytest.approx(
        statistics.median(p["figures"][0]["ratio"] for p in data["pairs"]))
    _check_page((tmp_path / "p.md").read_text(), json.loads((tmp_path / "p.json").read_text()))
