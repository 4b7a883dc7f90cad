"""How a job's transport is chosen: from the launcher's environment, an explicit choice winning."""

from __future__ import annotations

import pytest

from aioready.errors import ConfigError
from aioready.launch import launcher
from aioready.transports.inproc import InprocWorld
from aioready.transports.select import job_transport

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1"}


@pytest.mark.parametrize("env, expected", [
    ({}, None),
    (TORCHRUN, "torchrun"),
    ({"PMI_RANK": "0", "PMI_SIZE": "2"}, "mpi"),
    ({"OMPI_COMM_WORLD_SIZE": "2"}, "mpi"),
    ({**TORCHRUN, "PMI_SIZE": "2"}, "torchrun"),  # torchrun inside an MPI allocation
    ({k: v for k, v in TORCHRUN.items() if k != "MASTER_ADDR"}, None),  # not all of them
])
def test_launcher_reads_the_environment(env: dict[str, str], expected: str | None) -> None:
    assert launcher(env) == expected


def test_an_explicit_transport_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in TORCHRUN.items():
        monkeypatch.setenv(k, v)
    mine = InprocWorld(2).endpoint(0)
    assert job_transport(mine) is mine
    assert job_transport("inproc") is None


def test_no_launcher_means_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "PMI_RANK", "PMI_SIZE",
              "OMPI_COMM_WORLD_SIZE", "PMIX_RANK"):
        monkeypatch.delenv(k, raising=False)
    assert job_transport() is None


def test_an_unknown_transport_name_lists_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown transport \(expected mpi \| torch \| "
                                          r"inproc, got 'nccl'\)"):
        job_transport("nccl")
