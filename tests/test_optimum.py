"""bench/optimum.py: the CP-SAT optimum of one step lies between the lower bound and the
simulated strict step, hits known answers, and its independent checker rejects bad schedules.

Every instance here is a few dozen tasks, which CP-SAT proves optimal in milliseconds; the time
limit is only a guard. The simulator is given the instance's quantised durations (a Trace), so
both sides read the same numbers.
"""

from __future__ import annotations

import json

import pytest

from aioready.clock import run_virtual
from aioready.devices import SimDevice
from aioready.runtime.pipeline import Pipeline
from aioready.schedulers import make_hint
from aioready.sim.durations import device_duration
from aioready.sim.variability import JitterModel
from aioready.tasks import Kind
from aioready.telemetry.bounds import lower_bound_table
from bench.optimum import Instance, check, greedy, instance, schedule_of, solve

LIMIT_S = 30.0


def _instance(name: str, S: int, M: int, jitter: str, seed: int, split: bool = False,
              caps: tuple[int, ...] | None = None) -> tuple[Instance, object]:
    hint = make_hint(name, num_stages=S, num_microbatches=M, split_backward=split)
    model = JitterModel(jitter, seed=seed, placement=hint.placement, num_microbatches=M,
                        split_backward=split)
    inst = instance(model.table(0), placement=hint.placement, split_backward=split,
                    caps=caps or hint.default_caps)
    return inst, hint


def _run(inst: Instance, hint: object, mode: str):  # -> StepReport
    async def main():
        pipe = Pipeline([None] * inst.placement.num_stages, None,
                        microbatches=inst.num_microbatches, hint=hint, mode=mode,
                        split_backward=inst.split_backward, cap=list(inst.caps),
                        device=SimDevice(device_duration(inst.trace(), 1.0), run_compute=False))
        await pipe.step()
        return pipe.last_step
    return run_virtual(main())


def test_no_jitter_1f1b_cap_is_the_textbook_time() -> None:
    # the lower bound is (M+S-1)(F+B) here and strict 1F1B reaches it: nothing can do better
    inst, _ = _instance("1f1b", 3, 4, "none", 0)
    opt = solve(inst, time_limit_s=LIMIT_S)
    assert opt.status == "OPTIMAL"
    assert opt.makespan_ms == pytest.approx((4 + 3 - 1) * 3.0)
    assert opt.bound == opt.objective


def test_cap_one_serialises_every_microbatch() -> None:
    # cap 1 on rank 0 holds one microbatch for its whole round trip (3S): M*3S, twice the
    # lower bound, which ignores memory
    inst, hint = _instance("1f1b", 3, 4, "none", 0, caps=(1, 1, 1))
    opt = solve(inst, time_limit_s=LIMIT_S)
    assert opt.status == "OPTIMAL"
    assert opt.makespan_ms == pytest.approx(4 * 3 * 3.0)
    assert lower_bound_table(inst.placement, inst.table_ms(), False) == pytest.approx(18.0)


@pytest.mark.parametrize("name,S,M,split,jitter", [
    ("1f1b", 2, 4, False, "lognormal:0.5"), ("1f1b", 3, 4, False, "multimodal:0.3:3"),
    ("zb-h1", 3, 4, True, "lognormal:0.5"), ("zbv", 4, 2, True, "multimodal:0.3:3"),
    ("interleaved-1f1b", 4, 2, False, "lognormal:0.5")])
def test_optimum_between_lower_bound_and_strict(name: str, S: int, M: int, split: bool,
                                                jitter: str) -> None:
    for seed in range(2):
        inst, hint = _instance(name, S, M, jitter, seed, split)
        strict = _run(inst, hint, "strict")
        opt = solve(inst, time_limit_s=LIMIT_S)  # not started from the strict schedule
        assert opt.status == "OPTIMAL", (name, seed, opt.as_dict())
        bound = lower_bound_table(inst.placement, inst.table_ms(), split)
        assert bound - 1e-9 <= opt.makespan_ms <= strict.step_time + 1e-9, (name, seed)
        assert opt.bound == opt.objective


@pytest.mark.parametrize("name,S,split", [("1f1b", 3, False), ("bfw", 3, True),
                                          ("zbv", 4, True), ("interleaved-1f1b", 4, False)])
