"""`aioready train` with no schedule flags runs hint="auto": it chooses before step 0 what a
running pipeline cannot switch (split backward; with two stages per rank, the placement style),
then after step 1 the schedule, never holding more (chunk, microbatch) activations on any rank
than the reference's strict order at its peak (1F1B's on one chunk, ZBV's on two).
Whatever it chooses, it trains exactly like the unsplit model (losses of every step, optimizer
included), and its JSON summary says where it started and what it chose."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import requires_mpi, run_mpi

from aioready.cli import main
from aioready.cli.train import add_parser, config_from_args
from aioready.cli.trainer import TrainConfig, synthetic_microbatch
from aioready.schedulers import make_hint
from aioready.sim.start import choose_start, default_budget, unmodelled_start
from aioready.telemetry.metrics import peak_activations
from aioready.telemetry.spans import Span
from aioready.testing.helpers import reference_step
from aioready.testing.models import gpt_stages, lm_loss

pytestmark = pytest.mark.timeout(120)
MODEL = ["--batch", "1", "--seq", "4", "--dim", "8", "--layers-per-stage", "1"]


def _args(stages: int, M: int, steps: int, out: Path) -> list[str]:
    return ["train", "--stages", str(stages), "--microbatches", str(M), "--steps", str(steps),
            "--task-ms", "2", "--jitter", "multimodal:0.3:3", "--seed", "3", "--no-progress",
            *MODEL, "--json", str(out)]


def _reference_losses(cfg: TrainConfig) -> list[float]:
    """The unsplit model on the same batches, AdamW after each step, as `train` runs it."""
    model = gpt_stages(cfg.stages, vocab=cfg.vocab, dim=cfg.dim, heads=cfg.heads,
                       layers_per_stage=cfg.layers_per_stage, seq=cfg.seq, seed=cfg.seed)
    params = [p for s in model for p in s.parameters()]
    opt = torch.optim.AdamW(params, lr=cfg.lr)
    losses = []
    for step in range(cfg.steps):
        pairs = [synthetic_microbatch(step, m, batch=cfg.batch, seq=cfg.seq, vocab=cfg.vocab,
                                      seed=cfg.seed) for m in range(cfg.microbatches)]
        loss, copies = reference_step(model, lm_loss, [x for x, _ in pairs],
                                      [y for _, y in pairs])
        for p, q in zip(params, [q for s in copies for q in s.parameters()]):
            p.grad = q.grad
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses


def _config(argv: list[str]) -> TrainConfig:
    import argparse
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return config_from_args(parser.parse_args(argv))


def _reference_peak(stages: int, ranks: int, microbatches: int) -> int:
    """What the default may hold: 1F1B's strict peak on one chunk, ZBV's on two (split open)."""
    name, style = ("1f1b", "linear") if stages == ranks else ("zbv", "v")
    order = make_hint(name, num_stages=stages, num_ranks=ranks, num_microbatches=microbatches,
                      split_backward=name == "zbv", placement=style)
    return max(order.peak_chunk_activations(r) for r in range(ranks))


def _check(summary: dict, cfg: TrainConfig, ranks: int) -> dict:
    assert summary["hint"] == "auto"
    auto = summary["auto"]
    start = auto["start"]
    assert start is not None and start["split_backward"] == summary["split_backward"]
    budget = _reference_peak(cfg.stages, ranks, cfg.microbatches)
    assert start["budget"] == default_budget(cfg.stages, ranks, cfg.microbatches) == budget
    held = summary["peak_activations"]  # measured: (chunk, microbatch) pairs held, per rank
    assert len(held) == cfg.steps and all(len(step) == ranks for step in held)
    for step in held:  # the real run never holds more than the reference's strict peak
        assert max(step) <= budget, (step, budget)
    assert [c["from_step"] for c in auto["choices"]] == [1]
    assert auto["choices"][0]["placement"] == start["placement"]  # a style is kept
    assert all(max(c["caps"]) <= start["budget"] for c in auto["choices"])
    chunks = cfg.stages // ranks
    for c in auto["choices"]:  # ready: a count whose every microbatch may hold every chunk
        assert c["mode"].startswith("strict") or chunks * max(c["caps"]) <= budget, c
    for peaks in summary["peak_in_flight"]:  # never past the budget, on any rank
        assert max(peaks) <= start["budget"], peaks
    assert summary["loss"] == pytest.approx(_reference_losses(cfg), rel=1e-5, abs=1e-6)
    return start


def test_train_with_no_schedule_flags_chooses_and_trains_exactly(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    argv = _args(4, 4, 3, out)
    cfg = _config(argv)
    assert (cfg.hint, cfg.split_backward, cfg.cap) == ("auto", None, None)
    assert main(argv) == 0
    start = _check(json.loads(out.read_text()), cfg, ranks=4)
    assert start["placement"] == "linear"  # one stage per rank: the split was open


@requires_mpi
@pytest.mark.mpi
@pytest.mark.timeout(200)
def test_train_default_over_mpi_chooses_a_two_chunk_placement(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    argv = _args(4, 4, 2, out)
    proc = run_mpi(2, ["-m", "aioready", *argv], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    start = _check(json.loads(out.read_text()), _config(argv), ranks=2)
    assert start["placement"] in ("interleaved", "v")
    assert "hint=auto: started from" in proc.stdout


@pytest.mark.parametrize("flags,hint", [([], "auto"), (["--mode", "strict"], "1f1b"),
                                        (["--memory", "2x"], "1f1b"), (["--dp", "2"], "1f1b"),
                                        (["--hint", "zbv"], "zbv")])
def test_which_runs_choose(flags: list[str], hint: str) -> None:
    cfg = _config(["train", *flags])
    assert cfg.hint == hint
    assert cfg.split_backward is (None if hint == "auto" else False)
    assert _config(["train", *flags, "--no-split-backward"]).split_backward is False
    assert _config(["train", *flags, "--split-backward"]).split_backward is True


def test_split_is_open_only_to_plain_auto() -> None:
    with pytest.raises(Exception, match="needs hint='auto'"):
        TrainConfig(hint="auto:1f1b", split_backward=None)


def test_the_start_is_the_fastest_simulated_or_unsplit_without_durations() -> None:
    def jitter(placement, split):  # noqa: ARG001 - the same model for every shape
        return {"jitter": "multimodal:0.3:3", "seed": 1}
    start = choose_start(num_stages=8, num_ranks=4, num_microbatches=8, split_backward=None,
                         durations=jitter)
    assert start.budget == default_budget(8, 4, 8) == 2 * 4
    times = [float(line.rsplit(":", 1)[1].split()[0]) for line in start.table.splitlines()]
    assert len(times) == 4  # interleaved and v, unsplit and split
    assert start.step_ms == pytest.approx(min(times), rel=1e-3)
    assert len(start.encode()) == type(start).width(4)  # what the other ranks receive into
    again = type(start).decode(start.encode())
    assert (again.choice, again.split_backward, again.budget) == (
        start.choice, start.split_backward, start.budget)

    tie = unmodelled_start(num_stages=8, num_ranks=4, num_microbatches=8, split_backward=None)
    assert (tie.split_backward, tie.choice.placement, tie.choice.hint) == (
        False, "interleaved", "interleaved-1f1b")
    assert tie.choice.cap == (default_budget(8, 4, 8) // 2,) * 4  # ready: budget // chunks
    fixed = choose_start(num_stages=4, num_ranks=4, num_microbatches=8, split_backward=True,
                         durations=jitter)
    assert fixed.split_backward and fixed.choice.placement == "linear"


def test_peak_activations_replays_what_a_strict_order_holds() -> None:
    """The measured figure (each (chunk, microbatch) from its F's start to its last backward
    piece's end) equals the order's own peak when the order runs in sequence, on one chunk and
    on two, and counts a V's two chunks of a microbatch twice where the in-flight count does
    not."""
    for name, stages, style, split in (("zbv", 8, "v", True), ("bf", 8, "v", False),
                                       ("1f1b", 4, "linear", False)):
        order = make_hint(name, num_stages=stages, num_ranks=4, num_microbatches=8,
                          split_backward=split, placement=style)
        for rank in range(4):
            spans = [Span(rank=rank, stage=order.placement.stages_of(rank)[t.chunk],
                          chunk=t.chunk, microbatch=t.microbatch, kind=t.kind, ready=i,
                          start=float(i), end=i + 1.0)
                     for i, t in enumerate(order.strict_order(rank))]
            assert peak_activations(spans, rank) == order.peak_chunk_activations(rank)
    assert max(order.peak_chunk_activations(r) for r in range(4)) == 4  # 1f1b, one chunk
    assert _reference_peak(8, 4, 8) == 8 < max(
        make_hint("bf", num_stages=8, num_ranks=4, num_microbatches=8,
                  placement="v").peak_chunk_activations(r) for r in range(4))


def test_the_start_and_its_candidates_hold_at_most_the_activation_budget() -> None:
    """Every candidate the start chooses among: strict ones by their order's peak, ready ones
    by chunks x their simulated in-flight peak, the bound that holds on any durations."""
    def jitter(placement, split):  # noqa: ARG001
        return {"jitter": "multimodal:0.3:3", "seed": 0}
    start = choose_start(num_stages=8, num_ranks=4, num_microbatches=8, split_backward=None,
                         durations=jitter)
    assert start.budget == _reference_peak(8, 4, 8) == 8
    c = start.choice
    order = start.order(num_stages=8, num_ranks=4, num_microbatches=8)
    if c.mode == "strict":
        assert max(order.peak_chunk_activations(r) for r in range(4)) <= start.budget
    else:
        assert 2 * max(c.cap) <= start.budget
