"""`aioready --help`, every subcommand's --help, and `aioready train` writing its outputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from aioready.cli import COMMANDS, build_parser, main
from aioready.errors import InternalError

ROOT = Path(__file__).resolve().parents[1]


def test_top_level_help_runs_as_a_module() -> None:
    out = subprocess.run([sys.executable, "-m", "aioready", "--help"], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "usage: aioready" in out.stdout
    for name in ("train", "plot", "hints"):
        assert name in out.stdout


@pytest.mark.parametrize("name", COMMANDS)
def test_each_subcommand_has_help_with_examples(name: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert name in sub, f"command {name!r} is in COMMANDS but has no subparser"
    with pytest.raises(SystemExit) as exit_info:
        main([name, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert f"usage: aioready {name}" in text
    assert "example" in text.lower()


def test_a_missing_command_module_is_an_error_not_a_missing_command(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import aioready.cli as cli
    monkeypatch.setattr(cli, "COMMANDS", (*COMMANDS, "nope"))
    with pytest.raises(InternalError, match=r"the module of command 'nope' is missing "
                                            r"\(expected aioready/cli/nope.py"):
        cli.build_parser()


@pytest.mark.timeout(120)
def test_train_writes_json_trace_and_csv(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--stages", "2", "--microbatches", "3", "--steps", "2",
                 "--task-ms", "5", "--dim", "16", "--seq", "8", "--jitter", "multimodal:0.5:2",
                 "--no-split-backward",  # the counts below are of F and B tasks
                 "--json", str(tmp_path / "s.json"), "--chrome-trace", str(tmp_path / "t.json"),
                 "--csv", str(tmp_path / "s.csv")]) == 0
    summary = json.loads((tmp_path / "s.json").read_text())
    for key in ("step_time", "lower_bound", "efficiency", "loss"):
        assert len(summary[key]) == 2, key
    assert all(0 < lb <= t + 1e-6 for lb, t in zip(summary["lower_bound"],
                                                   summary["step_time"]))
    assert summary["transport"] == "inproc" and summary["unit"] == "ms"
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert len([e for e in events if e["ph"] == "X"]) == 2 * 2 * 3 * 2  # steps, ranks, M, F/B
    assert len((tmp_path / "s.csv").read_text().splitlines()) == 1 + 24
    assert "efficiency" in capsys.readouterr().out


def test_train_reports_bad_input_clearly(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--jitter", "bogus:1", "--steps", "1", "--stages", "2",
                 "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "aioready train: error" in err and "bogus" in err


@pytest.mark.timeout(120)
def test_train_replays_a_trace_each_task_taking_at_least_its_duration(tmp_path: Path) -> None:
    from aioready.placement import Placement
    from aioready.sim.durations import base_durations
    from aioready.sim.traces import write_trace
    from aioready.sim.variability import JitterModel
    from aioready.telemetry.export import read_csv
    model = JitterModel("lognormal:0.5", seed=3, placement=Placement.linear(2),
                        num_microbatches=3, base=base_durations(4.0))
    write_trace(tmp_path / "d.csv", model, steps=2)
    assert main(["train", "--stages", "2", "--microbatches", "3", "--steps", "2", "--trace",
                 str(tmp_path / "d.csv"), "--csv", str(tmp_path / "spans.csv"), "--dim", "16",
                 "--seq", "8", "--no-progress"]) == 0
    reports = read_csv(tmp_path / "spans.csv")
    assert [r.step for r in reports] == [0, 1]
    for rep in reports:
        assert len(rep.spans) == 2 * 3 * 2
        for s in rep.spans:
            # uvloop's loop clock counts whole milliseconds: allow one tick
            assert s.end - s.start >= model.ms(rep.step, s.stage, s.microbatch, s.kind) * 1e-3 \
                - 1.001e-3


@pytest.mark.timeout(120)
def test_train_takes_a_cap_factor_like_simulate(tmp_path: Path) -> None:
    assert main(["train", "--stages", "2", "--microbatches", "4", "--steps", "1", "--task-ms",
                 "0", "--dim", "8", "--seq", "4", "--mode", "strict", "--cap", "2x",
                 "--no-progress", "--json", str(tmp_path / "s.json")]) == 0
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["cap"] == "2x" and summary["peak_in_flight"] == [[2, 1]]
    assert main(["train", "--stages", "2", "--microbatches", "4", "--steps", "1", "--task-ms",
                 "0", "--dim", "8", "--seq", "4", "--cap", "3", "--no-progress", "--json",
                 str(tmp_path / "n.json")]) == 0
    assert json.loads((tmp_path / "n.json").read_text())["cap"] == 3


@pytest.mark.parametrize("command", ["train", "simulate"])
@pytest.mark.parametrize("bad", ["2y", "four", "0"])
def test_both_commands_refuse_a_bad_cap_naming_it(command: str, bad: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    shape = ["--stages", "2", "--microbatches", "2"]
    rest = ["--steps", "1", "--no-progress"] if command == "train" else []
    assert main([command, *shape, "--cap", bad, *rest]) == 1
    err = capsys.readouterr().err
    assert f"aioready {command}: error" in err and f"'{bad}'" in err and "cap" in err
