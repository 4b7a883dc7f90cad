"""StagedSends keeps a peer's payloads in posting order while CUDA copies complete in any order
(gloo matches them in that order), with fake CUDA tensors and copies: no GPU needed. The copies
themselves run in tests/torch_scripts/cuda_staged.py (GPU)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from aioready.transports.torch_staging import StagedSends


class FakeCuda:
    """A 'CUDA' tensor: what StagedSends reads of one."""

    is_cuda = True
    device = "fake"

    def __init__(self, value: int) -> None:
        self.value = value

    def detach(self) -> "FakeCuda":
        return self

    def contiguous(self) -> "FakeCuda":
        return self


class FakeStager:
    def __init__(self) -> None:
        self.copies: list[asyncio.Future[None]] = []
        self.released: list[int] = []

    def to_host(self, t: FakeCuda, ready: Any) -> tuple[torch.Tensor, int]:
        return torch.full((2,), t.value, dtype=torch.uint8), len(self.copies)

    def completion(self, done: int) -> asyncio.Future[None]:
        self.copies.append(asyncio.get_running_loop().create_future())
        return self.copies[-1]

    def release(self, host: torch.Tensor) -> None:
        self.released.append(int(host[0]))


def staged(sent: list[tuple[int, int]], errors: list[BaseException]
           ) -> tuple[StagedSends, FakeStager]:
    stager = FakeStager()

    def send(dest: int, buf: torch.Tensor, release: Any) -> None:
        sent.append((dest, int(buf[0])))
        if release is not None:
            release()
    staging = StagedSends(send, errors.append)
    staging._stager = lambda device: stager  # type: ignore[method-assign]
    staging._ready = staticmethod(lambda t: None)  # type: ignore[method-assign]
    return staging, stager


@pytest.mark.timeout(10)
def test_payloads_leave_in_posting_order_whatever_copy_finishes_first() -> None:
    async def main() -> None:
        sent: list[tuple[int, int]] = []
        staging, stager = staged(sent, [])
        staging.push(1, FakeCuda(10))
        assert staging.busy(1) and not staging.busy(2)
        staging.push(1, torch.full((2,), 11, dtype=torch.uint8))  # host: queues behind
        staging.push(1, FakeCuda(12))
        stager.copies[1].set_result(None)  # the later copy first: nothing may leave yet
        await asyncio.sleep(0)
        assert sent == []
        stager.copies[0].set_result(None)
        await asyncio.sleep(0)
        assert sent == [(1, 10), (1, 11), (1, 12)]
        assert stager.released == [10, 12] and not staging.busy(1)
    asyncio.run(main())


@pytest.mark.timeout(10)
def test_a_failed_copy_is_reported_and_nothing_behind_it_leaves() -> None:
    async def main() -> None:
        sent: list[tuple[int, int]] = []
        errors: list[BaseException] = []
        staging, stager = staged(sent, errors)
        staging.push(1, FakeCuda(10))
        staging.push(1, torch.full((2,), 11, dtype=torch.uint8))
        stager.copies[0].set_exception(RuntimeError("CUDA error: an illegal memory access"))
        await asyncio.sleep(0)
        assert sent == [] and len(errors) == 1 and "illegal memory" in str(errors[0])
    asyncio.run(main())
