"""A compiled helper for the MPI transport's commonest message (`_mpifast.c`), with its build.

What it replaces: for a lone CPU tensor that travels inline (a plan of wire_plans.py), the send
was the plan's `struct` pack with `ctypes.string_at` of the tensor, then mpi4py's `Isend` and
`Test`; the receive was two `Improbe`s, three status reads, a `bytearray`, `Irecv`, `Test`, the
plan's `unpack_from` and checks, the tensor's numpy view and `torch.from_numpy`, and the
`Message`. Each of those is a Python-level call of 0.1-0.5 us; in C the send is one call and the
receive one call (docs/hot_path.md, "The compiled helper"). The bytes on the wire are the same,
and a received message is taken only by the checks the Python plan makes (length, magic,
version, tensor count, kind, descriptor bytes), so everything else, every bad header included,
goes the Python way and raises what it raises there. Nothing is unpickled.

It links the MPI library mpi4py uses (the `mpich` wheel's `libmpi.so.12` and `mpi.h`, in the
venv) and passes mpi4py's handles as integers. Built by `python -m aioready.transports.native
build` (`make test` runs it), next to this file, gitignored. Where it is not built, cannot load,
or mpi4py runs another MPI than the one it was built against, the transport takes the Python
path and says so once in the log. `AIOREADY_MPI_NATIVE=0` forces the Python path.
"""

from __future__ import annotations

import importlib
import logging
import os
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

__all__ = ["load", "build", "artifact", "status"]

log = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "_mpifast.c"
_loaded: list[tuple[ModuleType | None, str]] = []  # (module or None, why), once per process


def artifact() -> Path:
    """Where the build puts the extension (and where `load` imports it from)."""
    return HERE / f"_mpifast{sysconfig.get_config_var('EXT_SUFFIX')}"


def status() -> str:
    """Why the helper is or is not used in this process ('on', or the reason it is off)."""
    if os.environ.get("AIOREADY_MPI_NATIVE", "1") == "0":
        return "off: AIOREADY_MPI_NATIVE=0"
    load()
    return _loaded[0][1]


def load() -> ModuleType | None:
    """The compiled module, set up, or None (the Python path); logs which, once a process."""
    if os.environ.get("AIOREADY_MPI_NATIVE", "1") == "0":
        return None  # asked for: not logged as a failure, and not cached (tests flip it)
    if not _loaded:
        module, why = _import()
        _loaded.append((module, why))
        if module is None:
            log.info("MPI transport: the compiled helper is off (%s); the Python path is used",
                     why)
    return _loaded[0][0]


def _import() -> tuple[ModuleType | None, str]:
    from mpi4py import MPI  # first: its libmpi is the one the helper's symbols resolve to
    flavour = Path(MPI.__file__).name.split(".")[1]
    if flavour != "mpich":
        return None, f"mpi4py runs its {flavour!r} build; the helper is built for MPICH's ABI"
    if not artifact().exists():
        return None, f"not built: run `{sys.executable} -m aioready.transports.native build`"
    try:
        module = importlib.import_module(f"{__name__}._mpifast")
    except ImportError as exc:
        return None, f"{artifact().name} does not load: {exc}"
    if SOURCE.exists() and SOURCE.stat().st_mtime > artifact().stat().st_mtime:
        return None, f"{artifact().name} is older than {SOURCE.name}: build it again"
    _setup(module)
    return module, "on"


def _setup(module: ModuleType) -> None:
    import numpy as np

    from ..base import Message, MessageKind
    from ..header import _VERSION, HEADER_MAGIC
    from ..tensor_bytes import torch_module
    module.setup(tuple(MessageKind), int(MessageKind.CONTROL), Message, np.ndarray,
                 torch_module().from_numpy, HEADER_MAGIC, _VERSION, int(MessageKind.NOTICE))


def build(verbose: bool = False) -> Path:
    """Compile `_mpifast.c` against the venv's MPICH (its mpi.h and libmpi); returns the
    artifact. Raises RuntimeError saying what is missing or what the compiler said."""
    prefix = Path(sysconfig.get_paths()["data"])
    include = next((d for d in (prefix / "include", Path(sys.prefix) / "include")
                    if (d / "mpi.h").exists()), None)
    lib = next((d for d in (prefix / "lib", Path(sys.prefix) / "lib")
                if (d / "libmpi.so").exists()), None)
    if include is None or lib is None:
        raise RuntimeError(f"no mpi.h / libmpi.so under {prefix}: install the `mpich` wheel "
                           "(pip install 'aioready[mpi]')")
    out = artifact()
    tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
    cmd = [os.environ.get("CC", "gcc"), "-O2", "-shared", "-fPIC", "-Wall", "-Werror",
           f"-I{sysconfig.get_paths()['include']}", f"-I{include}", str(SOURCE), "-o",
           str(tmp), f"-L{lib}", "-lmpi", f"-Wl,-rpath,{lib}"]
    if verbose:
        print(" ".join(cmd))
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as exc:
        raise RuntimeError(f"cannot run the C compiler {cmd[0]!r}: {exc}") from None
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr}")
    os.replace(tmp, out)  # atomic: a process importing it meanwhile sees the old or the new
    return out
