"""policy="auto": the pipeline keeps its hint and cap, starts under the reserving rule (which
never loses to strict), and after the first step runs whichever ready-mode policy a simulation
of the measured durations finds faster (docs/policy.md "Choosing the policy")."""

from __future__ import annotations

import pytest

import aioready
from aioready.caps import resolve_caps
from aioready.clock import run_virtual
from aioready.devices.sim import SimDevice
from aioready.errors import ConfigError
from aioready.hints import HintOrder
from aioready.runtime.autotune import AutoTuning
from aioready.runtime.rank import POLICIES
from aioready.schedulers import make_hint
from aioready.sim.durations import device_duration
from aioready.sim.variability import JitterModel, parse_jitter

S, M, STEPS = 8, 32, 3


def run(policy: str, hint: str, split: bool, jitter: str = "multimodal:0.3:3",
        cap: object = None) -> tuple[aioready.Pipeline, list[float]]:
    order = make_hint(hint, num_stages=S, num_microbatches=M, split_backward=split)
    model = JitterModel(parse_jitter(jitter), seed=0, placement=order.placement,
                        num_microbatches=M, split_backward=split)

    async def main() -> tuple[aioready.Pipeline, list[float]]:
        pipe = aioready.Pipeline([None] * S, None, microbatches=M, hint=hint,
                                 split_backward=split, policy=policy, cap=cap,
                                 device=SimDevice(device_duration(model, scale=1.0),
                                                  run_compute=False))
        times = []
        for _ in range(STEPS):
            await pipe.step()
            times.append(pipe.last_step.step_time)
        return pipe, times
    return run_virtual(main())


@pytest.mark.parametrize("hint,split,jitter", [("interleaved-zb", True, "multimodal:0.3:3"),
                                               ("bf", False, "lognormal:0.5")])
def test_auto_runs_the_policy_the_first_step_says_is_faster(hint: str, split: bool,
                                                            jitter: str) -> None:
    auto, times = run("auto", hint, split, jitter)
    fixed = {policy: run(policy, hint, split, jitter)[1] for policy in POLICIES}
    assert times[0] == fixed["reserve"][0]  # the first step runs the rule that never loses
    [(at, choice)] = auto.auto.choices  # chosen once, after the first step
    assert at == 1 and choice.hint == hint and choice.mode == "ready"
    assert choice.cap == tuple(rt.cap for rt in auto.runtimes)  # the hint's own caps, kept
    assert times[1:] == pytest.approx(fixed[choice.policy][1:], rel=1e-12)  # clock offsets round
    # the choice is the fastest on the step it was made from (ties: the first in POLICIES)
    assert choice.policy == min(POLICIES, key=lambda p: (fixed[p][0], POLICIES.index(p)))
    # and each side has a case: greedy or light (the greedy family) gains on interleaved-zb
    # (multimodal), loses on bf (lognormal; on multimodal `light` beats reserve on bf too)
    assert (choice.policy != "reserve") == (hint == "interleaved-zb")


def test_auto_policy_keeps_a_raised_cap() -> None:
    """With cap="2x" the policies are simulated, and the chosen one runs, at 2x: the pipeline's
    own caps (each policy at its hint's own peak would halve the memory the caller gave)."""
    auto, times = run("auto", "1f1b", False, "lognormal:0.5", cap="2x")
    order = make_hint("1f1b", num_stages=S, num_microbatches=M)
    [(_, choice)] = auto.auto.choices
    assert choice.cap == tuple(resolve_caps("2x", order))
    assert tuple(rt.cap for rt in auto.runtimes) == choice.cap
    fixed = {policy: run(policy, "1f1b", False, "lognormal:0.5", cap="2x")[1]
             for policy in POLICIES}
    assert times[1:] == pytest.approx(fixed[choice.policy][1:], rel=1e-12)


def test_auto_policy_is_refused_where_it_cannot_switch() -> None:
    custom = make_hint("1f1b", num_stages=4, num_microbatches=8)
    custom = HintOrder.from_orders("mine", custom.placement, 8, False, custom.orders)
    with pytest.raises(ConfigError, match="library hint"):
        aioready.Pipeline([None] * 4, None, microbatches=8, hint=custom, policy="auto")
    # within a byte budget it needs stages that measure their bytes
    # (tests/test_autotune_pipeline_memory.py); a tensor-parallel one cannot switch
    with pytest.raises(ConfigError, match="tensor-parallel"):
        AutoTuning.for_policy("1f1b", budget=None, memory="2x", coordinator=object())
