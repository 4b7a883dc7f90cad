"""Tied events in a seeded random order (VirtualClockLoop's shuffle_seed test mode) change no
simulated outcome: strict hints keep their exact textbook times, ready mode its step time and
every rank's order. Ties are the rule here: with no jitter many tasks end, and many messages
land, at the same virtual instant; the arbiter must see all of them before deciding, in
whatever order they came."""

from __future__ import annotations

import asyncio
import functools

import pytest

from aioready.clock import run_virtual
from aioready.devices.sim import SimDevice
from aioready.runtime.rank import RankRuntime
from aioready.schedulers import make_hint
from aioready.sim import simulator
from aioready.sim.durations import device_duration
from aioready.sim.simulator import simulate
from aioready.sim.variability import JitterModel
from aioready.transports.inproc import InprocWorld

SEEDS = range(5)


def fire_order(shuffle_seed: int | None) -> tuple[list[str], list[int]]:
    """The order in which eight timers due at one instant fired (each timer `tI` also calls
    `tI'` soon, in the next pass) and eight idle waiters were released (both begun 0..7)."""
    async def main() -> tuple[list[str], list[int]]:
        loop = asyncio.get_running_loop()
        fired: list[str] = []

        def fire(name: str) -> None:
            fired.append(name)
            loop.call_soon(fired.append, name + "'")
        for i in range(8):
            loop.call_at(2.0, fire, f"t{i}")
        loop.call_at(1.0, fired.append, "early")
        loop.call_at(3.0, fired.append, "late")
        released: list[int] = []

        async def wait(i: int) -> None:
            await loop.wait_idle()  # type: ignore[attr-defined]
            released.append(i)
        await asyncio.gather(*(wait(i) for i in range(8)))
        await asyncio.sleep(5.0)
        return fired, released
    return run_virtual(main(), shuffle_seed=shuffle_seed)


def spread(fired: list[str]) -> bool:
    """Whether some tied timer fired after another one's follow-up (a later loop pass)."""
    return any(fired.index(f"t{i}'") < fired.index(f"t{j}") for i in range(8) for j in range(8))


def test_shuffle_permutes_only_ties_and_is_deterministic_per_seed() -> None:
    plain_fired, plain_released = fire_order(None)
    assert plain_released == list(range(8))
    assert plain_fired[0] == "early" and plain_fired[-1] == "late"
    assert not spread(plain_fired)  # asyncio fires all due timers in one pass
    orders = {seed: fire_order(seed) for seed in SEEDS}
    for seed, (fired, released) in orders.items():
        assert fire_order(seed) == (fired, released)  # same seed, same order
        assert fired[0] == "early" and fired[-1] == "late"  # distinct instants keep time order
        assert sorted(fired) == sorted(plain_fired) and sorted(released) == list(range(8))
    assert len({tuple(f) for f, _ in orders.values()}) > 1, "ties among timers never shuffled"
    assert any(spread(f) for f, _ in orders.values()), "ties never spread over passes"
    assert len({tuple(r) for _, r in orders.values()}) > 1, "idle waiters never shuffled"


@pytest.fixture
def shuffled_simulate(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """`simulate` on a loop that shuffles ties with the given seed."""
    def run(seed: int, **kwargs: object) -> simulator.SimResult:
        monkeypatch.setattr(simulator, "run_virtual",
                            functools.partial(run_virtual, shuffle_seed=seed))
        return simulate(**kwargs)  # type: ignore[arg-type]
    return run


@pytest.mark.parametrize("hint", ["1f1b", "gpipe"])
@pytest.mark.parametrize("S, M", [(4, 8), (6, 3)])
def test_strict_textbook_times_hold_whatever_the_tie_order(shuffled_simulate, hint: str,
                                                          S: int, M: int) -> None:
    for seed in SEEDS:
        r = shuffled_simulate(seed, stages=S, microbatches=M, hint=hint, mode="strict")
        assert r.step_time == (M + S - 1) * (1 + 2), seed
        split = shuffled_simulate(seed, stages=S, microbatches=M, hint=hint, mode="strict",
                                  split_backward=True)
        assert split.step_time == M * 3 + (S - 1) * 2, seed


def run_orders(hint_name: str, *, stages: int, microbatches: int, split: bool, jitter: str,
               cap: int | None, shuffle_seed: int | None) -> tuple[float, list[list[str]]]:
    """Step time and each rank's task order, from the runtime on the (maybe shuffled) clock."""
    hint = make_hint(hint_name, num_stages=stages, num_microbatches=microbatches,
                     split_backward=split)
    model = JitterModel(jitter, seed=7, placement=hint.placement, num_microbatches=microbatches,
                        split_backward=split)
    world = InprocWorld(hint.num_ranks, delay=model.delay(scale=1.0))
    device = SimDevice(device_duration(model, scale=1.0), run_compute=False)
    runtimes = [RankRuntime(rank=r, hint=hint, mode="ready", cap=cap, executors=None,
                            device=device, transport=world.endpoints[r])
                for r in range(hint.num_ranks)]

    async def main() -> None:
        await asyncio.gather(*(rt.run_step(0) for rt in runtimes))
    run_virtual(main(), shuffle_seed=shuffle_seed)
    reports = [rt.reports[0] for rt in runtimes]
    step_time = max(r.end for r in reports) - min(r.start for r in reports)
    return step_time, [rep.order(rt.rank) for rt, rep in zip(runtimes, reports)]


@pytest.mark.parametrize("hint, split", [("1f1b", False), ("gpipe", True), ("zb-h1", True),
                                         ("interleaved-1f1b", False), ("zbv", True)])
@pytest.mark.parametrize("jitter", ["none", "multimodal:0.5:2:0+comm:1"])
@pytest.mark.parametrize("cap", [None, 8], ids=["hint-cap", "slack"])
def test_ready_mode_outcome_does_not_depend_on_the_tie_order(hint: str, split: bool,
                                                             jitter: str, cap: int | None) -> None:
    """With slack (cap 8) ready mode has choices to make at each instant: deciding before a
    same-instant completion or message is seen (the arbiter not waiting for the instant's end)
    changes the orders for most seeds here."""
    kw = dict(stages=8, microbatches=8, split=split, jitter=jitter, cap=cap)
    plain_time, plain_orders = run_orders(hint, shuffle_seed=None, **kw)  # type: ignore[arg-type]
    assert all(len(o) == 8 * (3 if split else 2) * (2 if hint in ("interleaved-1f1b", "zbv")
                                                     else 1) for o in plain_orders)
    for seed in SEEDS:
        time, orders = run_orders(hint, shuffle_seed=seed, **kw)  # type: ignore[arg-type]
        assert time == plain_time, (seed, time, plain_time)
        assert orders == plain_orders, seed
