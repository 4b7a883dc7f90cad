"""The `aioready` command (also `python -m aioready`).

Each subcommand lives in aioready/cli/<name>.py with `add_parser(subparsers)` and
`run(args) -> int`; this module only wires them together. It is the only place that installs
uvloop (through `aioready.run`), and under MPI an unhandled error on one rank aborts the whole job
instead of leaving the others hanging.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

__all__ = ["main", "build_parser", "COMMANDS"]

COMMANDS = ("train", "simulate", "tune", "advise", "plot", "hints")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aioready",
        description="Readiness-first pipeline-parallel training: train, simulate, tune, advise, plot, "
        "hints.",
        epilog="Run 'aioready <command> --help' for each command's options and examples.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"aioready.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"aioready.cli.{name}":
                raise
            from ..errors import InternalError  # a broken install: say so, never hide a command
            raise InternalError(f"the module of command {name!r} is missing",
                                expected=f"aioready/cli/{name}.py", got="no such module",
                                fix="reinstall aioready") from exc
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except Exception as exc:
        from ..errors import AioreadyError
        if not isinstance(exc, AioreadyError):
            raise
        print(f"aioready {args.command}: error: {exc}", file=sys.stderr)
        _abort_world()
        return 1


def _abort_world() -> None:
    """Under mpirun, one rank's error stops every rank (python -m mpi4py's rule)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.COMM_WORLD.Get_size() > 1:  # type: ignore[attr-defined]
        sys.stderr.flush()
        mpi.COMM_WORLD.Abort(1)  # type: ignore[attr-defined]