def test_simulated_spans_pass_the_checker(name: str, S: int, split: bool) -> None:
    # the runtime's own schedules obey the formulation's rules, in-flight rule included
    inst, hint = _instance(name, S, 4, "multimodal:0.3:3", 1, split)
    for mode in ("strict", "ready"):
        report = _run(inst, hint, mode)
        schedule = schedule_of(report.spans, inst.unit_ms, report.start)
        assert check(inst, schedule) == [], (name, mode)
    assert check(inst, greedy(inst)) == []


def test_checker_rejects_broken_schedules() -> None:
    inst, _ = _instance("1f1b", 3, 4, "lognormal:0.5", 3)
    good = solve(inst, time_limit_s=LIMIT_S).schedule
    assert check(inst, good) == []
    f1 = (int(Kind.F), 1, 2)
    size = good[f1][1] - good[f1][0]
    at = good[(int(Kind.F), 0, 2)][1] - 1  # one unit before its input exists
    early = {**good, f1: (at, at + size)}
    assert any("before" in p for p in check(inst, early))
    wrong = {**good, f1: (good[f1][0], good[f1][1] + 1)}
    assert any("duration" in p for p in check(inst, wrong))
    others = [k for k in good if k[1] == 1 and k != f1]
    b = max(others, key=lambda k: good[k][0])  # the rank's last task, moved onto F2's slot
    size = good[b][1] - good[b][0]
    clash = {**good, b: (good[f1][0], good[f1][0] + size)}
    assert any("while" in p for p in check(inst, clash))
    missing = dict(good)
    del missing[f1]
    assert check(inst, missing) != []
    free = instance(inst.table_ms(), placement=inst.placement, split_backward=False,
                    caps=(4, 4, 4))
    wide = solve(free, time_limit_s=LIMIT_S).schedule
    assert check(free, wide) == []
    tight = instance(inst.table_ms(), placement=inst.placement, split_backward=False,
                     caps=(1, 1, 1))
    assert any("in flight" in p for p in check(tight, wide))


def test_policy_bench_runs_in_make_bench_and_optimum_is_a_helper() -> None:
    import bench.__main__ as runner
    names = runner.discover()
    assert "policy" in names and "optimum" not in names
    assert names.index("scaling") < names.index("policy")


def test_policy_bench_end_to_end_on_a_tiny_grid(tmp_path, monkeypatch) -> None:
    import bench.common
    import bench.policy as policy
    monkeypatch.setattr(bench.common, "RESULTS", tmp_path)
    monkeypatch.setattr(policy, "RESULTS", tmp_path)
    monkeypatch.setattr(policy, "JITTERS", ("multimodal:0.3:3",))
    # one row of each kind (fixed, each policy, auto, given order, held-out, bytes, window): the
    # whole bench's plumbing; each kind's own figures are checked in tests/test_policy_*.py
    kinds = {"ready 1f1b", "greedy zbv", "light 1f1b", "auto split", "auto, given order",
             "auto split, held-out", "auto bytes", "auto, held-out, window 4"}
    monkeypatch.setattr(policy, "CONFIGS", [c for c in policy.CONFIGS if c.name in kinds])
    assert len(policy.CONFIGS) == len(kinds)
    monkeypatch.setattr(policy, "QUICK", {"stages": (4,), "seeds": 2, "opt_cases": ((4, 4),),
                                          "opt_seeds": 1})
    body = policy.main(["--quick", "--time-limit", "0.1", "--jobs", "2"])
    for cfg in policy.CONFIGS:
        assert f"| 4 | {cfg.name} |" in body
        assert f"| 4, 4 | multimodal:0.3:3 | {cfg.name} |" in body
    data = json.loads((tmp_path / "policy.json").read_text())
    (unit,) = data["optimum"]["4@4@multimodal:0.3:3"]
    for row in unit["rows"].values():  # started from the simulated schedules: never worse
        assert row["bound_eff"] <= row["opt_eff"] <= 1.0 + 1e-9
    one = data["simulated"]["multimodal:0.3:3@4"]["ready 1f1b|2x"]
    assert one["cap0"] == 8 and one["peak"] <= 8 and one["worst"] <= one["speedup"]
