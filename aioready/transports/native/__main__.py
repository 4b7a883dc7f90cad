"""`python -m aioready.transports.native build`: compile the MPI helper (make test runs it)."""

from __future__ import annotations

import sys

from . import build


def main(argv: list[str]) -> int:
    if argv != ["build"]:
        print("usage: python -m aioready.transports.native build", file=sys.stderr)
        return 2
    try:
        print(f"built {build(verbose=True)}")
    except RuntimeError as exc:
        print(f"aioready.transports.native: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
