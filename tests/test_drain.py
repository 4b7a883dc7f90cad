"""ReadySet Note [drain] (the `drain` policy): greedy until every entry forward is admitted;
then backwards first, and a weight gradient only where no announced gradient would find the
rank busy. Deadlock freedom, exactly-once and caps on every placement, split on and off."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from test_no_deadlock import (
    LINEAR_HINTS,
    MULTI_CHUNK,
    NEEDS_SPLIT,
    check_invariants,
    multi_chunk_hint,
    random_durations,
)
from test_ready_set import pops

from aioready.clock import run_virtual
from aioready.devices import SimDevice
from aioready.forecast import Forecast
from aioready.ready_set import ReadySet
from aioready.runtime.pipeline import Pipeline
from aioready.runtime.rank import RankRuntime
from aioready.schedulers import make_hint
from aioready.sim.durations import device_duration
from aioready.sim.simulator import simulate
from aioready.sim.variability import JitterModel
from aioready.tasks import Task
from aioready.testing.helpers import make_mlp_stages, max_grad_diff, mse_loss, reference_step
from aioready.transports.inproc import InprocWorld


def drain_set(order: str, clear, *, entries: int, cap: int = 8) -> ReadySet:
    ranked = [Task.parse(w) for w in order.split()]
    return ReadySet({t: i for i, t in enumerate(ranked)}, cap=cap, num_chunks=1,
                    split_backward=True, drain=clear, entries=entries)


def test_before_the_drain_it_is_greedy() -> None:
    # a W that ranks first runs first, whatever the forecast says, while forwards remain
    rs = drain_set("F0 W0 B1 F1", lambda w: False, entries=2)
    assert pops(rs, "F0") == ["F0"]
    assert pops(rs, "B1 W0") == ["W0", "B1"]


def test_in_the_drain_backwards_run_before_weight_gradients() -> None:
    rs = drain_set("F0 W0 B1 W1", lambda w: True, entries=1)
    assert pops(rs, "F0") == ["F0"]  # the last entry forward: the drain starts
    assert pops(rs, "W0 B1") == ["B1", "W0"]


def test_a_weight_gradient_waits_for_an_announced_gradient() -> None:
    clear = {"now": False}
    rs = drain_set("F0 W0 B1", lambda w: clear["now"], entries=1)
    assert pops(rs, "F0 W0") == ["F0"]  # W0 would end after an announced gradient arrives
    assert len(rs) == 1
    clear["now"] = True  # it arrived (or was never announced)
    assert pops(rs) == ["W0"]


def test_the_gate_binds_before_the_drain() -> None:
    rs = drain_set("F0 F1 F2", lambda w: True, entries=3, cap=1)
    assert pops(rs, "F0 F1 F2") == ["F0"]
    assert rs.in_flight == 1


def test_the_forecast_holds_w_back_only_for_an_announced_backward() -> None:
    now = {"t": 0.0}
    fc = Forecast()
    fc.new_step(lambda: now["t"])
    w0, w1, b1, f2 = (Task.parse(w) for w in ("W0", "W1", "B1", "F2"))
    assert fc.clear_of_gradients(w1)  # no estimate: nothing known to wait for
    fc.observe(w0, 2.0)
    assert fc.clear_of_gradients(w1)  # nothing announced
    fc.notice(f2, 0.5)  # a forward announced: W does not wait for it
    assert fc.clear_of_gradients(w1)
    fc.notice(b1, 1.5)  # a gradient due at 1.5: W1 (2.0) would end after it
    assert not fc.clear_of_gradients(w1)
    now["t"] = 1.0
    fc.notice(b1, 3.0)  # announced again, due at 4.0: W1 ends at 3.0
    assert fc.clear_of_gradients(w1)
    fc.carry(1, 2.0)  # microbatch 1 is twice as costly: W1 ends at 5.0
    assert not fc.clear_of_gradients(w1)
    fc.arrived(b1)
    assert fc.clear_of_gradients(w1)


CASES = ([(h, h in NEEDS_SPLIT or split) for h in LINEAR_HINTS for split in (False, True)]
         + MULTI_CHUNK)


@pytest.mark.parametrize("name,split", CASES)
def test_drain_never_deadlocks_on_any_placement(name: str, split: bool) -> None:
    """Random durations and message delays, caps of one, the hint's own, above it and random:
    every step ends, each task runs once after its inputs, and no cap is exceeded."""
    for seed in range(4):
        rng = random.Random(seed)
        R, M = 3, rng.randint(1, 9)
        if name in LINEAR_HINTS:
            hint = make_hint(name, num_stages=R, num_microbatches=M, split_backward=split)
        else:
            M = R * -(-M // R) if name.startswith("interleaved") else M
            hint = multi_chunk_hint(name, R, M, split)
        S = hint.placement.num_stages
        caps = [[1] * R, list(hint.default_caps), [M + 3] * R,
                [rng.randint(1, M + 1) for _ in range(R)]][seed]
        world = InprocWorld(R, delay=lambda src, dst, msg: rng.choice([0.0, 0.1, 0.5, 2.0]))
        device = SimDevice(random_durations(seed), run_compute=False)
        runtimes = [RankRuntime(rank=r, hint=hint, mode="ready", cap=caps[r], executors=None,
                                device=device, transport=world.endpoints[r], policy="drain",
                                caps=caps) for r in range(R)]

        async def main() -> None:
            async with asyncio.timeout(1e6):  # virtual seconds: a stall raises, never hangs
                for step in range(3):  # estimates and notices exist from the second step on
                    await asyncio.gather(*(rt.run_step(step) for rt in runtimes))

        run_virtual(main())
        assert all(rt.forecast is not None and rt._notices is not None for rt in runtimes)
        for step in range(3):
            reports = [rt.reports[step] for rt in runtimes]
            peaks = {r: p for rep in reports for r, p in rep.peak_in_flight.items()}
            check_invariants([s for rep in reports for s in rep.spans], peaks, R=R, S=S, M=M,
                             split=split, caps=caps)


def test_it_gains_on_split_hints_under_twice_1f1b_memory_per_rank() -> None:
    """lognormal:0.5, S=8, caps 2(S - r), seeds 0-3: drain is faster than greedy on the same
    durations in total, for BFW and ZB-H2 (the figures at S=32: docs/policy_measurements.md)."""
    S = 8

    def total(hint: str, policy: str) -> float:
        return sum(simulate(stages=S, microbatches=4 * S, hint=hint, jitter="lognormal:0.5",
                            seed=seed, split_backward=True, policy=policy,
                            cap=[2 * (S - r) for r in range(S)]).step_time
                   for seed in range(4))
    for hint in ("bfw", "zb-h2"):
        assert total(hint, "drain") < total(hint, "greedy")


def test_drain_keeps_gradients_exact() -> None:
    """Real stages on simulated durations with a split backward: loss and gradients match the
    unsplit reference."""
    S, M = 4, 12
    stages = make_mlp_stages(S, width=8, hidden=8, blocks_per_stage=1)
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, 8, generator=gen, dtype=torch.float64) for _ in range(M)]
    ys = [torch.randn(2, 8, generator=gen, dtype=torch.float64) for _ in range(M)]
    ref_loss, ref = reference_step(stages, mse_loss, xs, ys)
    order = make_hint("zb-h2", num_stages=S, num_microbatches=M, split_backward=True)
    model = JitterModel("lognormal:0.5", seed=1, placement=order.placement,
                        num_microbatches=M, split_backward=True)

    async def main() -> list[torch.Tensor]:
        pipe = Pipeline(stages, mse_loss, microbatches=M, hint=order, mode="ready",
                        policy="drain", split_backward=True,
                        device=SimDevice(device_duration(model, scale=1.0), run_compute=True))
        try:
            losses = [await pipe.step(xs, ys)]
            for s in stages:  # the second step (estimates and notices known) is compared
                s.zero_grad(set_to_none=True)
            losses.append(await pipe.step(xs, ys))
            return losses
        finally:
            pipe.close()

    for loss in run_virtual(main()):
        assert abs(float(loss) - float(ref_loss)) <= 1e-10
    assert max_grad_diff(stages, ref) <= 1e-10
