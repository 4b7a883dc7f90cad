"""The microbatch order from known costs (schedulers/order.py, sim/order.py,
runtime/mb_order.py): its shape, that it never deadlocks and keeps every invariant, that
gradients stay exact, that the simulator reorders only by known sizes, and that hint="auto"
picks a cost order only where its simulation is faster."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_no_deadlock import check_invariants

import aioready
from aioready.clock import run_virtual
from aioready.devices.sim import SimDevice
from aioready.errors import ConfigError
from aioready.placement import Placement
from aioready.runtime.rank import POLICIES
from aioready.schedulers.order import ORDERS, cost_order
from aioready.sim.variability import JitterModel
from aioready.testing.helpers import make_mlp_stages, max_grad_diff, mse_loss, reference_step

torch.set_num_threads(1)


def test_cost_order_shapes() -> None:
    costs = [3.0, 1.0, 3.0, 1.2, 1.1, 2.0]
    assert cost_order(costs, "ascending") == (4, 3, 5, 0, 2, 1)  # lightest (1) last
    assert cost_order(costs, "descending") == (4, 0, 2, 5, 3, 1)  # next lightest first
    assert cost_order(costs, "given") == tuple(range(6))
    assert cost_order([2.0] * 5, "ascending") == tuple(range(5))  # equal costs: identity
    for how in ORDERS:
        assert sorted(cost_order(costs, how, stages=2)) == list(range(6))
    with pytest.raises(ConfigError):
        cost_order(costs, "random")


def test_sizes_are_the_multimodal_factor_only() -> None:
    """What the simulator orders by: heavy or not (shared by every stage and kind), never a
    per-task draw; lognormal alone carries no sizes."""
    placement = Placement.linear(4)
    model = JitterModel("multimodal:0.3:3", seed=2, placement=placement, num_microbatches=16)
    sizes = model.sizes(0)
    assert set(sizes) <= {1.0, 3.0} and 3.0 in sizes and 1.0 in sizes
    table = model.table(0)
    ratio = table[:, :, 0].mean(axis=0)  # heavy microbatches are about 3x on every stage
    assert all((r > 2) == (s == 3.0) for r, s in zip(ratio, sizes))
    flat = JitterModel("lognormal:0.5", seed=2, placement=placement, num_microbatches=16)
    assert flat.sizes(0) is None


@pytest.mark.parametrize("hint,split", [("1f1b", False), ("zb-h2", True), ("zbv", True)])
def test_simulated_order_moves_durations_not_work(hint: str, split: bool) -> None:
    kw = dict(stages=4, microbatches=12, hint=hint, jitter="multimodal:0.3:3", seed=1,
              split_backward=split, cap="2x", policy="greedy")
    given_run = aioready.simulate(**kw)
    for how in ("ascending", "descending"):
        moved = aioready.simulate(**kw, order=how)
        assert moved.order == how
        assert moved.lower_bound == pytest.approx(given_run.lower_bound)  # the same work
        assert moved.num_tasks == given_run.num_tasks
        assert all(p <= c for p, c in zip(moved.peak_in_flight, moved.cap))
    flat = aioready.simulate(**{**kw, "jitter": "lognormal:0.5"}, order="ascending")
    assert flat.order == "given"  # no known sizes: nothing to order by


@pytest.mark.parametrize("S,split,cap", [(4, False, "2x"), (4, True, 8)])
def test_auto_chooses_an_order_only_by_simulation(S: int, split: bool, cap: object) -> None:
    kw = dict(stages=S, microbatches=4 * S, hint="auto", jitter="multimodal:0.3:3", seed=0,
              split_backward=split, cap=cap)
    both = aioready.simulate(**kw)
    given_only = aioready.simulate(**kw, order="given")
    labels = {r.candidate.order for r in both.tuning.rows}
    assert labels == set(ORDERS)
    assert {r.candidate.order for r in given_only.tuning.rows} == {"given"}
    assert both.step_time <= given_only.step_time  # an honest candidate never makes it slower
    best = both.tuning.best
    assert best.step_time == min(r.step_time for r in both.tuning.rows if r.fits)
    assert both.hint.endswith("+" + both.order) or both.order == "given"
    flat = aioready.simulate(**{**kw, "jitter": "lognormal:0.5"})
    assert {r.candidate.order for r in flat.tuning.rows} == {"given"}  # nothing to order by


HINTS = [("1f1b", 4, False), ("zb-h1", 4, True), ("bfw", 4, True), ("gpipe", 3, False),
         ("interleaved-1f1b", 4, False), ("interleaved-zb", 4, True), ("zbv", 4, True)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.sampled_from(HINTS), M=st.integers(2, 12), how=st.sampled_from(ORDERS[1:]),
       policy=st.sampled_from(POLICIES), cap=st.sampled_from([None, "2x", 1]),
       seed=st.integers(0, 2**32 - 1))
def test_reordered_steps_never_deadlock(case: tuple[str, int, bool], M: int, how: str,
                                        policy: str, cap: object, seed: int) -> None:
    """Durations follow the microbatch in each slot (a heavy one is slow everywhere), the
    order comes from its costs, and every invariant of test_no_deadlock holds."""
    hint, S, split = case
    if hint.startswith("interleaved"):
        M = 2 * -(-M // 2)
    rng = random.Random(seed)
    costs = [rng.choice([1.0, 1.0, 3.0, 0.5]) for _ in range(M)]
    slots = cost_order(costs, how, S, split)  # the order the pipeline runs
    noise: dict[tuple[int, int, int], float] = {}

    def duration(info: object) -> float:
        key = (info.stage, info.microbatch, int(info.kind))  # type: ignore[attr-defined]
        if key not in noise:
            noise[key] = rng.choice([0.0, 0.5, 1.0, 2.0])
        return noise[key] * costs[slots[info.microbatch]]  # type: ignore[attr-defined]

    async def main() -> aioready.Pipeline:
        pipe = aioready.Pipeline([None] * S, None, microbatches=M, hint=hint, mode="ready",
                                 split_backward=split, cap=cap, policy=policy,
                                 microbatch_order=how,
                                 device=SimDevice(duration, run_compute=False))
        for _ in range(2):
            await pipe.step(costs=costs)
        return pipe

    pipe = run_virtual(main())
    step = pipe.last_step
    R = pipe.hint.num_ranks
    check_invariants(step.spans, step.peak_in_flight, R=R, S=S, M=M, split=split,
                     caps=[rt.cap for rt in pipe.runtimes])


@pytest.mark.parametrize("mode", ["strict", "ready"])
@pytest.mark.parametrize("hint,split", [("1f1b", False), ("zbv", True), ("interleaved-zb", True)])
@pytest.mark.parametrize("how", ["ascending", "descending", "middle"])
def test_gradients_stay_exact(hint: str, split: bool, mode: str, how: str) -> None:
    """Microbatches of different sizes, ordered by their bytes (the default cost): loss and
    gradients match the unsplit model, last_losses come back in the caller's order."""
    S, M = 4, 8
    gen = torch.Generator().manual_seed(3)
    rows = [1, 4, 2, 1, 3, 1, 4, 2]
    xs = [torch.randn(n, 8, generator=gen, dtype=torch.float64) for n in rows]
    ys = [torch.randn(n, 8, generator=gen, dtype=torch.float64) for n in rows]
    rng = random.Random(5)
    results = {}
    for order in ("given", how):
        stages = make_mlp_stages(S, width=8, hidden=8, blocks_per_stage=1)
        ref_loss, ref = reference_step(stages, mse_loss, xs, ys)
        device = SimDevice(lambda info: rng.lognormvariate(0.0, 0.7), run_compute=True)

        async def main() -> tuple[torch.Tensor, list[tuple[float, float]]]:
            pipe = aioready.Pipeline(stages, mse_loss, microbatches=M, hint=hint, mode=mode,
                                     split_backward=split, device=device,
                                     microbatch_order=order)
            try:
                loss = await pipe.step(xs, ys)
                return loss, pipe.last_losses  # type: ignore[return-value]
            finally:
                pipe.close()
        loss, losses = run_virtual(main())
        assert abs(float(loss) - float(ref_loss)) <= 1e-10
        assert max_grad_diff(stages, ref) <= 1e-10
        results[order] = losses
    flat = [value for pair in results[how] for value in pair]
    assert flat == pytest.approx([v for pair in results["given"] for v in pair], abs=1e-12)


def test_bad_costs_are_clear() -> None:
    async def main(**kw: object) -> None:
        pipe = aioready.Pipeline([None] * 2, None, microbatches=4,
                                 **kw.pop("pipe", {}))  # type: ignore[arg-type]
        await pipe.step(**kw)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="microbatch_order"):
        run_virtual(main(pipe={"microbatch_order": "sorted"}))
    with pytest.raises(ConfigError, match="only under a microbatch order"):
        run_virtual(main(costs=[1, 2, 3, 4]))
    with pytest.raises(ConfigError, match="one per microbatch"):
        run_virtual(main(pipe={"microbatch_order": "ascending"}, costs=[1, 2]))
    with pytest.raises(ConfigError, match=r"costs\[1\]"):
        run_virtual(main(pipe={"microbatch_order": "ascending"}, costs=[1, -2, 3, 4]))
    with pytest.raises(ConfigError, match="inputs' bytes"):
        run_virtual(main(pipe={"microbatch_order": "descending"}))
    with pytest.raises(ConfigError, match="order"):
        aioready.simulate(stages=2, microbatches=4, order="sorted")
