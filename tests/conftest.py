"""Shared test helpers: the one mpiexec launcher, child environments, async tests on the virtual
clock, and the CI rule that a skip fails unless the machine lacks a GPU or a browser."""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Coroutine, Generator, Mapping, Sequence

import pytest

from aioready.clock import run_virtual

ROOT = Path(__file__).resolve().parent.parent


def mpiexec() -> str | None:
    """The mpiexec next to this Python (the MPICH wheel), else one on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    if here.exists():
        return str(here)
    return shutil.which("mpiexec")


def _mpi_missing() -> str | None:
    if importlib.util.find_spec("mpi4py") is None or mpiexec() is None:
        return "needs mpi4py and mpiexec (pip install 'aioready[mpi]')"
    return None


MPI_MISSING = _mpi_missing()
requires_mpi = pytest.mark.skipif(MPI_MISSING is not None, reason=MPI_MISSING or "")


def run_mpi(n: int, args: Sequence[str], *, timeout: float,
            env: Mapping[str, str] | None = None,
            bind: str | None = None) -> subprocess.CompletedProcess[str]:
    """`mpiexec [-bind-to BIND] -n N python ARGS` from the repository root, this checkout first
    on the path, unbuffered output, `env` on top of the current environment; output captured.

    The only place tests build an mpiexec command line. A run past `timeout` raises
    subprocess.TimeoutExpired (the test fails). Without MPI the test skips, which CI turns into
    a failure (see pytest_runtest_makereport below).
    """
    if MPI_MISSING is not None:
        pytest.skip(MPI_MISSING)
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env["PYTHONUNBUFFERED"] = "1"
    full_env.update(env or {})
    cmd = [str(mpiexec())]
    if bind is not None:
        cmd += ["-bind-to", bind]
    cmd += ["-n", str(n), sys.executable, *args]
    return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


class SharedLaunch:
    """One launch of tests/mpi_scripts/exact.py on `n` ranks that runs the tokens every test
    module asked for, each token in its own event loop with its switches set (`K=V,K=V@CASE`).

    A launch costs each rank an import of torch (about 2.5 s of CPU here) and a case well under
    one, so the modules that check a case with a switch on and off share one launch instead of
    paying one each. Modules call `need` at import (pytest imports them all before any test runs);
    the first `results` runs the launch, and each test asserts on its own tokens' RESULT lines.
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.tokens: list[str] = []
        self._done: tuple[subprocess.CompletedProcess[str], dict[str, str]] | None = None

    def need(self, *tokens: str) -> list[str]:
        if self._done is not None:
            raise RuntimeError("SharedLaunch.need after the launch ran: call it at import")
        self.tokens += [t for t in tokens if t not in self.tokens]
        return list(tokens)

    def results(self, tokens: Sequence[str], *, timeout: float = 240) -> dict[str, str]:
        """{token: the rest of its RESULT line} for `tokens`; the launch must have exited 0."""
        if self._done is None:
            proc = run_mpi(self.n, [str(ROOT / "tests" / "mpi_scripts" / "exact.py"),
                                    *self.tokens], timeout=timeout)
            lines = dict(line.split(" ", 2)[1:] for line in proc.stdout.splitlines()
                         if line.startswith("RESULT "))
            self._done = (proc, lines)
        proc, lines = self._done
        assert proc.returncode == 0, proc.stderr[-3000:]
        missing = [t for t in tokens if t not in lines]
        assert not missing, (missing, proc.stdout[-3000:])
        return {t: lines[t] for t in tokens}


def switched(switches: Mapping[str, str], *cases: str) -> list[str]:
    """exact.py tokens: each case with `switches` set in its ranks' environment."""
    prefix = ",".join(f"{k}={v}" for k, v in switches.items())
    return [f"{prefix}@{case}" if prefix else case for case in cases]


EXACT_2 = SharedLaunch(2)  # the 2-rank exact.py launch the MPI switch tests share


def run_torchrun(n: int, args: Sequence[str], *, timeout: float,
                 env: Mapping[str, str] | None = None,
                 monitor_interval: float = 0.2) -> subprocess.CompletedProcess[str]:
    """`python -m torch.distributed.run --standalone --nproc-per-node N ARGS` from the repository
    root, like `run_mpi`: this checkout first on the path, unbuffered output, `env` on top, no MPI
    launcher variables (so the launch is torchrun's alone); output captured. The only place tests
    build a torchrun command line; a run past `timeout` raises subprocess.TimeoutExpired.
    `monitor_interval`: how often torchrun's agent looks for a failed worker; once it sees one
    it terminates the others."""
    full_env = {k: v for k, v in os.environ.items()
                if not k.startswith(("PMI_", "OMPI_", "PMIX_"))}
    full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env["PYTHONUNBUFFERED"] = "1"
    full_env["OMP_NUM_THREADS"] = "1"
    full_env.update(env or {})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={n}", f"--monitor-interval={monitor_interval}", *args]
    return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def child_env() -> dict[str, str]:
    """Environment for child processes: this checkout first on the path, no warnings as errors."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


# -- in CI, a skip is a failure unless the machine lacks a GPU or a browser ------------------

_ALLOWED_SKIP = re.compile(r"GPU|CUDA|browser", re.IGNORECASE)


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def _skip_reason(report: Any) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _fail_forbidden_skip(report: Any, where: str) -> None:
    """A skip that hides a broken or missing path becomes a failure that names it."""
    if not (_in_ci() and report.skipped and not hasattr(report, "wasxfail")):
        return
    reason = _skip_reason(report)
    if _ALLOWED_SKIP.search(reason):
        return
    report.outcome = "failed"
    report.longrepr = (f"{where} skipped in CI: {reason!r}. In CI only an absent GPU/CUDA "
                       "device or browser may skip a test; install what it needs or fix it.")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item,
                              call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    report = yield
    _fail_forbidden_skip(report, item.nodeid)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, Any]:
    report = yield
    _fail_forbidden_skip(report, collector.nodeid)
    return report


def on_virtual_clock(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run an async test on a fresh VirtualClockLoop instead of pytest-asyncio's real loop:
    timers and timeouts then fire at exact virtual times that no machine load can stretch."""
    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        run_virtual(test(*args, **kwargs))
    return run
