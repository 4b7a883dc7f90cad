"""The run record of `aioready train --run-record FILE`: what ran, where, and how it ended.

JSON lines, one object per event, appended, so a person can read it with `cat` and a BI tool can
load it as a table: `{"event": "start", ...}` with the configuration, package versions, the git
revision if the working directory is in a repository, the host, the world layout (ranks and
their stages) and the sealing key's fingerprint; then `{"event": "end", ...}` with the steps
run, the losses and the first diverged step, or `{"event": "error", ...}` with the error's type
and message. Under mpirun every rank appends its own lines (`rank` says whose), each line in one
`write` on a file opened for appending, so lines of different ranks never interleave; a rank
ended by another's MPI_Abort writes no end line, the rank that failed writes its error first.
Nothing secret is written: the key appears only as its fingerprint.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math
import os
import platform
import socket
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["RunRecord", "PACKAGES", "finite"]

PACKAGES = ("aioready", "torch", "numpy", "mpi4py", "cryptography", "uvloop")


class RunRecord:
    """Appends this rank's events of one run to a JSON-lines file."""

    def __init__(self, path: str | os.PathLike[str], *, rank: int, world_size: int) -> None:
        self.path = Path(path)
        self.rank = rank
        self.world_size = world_size
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a"):
                pass
        except OSError as exc:
            from ..errors import ConfigError
            raise ConfigError(f"cannot write the run record {self.path}", expected="a "
                              "writable file", got=f"{type(exc).__name__}: {exc.strerror}"
                              ) from None

    def start(self, cfg: Any, *, layout: dict[int, list[int]] | None = None,
              key_fingerprint: str | None = None) -> None:
        self._write("start", config=dataclasses.asdict(cfg), packages=_versions(),
                    python=platform.python_version(), platform=platform.platform(),
                    host=socket.gethostname(), pid=os.getpid(), git=_git_revision(),
                    layout=layout, sealed=key_fingerprint)

    def end(self, result: Any) -> None:
        self._write("end", steps=len(result.losses), losses=result.losses,
                    diverged_at=result.diverged_at, overruns=result.overruns,
                    sealed=result.key_fingerprint)

    def error(self, exc: BaseException) -> None:
        self._write("error", error=type(exc).__name__, message=str(exc)[:4000])

    def _write(self, event: str, **fields: Any) -> None:
        line = {"event": event, "time": dt.datetime.now(dt.timezone.utc).isoformat(),
                "rank": self.rank, "world_size": self.world_size, **fields}
        data = (json.dumps(finite(line), allow_nan=False, default=str) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _git_revision() -> str | None:
    """HEAD of the repository around the working directory (with "+dirty"), or None."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=5)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty else "")


def finite(value: Any) -> Any:
    """`value` with every float that is not finite replaced by None: JSON has no NaN, and a
    strict parser rejects a bare one."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value
