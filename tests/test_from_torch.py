"""Importing torch.distributed.pipelining schedules: the compute order is torch's, rank by rank;
the imported hint trains exactly in-process; torch 2.13's 1F1B off-by-one is refused or fixed;
the CSV dump imports the same; the schedulers package loads no torch."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

from aioready.clock import run_virtual
from aioready.devices import SimDevice
from aioready.errors import HintError
from aioready.runtime.pipeline import Pipeline
from aioready.schedulers import make_hint
from aioready.schedulers.from_torch import from_torch_actions, from_torch_csv, from_torch_schedule
from aioready.tasks import Kind
from aioready.testing.helpers import make_mlp_stages, max_grad_diff, mse_loss, reference_step

torch.set_num_threads(1)

TORCH_KIND = {Kind.F: ("F",), Kind.B: ("I", "B"), Kind.W: ("W",)}
MULTI = ["Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"]


def torch_compute(name: str, R: int, M: int) -> list[list[str]]:
    rows = get_schedule_ops(name, R, M, 2)
    return [[str(a) for a in row if a is not None] for row in rows]


@pytest.mark.parametrize("name", MULTI)
@pytest.mark.parametrize("R,M", [(2, 4), (4, 8), (4, 16)])
def test_reproduces_torch_compute_order(name: str, R: int, M: int) -> None:
    hint = from_torch_schedule(name, R, M, 2)
    p = hint.placement
    assert p.style == ("v" if name.startswith("ZBV") else "interleaved")
    for rank, row in enumerate(torch_compute(name, R, M)):
        mine = [f"{p.stage_of(rank, t.chunk)}{t.kind.name}{t.microbatch}"
                for t in hint.orders[rank]]
        theirs = [a.replace("I", "B") for a in row]
        assert mine == theirs, f"rank {rank}"


@pytest.mark.parametrize("name,ours", [("Interleaved1F1B", "interleaved-1f1b"),
                                       ("InterleavedZeroBubble", "interleaved-zb"),
                                       ("ZBVZeroBubble", "zbv")])
def test_our_generators_equal_torch(name: str, ours: str) -> None:
    for R, M in [(2, 4), (4, 8), (4, 16)]:
        imported = from_torch_schedule(name, R, M, 2)
        mine = make_hint(ours, num_stages=2 * R, num_microbatches=M,
                         split_backward=imported.split_backward)
        assert mine.orders == imported.orders, (R, M)


@pytest.mark.parametrize("mode", ["strict", "ready"])
@pytest.mark.parametrize("name", MULTI + ["DualPipeV"])
def test_imported_hint_trains_exactly(name: str, mode: str) -> None:
    hint = from_torch_schedule(name, 2, 4, 2)
    S, M = hint.placement.num_stages, hint.num_microbatches
    stages = make_mlp_stages(S, width=8, hidden=8, blocks_per_stage=1)
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(2, 8, generator=gen, dtype=torch.float64) for _ in range(M)]
    ys = [torch.randn(2, 8, generator=gen, dtype=torch.float64) for _ in range(M)]
    ref_loss, ref = reference_step(stages, mse_loss, xs, ys)

    async def main() -> torch.Tensor:
        pipe = Pipeline(stages, mse_loss, microbatches=M, hint=hint, mode=mode,
                        split_backward=hint.split_backward,
                        device=SimDevice(lambda i: 1.0 + 0.3 * (i.microbatch % 3)))
        return await pipe.step(xs, ys)  # type: ignore[no-any-return]

    loss = run_virtual(main())
    assert abs(float(loss) - float(ref_loss)) <= 1e-10
    assert max_grad_diff(stages, ref) <= 1e-10


def test_dualpipev_full_backward_becomes_b_then_w() -> None:
    hint = from_torch_schedule("DualPipeV", 4, 8, 2)
    assert hint.split_backward and hint.placement.style == "v"
    row = hint.orders[0]
    i = row.index(next(t for t in row if t.kind is Kind.B and t.microbatch == 3 and t.chunk == 1))
    assert row[i + 1].kind is Kind.W and row[i + 1].microbatch == 3  # torch 7B3 -> B3c1 W3c1
    hint.check_sequence()


def test_torch_1f1b_off_by_one_refused_or_fixed() -> None:
    with pytest.raises(HintError, match=r"rank 3.*off-by-one.*F1\.\.F8 \(no F0\)"):
        from_torch_schedule("1F1B", 4, 8)
    fixed = from_torch_schedule("1F1B", 4, 8, fix_off_by_one=True)
    assert fixed.orders == make_hint("1f1b", num_stages=4, num_microbatches=8).orders


def test_csv_dump_imports_the_same(tmp_path: Path) -> None:
    rows = get_schedule_ops("ZBVZeroBubble", 4, 8, 2)
    path = tmp_path / "zbv.csv"
    with path.open("w", newline="") as fh:  # the format of torch's _dump_csv: row = rank
        csv.writer(fh).writerows(rows)
    assert from_torch_csv(path).orders == from_torch_schedule("ZBVZeroBubble", 4, 8, 2).orders


def test_comm_and_idle_actions_are_dropped() -> None:
    rows = [["0F0", "", "0SEND_F0", "0RECV_B0", "0B0", "0REDUCE_GRAD", None],
            ["1RECV_F0", "1F0", "1B0", "1SEND_B0", "1UNSHARD", "1RESHARD"]]
    hint = from_torch_actions(rows)
    assert [str(t) for t in hint.orders[0]] == ["F0", "B0"]
    assert [str(t) for t in hint.orders[1]] == ["F0", "B0"]
    assert not hint.split_backward


def test_bad_torch_actions() -> None:
    with pytest.raises(HintError, match="rank 1, action 0: cannot parse"):
        from_torch_actions([["0F0", "0B0"], ["1X0"]])
    with pytest.raises(HintError, match="one stage on two ranks"):
        from_torch_actions([["0F0", "0B0"], ["0F1", "0B1"]])
    with pytest.raises(HintError, match="does not map to a hint.*twice"):
        from_torch_actions([["0F0", "0I0", "0W0", "0B0"], ["1F0", "1I0", "1W0"]])
    with pytest.raises(HintError, match="does not map to a hint.*misses"):
        from_torch_actions([["0F0", "0I0"], ["1F0", "1I0", "1W0"]])


def test_schedulers_do_not_import_torch() -> None:
    code = ("import sys; import aioready.schedulers as s; from aioready.schedulers import "
            "from_torch, interleaved, zb, zbv, rules, listsched, gpipe, onefoneb; "
            "import aioready.hints, aioready.cli.hints; "
            "[s.make_hint(n, num_stages=8, num_microbatches=8, split_backward=n in "
            "('zb-h1','zb-h2','zbv','bfw','interleaved-zb')) for n in s.hint_names()]; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])


def test_make_hint_torch_prefix() -> None:
    hint = make_hint("torch:ZBVZeroBubble", num_stages=8, num_microbatches=8,
                     split_backward=True)
    assert hint.orders == make_hint("zbv", num_stages=8, num_microbatches=8,
                                    split_backward=True).orders
    with pytest.raises(HintError, match="needs split_backward=True"):
        make_hint("torch:InterleavedZeroBubble", num_stages=8, num_microbatches=8)
