"""The CI rule of tests/conftest.py: with CI set, a skip fails unless a GPU or browser is absent.

Run on a throwaway test directory in a child pytest whose conftest loads ours under another name,
so the hooks under test are the real ones.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

CONFTEST = f"""
import importlib.util
spec = importlib.util.spec_from_file_location("ours", {str(HERE / "conftest.py")!r})
ours = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ours)
pytest_runtest_makereport = ours.pytest_runtest_makereport
pytest_make_collect_report = ours.pytest_make_collect_report
"""

TESTS = """
import pytest

def test_runs():
    assert True

@pytest.mark.skip(reason="needs a service that is not running")
def test_skips_for_a_missing_service():
    pass

@pytest.mark.skipif(True, reason="no CUDA device (GPU) visible to torch")
def test_skips_for_no_gpu():
    pass

def test_skips_at_run_time_for_no_browser():
    pytest.skip("no headless browser installed")

def test_skips_at_run_time_on_load():
    pytest.skip("machine too loaded")
"""

MODULE_SKIP = """
import pytest
pytest.skip({reason!r}, allow_module_level=True)
"""


def run_child(tmp_path: Path, child_env: dict[str, str], ci: str | None,
              source: str) -> tuple[int, dict[str, int]]:
    """(exit code, counts of the closing line) of a child pytest over one test file."""
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_cases.py").write_text(source)
    env = {k: v for k, v in child_env.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "--rootdir", str(tmp_path), "-c", "/dev/null", str(tmp_path)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    tail = out.stdout.strip().splitlines()[-1]
    counts = {w: int(n) for n, w in re.findall(r"(\d+) (passed|failed|skipped|error)", tail)}
    return out.returncode, counts


@pytest.mark.parametrize("ci", ["true", "1"])
def test_in_ci_only_a_missing_gpu_or_browser_may_skip(tmp_path: Path, child_env: dict[str, str],
                                                      ci: str) -> None:
    code, counts = run_child(tmp_path, child_env, ci, TESTS)
    # the skip marker for the missing service fails in setup (an error), the run-time skip on
    # load in the call (a failure); no GPU and no browser stay skips
    assert (code, counts) == (1, {"passed": 1, "failed": 1, "error": 1, "skipped": 2}), counts


def test_outside_ci_every_skip_stays_a_skip(tmp_path: Path, child_env: dict[str, str]) -> None:
    code, counts = run_child(tmp_path, child_env, None, TESTS)
    assert (code, counts) == (0, {"passed": 1, "skipped": 4}), counts


@pytest.mark.parametrize("reason, ci, code, counts", [
    ("needs mpi4py", "true", 2, {"error": 1}),  # collection error: the run stops, CI fails
    ("no CUDA device", "true", 5, {"skipped": 1}),  # 5: pytest ran no test, as without CI
    ("needs mpi4py", None, 5, {"skipped": 1}),
])
def test_a_module_level_skip_follows_the_same_rule(tmp_path: Path, child_env: dict[str, str],
                                                   reason: str, ci: str | None, code: int,
                                                   counts: dict[str, int]) -> None:
    got = run_child(tmp_path, child_env, ci, MODULE_SKIP.format(reason=reason))
    assert got == (code, counts), got
