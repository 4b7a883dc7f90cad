"""Which transport a job uses: an explicit choice, else how the job was launched.

`job_transport(transport=None)` is the one place that maps a launch to a transport, so a script
runs unchanged under `mpiexec` and under `torchrun`:

- an explicit `transport` wins: a Transport object is returned as is; a name ("mpi", "torch",
  "inproc") builds that one;
- otherwise `aioready.launch.launcher()` reads the environment: torchrun's variables give
  TorchDistTransport over the world group (initialised from them if nobody did), an MPI
  launcher's give MPITransport over COMM_WORLD, nothing gives None (the whole pipeline in this
  process). A one-rank job also gives None.

Without this choice a script started by torchrun built an in-process pipeline on every rank: N
independent copies of the job that never exchanged a message.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ..errors import ConfigError
from ..launch import launcher

__all__ = ["job_transport", "TRANSPORT_NAMES"]

TRANSPORT_NAMES = ("mpi", "torch", "inproc")
log = logging.getLogger(__name__)


def job_transport(transport: Any = None, *, group: Any = None, device: Any = None) -> Any:
    """The transport of this rank: `transport` if given (object or name), else the launch's.

    `group` is the torch.distributed group (or DeviceMesh) or MPI communicator to use; `device`
    where received tensors land. Returns None for a single-process run.
    """
    if transport is not None and not isinstance(transport, str):
        return transport
    name = transport or _launched()
    if name not in TRANSPORT_NAMES:
        raise ConfigError("unknown transport", expected=" | ".join(TRANSPORT_NAMES),
                          got=repr(name))
    if name == "inproc":
        return None
    if name == "torch":
        from .torchdist import TorchDistTransport
        chosen: Any = TorchDistTransport(group, device=device)
    else:
        try:
            from .mpi import MPITransport
        except ImportError as exc:
            raise ConfigError("the MPI transport needs mpi4py", expected="mpi4py installed",
                              got=str(exc), fix="pip install 'aioready[mpi]'") from None
        chosen = MPITransport(group, device=device)
    if chosen.world_size == 1 and transport is None:
        return None  # a one-rank launch: the plain in-process pipeline
    log.info("rank %d/%d: %s transport (%s)", chosen.rank, chosen.world_size, name,
             "chosen" if transport else f"launched by {launcher()}")
    return chosen


def _launched() -> str:
    how = launcher()
    if how == "torchrun":
        return "torch" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else "inproc"
    return "mpi" if how == "mpi" else "inproc"
