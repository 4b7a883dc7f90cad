"""Pipeline: the public entry point, `loss = await pipe.step(inputs, targets)`.

It works inside whatever asyncio loop is running (a training script, a service) and never
installs a loop policy. With no transport, every stage runs in this process, one RankRuntime per
rank on the in-process transport; with a transport (MPI), `stages` are this rank's chunks.
Gradients accumulate in the stage modules; the caller steps the optimizer.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, Sequence, TypeVar

from ..caps import CapSpec, parse_cap, resolve_caps
from ..clock import virtual_clock
from ..devices.base import Device
from ..errors import ConfigError
from ..hints import HintOrder
from ..memory import MemorySpec, check_one_gate, parse_memory, resolve_memory
from ..schedulers import make_hint
from ..telemetry.spans import StepReport, merge_reports
from ..transports.base import Transport
from ..transports.inproc import InprocWorld
from .autotune import AutoHint, AutoTuning, parse_auto
from .driver import run_ranks
from .mb_order import check_order, step_order
from .rank import MODES, RankRuntime
from .watchdog import DEFAULT, STALL_TIMEOUT_S, StallWatchdog, StepGuard, resolve_timeout

__all__ = ["Pipeline", "split_microbatches"]

T = TypeVar("T")


def split_microbatches(value: Any, num: int, *, name: str) -> list[Any] | None:
    """Split a batch into `num` equal microbatches along dim 0; a list is taken as given."""
    if value is None:
        return None
    if isinstance(value, list):
        if len(value) != num:
            raise ConfigError(f"{name}: a list is taken as the microbatches themselves",
                              expected=f"{num} microbatches", got=f"{len(value)}")
        return value
    if isinstance(value, tuple):
        parts = [split_microbatches(v, num, name=f"{name}[{i}]") for i, v in enumerate(value)]
        return [tuple(p[m] for p in parts) for m in range(num)]  # type: ignore[index]
    size = value.shape[0]
    if size % num:
        raise ConfigError(f"{name}: batch does not split into equal microbatches",
                          expected=f"a batch size divisible by microbatches={num}",
                          got=f"batch size {size}",
                          fix="pass a list of microbatches for unequal sizes")
    return list(value.split(size // num))


def _check_types(loss_fn: Any, split_backward: Any, cap: Any, device: Any) -> None:
    """Refuse wrongly typed arguments here, not with a TypeError deep inside the first step."""
    if loss_fn is not None and not callable(loss_fn):
        raise ConfigError("loss_fn must be callable", expected="loss_fn(output, target)",
                          got=type(loss_fn).__name__)
    if not isinstance(split_backward, bool):
        raise ConfigError("split_backward", expected="True or False", got=repr(split_backward))
    parse_cap(cap)
    if not (isinstance(device, str) or hasattr(device, "run") or callable(device)):
        raise ConfigError("device", expected="'cpu', 'cuda', a Device or a factory(rank)",
                          got=type(device).__name__)


def _recompute_of(spec: Any, num_stages: int) -> list[bool]:
    """Activation checkpointing per stage: one bool for all, or one per stage (stage order)."""
    if isinstance(spec, bool):
        return [spec] * num_stages
    flags = list(spec) if isinstance(spec, (list, tuple)) else None
    if flags is None or len(flags) != num_stages or not all(isinstance(f, bool) for f in flags):
        raise ConfigError("recompute", expected=f"a bool or {num_stages} bools (one per stage)",
                          got=repr(spec))
    return flags


def _make_device(spec: Any, rank: int) -> Device:
    if spec == "cpu":
        from ..devices.cpu import CPUDevice
        return CPUDevice(f"aioready-rank{rank}")
    if spec == "inline":
        from ..devices.inline import InlineDevice
        return InlineDevice()
    if spec == "cuda":
        from ..devices.cuda import CUDADevice  # type: ignore[import-not-found]
        return CUDADevice(rank)  # type: ignore[no-any-return]
    if isinstance(spec, str):
        raise ConfigError("unknown device", expected="'cpu', 'inline', 'cuda', a Device or a factory",
                          got=repr(spec))
    if hasattr(spec, "run") and not isinstance(spec, type):
        return spec  # type: ignore[no-any-return]
    return spec(rank)  # type: ignore[no-any-return]  # a factory, or a Device class


class Pipeline:
    """A pipeline-parallel training step, readiness-first (`ready`) or in hint order (`strict`).

    `policy` (ready mode): "reserve" keeps the device for the hint's next task and backfills
    only what is predicted to end in time; "greedy" runs the best-ranked ready task at once;
    "light" is greedy, except that a clearly lighter microbatch's forward overtakes a heavy
    one's (multimodal batches); "drain" is greedy, except that once every microbatch is
    admitted a weight gradient waits for the gradients announced to arrive first; "auto"
    starts with reserve and after the first step keeps whichever runs the measured durations
    faster in simulation (docs/policy.md). `hint="auto"` (or AutoHint) chooses hint, mode,
    policy and cap by simulating the measured durations (docs/hints.md).

    Under MPI with `grid=` (a ProcessGrid or its GridComms) the stages are this rank's on its
    pipeline line, and gradients are averaged over data-parallel replicas during the step
    (`grad_reducer=` replaces the MPI reducer). `normalize="weight"`: loss_fn returns (loss,
    weight); `tied={name: {stage: parameter name}}`; `scaler=dp.cross_stage.GradScaler()`;
    `autocast=dtype` (docs/architecture.md "Data parallelism"). `memory="24GiB"` or `"2x"`:
    admit by activation bytes, measured per microbatch, instead of `cap=`'s count
    (docs/policy.md "Memory budgets"; with hint="auto" or policy="auto" it chooses within
    them); `measure_memory=True` measures them without a budget.
    `dashboard=PORT` serves a live page of the pipeline on 127.0.0.1 (0: any free port;
    `pipe.dashboard.url`, docs/telemetry.md); needs aiohttp. `microbatch_order="ascending"`
    or `"descending"`: run each step's microbatches in the order of a cost known before the
    step (`step(costs=)`, default the inputs' bytes; docs/policy.md "The microbatch order");
    None (the default): "given", or with hint="auto" (no memory=) whichever simulates fastest.
    """

    def __init__(
        self, stages: Sequence[Any], loss_fn: Callable[[Any, Any], Any] | None = None, *,
        microbatches: int = 8, hint: str | HintOrder | AutoHint = "1f1b", mode: str = "ready",
        transport: Transport | None = None, split_backward: bool = False,
        cap: CapSpec = None, device: Any = "cpu",
        num_stages: int | None = None, coordinator: Any = None,
        stall_timeout: float | None = DEFAULT, peer_timeout: float | None = DEFAULT,
        policy: str = "reserve",
        recompute: bool | Sequence[bool] = False,
        grid: Any = None, grad_reducer: Any = None, normalize: str = "microbatches",
        tied: Any = None, scaler: Any = None, autocast: Any = None,
        memory: MemorySpec = None, measure_memory: bool = False,
        dashboard: int | None = None, microbatch_order: str | None = None,
    ) -> None:
        if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
            raise ConfigError("microbatches must be a positive integer", expected=">= 1",
                              got=repr(microbatches))
        if mode not in MODES:
            raise ConfigError("mode", expected=" | ".join(MODES), got=repr(mode))
        if not stages:
            raise ConfigError("stages is empty", expected="at least one module", got=0)
        _check_types(loss_fn, split_backward, cap, device)
        parse_memory(memory)
        check_one_gate(cap, memory)
        if normalize not in ("microbatches", "weight"):
            raise ConfigError("normalize", expected="'microbatches' or 'weight' (loss_fn "
                              "returns (loss, weight))", got=repr(normalize))
        self._stage_options = {"normalize": normalize, "autocast": autocast,
                               "measure": memory is not None or bool(measure_memory)}
        self.grid = None  # a process grid's communicators (aioready/dp/setup.py)
        if grid is not None:
            from ..dp.setup import setup_grid
            self.grid = setup_grid(grid, transport=transport, coordinator=coordinator, mode=mode)
            transport, coordinator = self.grid.transport, self.grid.coordinator
        if coordinator is not None and transport is None:
            raise ConfigError("a TP coordinator needs a transport (one rank per process)",
                              expected="transport=... with coordinator=...", got="no transport")
        self.microbatches = microbatches
        self.microbatch_order = check_order(microbatch_order or "given")
        self._slots: tuple[int, ...] | None = None  # the last step's slot -> caller's index
        self.mode = mode
        self.transport = transport
        num_local = len(stages)
        if transport is None:
            total = num_local if num_stages is None else num_stages
        else:
            total = num_stages or transport.world_size * num_local
        self.auto: AutoTuning | None = None  # hint="auto": the chooser and its choices
        if parse_auto(hint) is not None:
            self.auto, hint = AutoTuning.for_pipeline(
                hint, budget=cap, num_stages=total, split_backward=split_backward,
                world_size=None if transport is None else transport.world_size,
                coordinator=coordinator, choose_order=microbatch_order is None, memory=memory)
        if policy == "auto" and mode == "ready" and self.auto is None:
            self.auto = AutoTuning.for_policy(hint, budget=cap, coordinator=coordinator,
                                              memory=memory)
        if policy == "auto":  # it starts from the rule that never loses to strict
            policy = "reserve"
        try:
            self.hint = make_hint(hint, num_stages=total, num_microbatches=microbatches,
                                  split_backward=split_backward,
                                  num_ranks=None if transport is None else transport.world_size)
        except ConfigError as exc:
            if transport is None:
                raise
            raise ConfigError(
                f"the stage list does not match the transport's world of "
                f"{transport.world_size} ranks: {exc.what}", rank=transport.rank,
                expected=exc.expected, got=exc.got, fix=exc.fix) from None
        if self.hint.num_microbatches != microbatches or self.hint.split_backward != split_backward:
            raise ConfigError(f"hint {self.hint.name!r} was built for another step shape",
                              expected=f"microbatches={microbatches}, split_backward="
                              f"{split_backward}", got=f"microbatches={self.hint.num_microbatches}"
                              f", split_backward={self.hint.split_backward}")
        placement = self.hint.placement
        if transport is None:
            if num_local != placement.num_stages:
                raise ConfigError("in-process pipelines take every stage",
                                  expected=placement.num_stages, got=num_local)
            world = InprocWorld(placement.num_ranks)
            ranks = list(range(placement.num_ranks))
            endpoints: list[Transport] = list(world.endpoints)
            modules = {s: stages[s] for s in range(num_local)}
        else:
            if transport.world_size != placement.num_ranks:
                raise ConfigError("the stage list does not match the transport's world",
                                  expected=f"a hint for {transport.world_size} ranks",
                                  got=f"{placement.num_ranks} ranks")
            mine = placement.stages_of(transport.rank)
            if len(mine) != num_local:
                raise ConfigError("the stage list does not match this rank's chunks",
                                  rank=transport.rank, expected=f"{len(mine)} modules "
                                  f"(stages {list(mine)})", got=f"{num_local} modules")
            ranks, endpoints = [transport.rank], [transport]
            modules = dict(zip(mine, stages))
        self.recompute = _recompute_of(recompute, placement.num_stages)
        caps = resolve_caps(cap, self.hint)
        self.memory = budgets = resolve_memory(memory, placement.num_ranks)
        if budgets is not None:  # bytes gate instead of the count (ready_set Note [byte gate])
            caps = [microbatches] * placement.num_ranks
        self.runtimes: list[RankRuntime] = []
        for rank, endpoint in zip(ranks, endpoints):
            executors = self._executors(modules, placement.stages_of(rank), loss_fn)
            self.runtimes.append(RankRuntime(
                rank=rank, hint=self.hint, mode=mode, cap=caps[rank], executors=executors,
                device=_make_device(device, rank), transport=endpoint, coordinator=coordinator,
                policy=policy, caps=caps, memory=None if budgets is None else budgets[rank]))
        self.grad_reducer = self._reducer(grad_reducer)
        self.cross_stage = None  # the end-of-step reductions (aioready/dp/cross_stage.py)
        if any(rt.executors is not None for rt in self.runtimes):
            from ..dp.cross_stage import CrossStage
            self.cross_stage = CrossStage(self, tied=tied, scaler=scaler, normalize=normalize)
        self._step = 0
        self.last_step: StepReport | None = None
        self.history: list[list[StepReport]] = []
        self._guard = StepGuard()
        self._stall_arg = stall_timeout
        self.stall_timeout = resolve_timeout("stall_timeout", stall_timeout,
                                             "AIOREADY_STALL_TIMEOUT", STALL_TIMEOUT_S)
        self.stall_watchdog = (None if self.stall_timeout is None else
                               StallWatchdog(self.runtimes, self._guard, self.stall_timeout))
        self.dashboard = None  # a live page of this pipeline (telemetry/dashboard.py)
        if dashboard is not None:
            from ..telemetry.dashboard import Dashboard
            self.dashboard = Dashboard(self, port=dashboard)
        self.peer_monitor = None
        if transport is not None and transport.world_size > 1:
            from .faults import PEER_TIMEOUT_S, PeerMonitor
            self.peer_timeout = resolve_timeout("peer_timeout", peer_timeout,
                                                "AIOREADY_PEER_TIMEOUT", PEER_TIMEOUT_S)
            self.peer_monitor = PeerMonitor(self.runtimes[0], self._guard, self.peer_timeout)
        else:
            self.peer_timeout = resolve_timeout("peer_timeout", peer_timeout,
                                                "AIOREADY_PEER_TIMEOUT", None)

    def _executors(self, modules: dict[int, Any], stages: Sequence[int],
                   loss_fn: Any) -> list[Any] | None:
        if all(modules[s] is None for s in stages):
            return None
        last = self.hint.placement.num_stages - 1
        if loss_fn is None and last in stages and modules[last] is not None:
            raise ConfigError("the last stage needs a loss function", expected="loss_fn(output, "
                              "target)", got=None, fix="pass loss_fn to Pipeline")
        from .stage import StageExecutor
        return [StageExecutor(modules[s], stage=s, num_stages=self.hint.placement.num_stages,
                              loss_fn=loss_fn, num_microbatches=self.microbatches,
                              recompute=self.recompute[s], **self._stage_options)
                for s in stages]

    def _reducer(self, reducer: Any) -> Any:
        """The data-parallel reducer (given, or made from the grid), wired to the runtime."""
        rt = self.runtimes[0]
        if reducer is None and self.grid is not None and self.grid.comms.grid.dp_size > 1:
            if rt.executors is None:
                return None
            from ..dp.setup import grid_reducer
            reducer = grid_reducer(self.grid.comms,
                                   [list(ex.module.parameters()) for ex in rt.executors])
        if reducer is not None:
            if len(self.runtimes) != 1:
                raise ConfigError("data parallelism runs one rank per process",
                                  expected="transport= or grid=", got="an in-process pipeline")
            rt.grads_ready = reducer.reduce_nowait
        return reducer

    @property
    def microbatch_slots(self) -> tuple[int, ...] | None:
        """The running (else last) step's slot -> the caller's microbatch; None: as given."""
        return self._slots

    @property
    def takes_costs(self) -> bool:
        """Whether `step(costs=...)` orders this pipeline's microbatches: a cost order, or
        hint="auto" choosing the order. Under the given order costs are refused, so a loop that
        knows its microbatches' sizes passes them where this is true."""
        return self.microbatch_order != "given" or (self.auto is not None and
                                                    self.auto.orders is not None)

    @property
    def step_index(self) -> int:
        """The index of the next step to run."""
        return self._step

    def set_step_index(self, step: int) -> None:
        """Continue counting from `step` (after loading a checkpoint)."""
        self._step = step
        for rt in self.runtimes:
            rt.step_index = step - 1

    def state_dict(self, optimizers: Any = None) -> dict[int, dict[str, Any]]:
        """{rank: modules, optimizers, step, RNG} for this process's ranks (checkpoint.py).

        Like torch's `state_dict`, it references the live tensors: copy it to keep a snapshot.
        """
        from .checkpoint import state_dict
        return state_dict(self, optimizers)

    def load_state_dict(self, state: Any, optimizers: Any = None, *,
                        check_config: bool = True) -> int:
        """Validate, then restore a `state_dict()`; return the index of the next step."""
        from .checkpoint import load_state_dict
        return load_state_dict(self, state, optimizers, check_config=check_config)

    async def step(self, inputs: Any = None, targets: Any = None,
                   costs: Sequence[float] | None = None) -> Any:
        """Run one step; return the summed loss where the last stage lives, else None.

        `inputs` and `targets` are split along dim 0 into equal microbatches, or given as a list
        of microbatches (variable shapes allowed). Ranks without stage 0 (the last stage) pass
        None for inputs (targets). `costs`: one per microbatch, what orders them under
        `microbatch_order` (runtime/mb_order.py; default: the inputs' bytes).
        """
        M = self.microbatches
        mbs = split_microbatches(inputs, M, name="inputs")
        tgts = split_microbatches(targets, M, name="targets")
        slots = (step_order if self.auto is None else self.auto.step_order)(
            self.microbatch_order, M, mbs, costs,
            one_process=self.transport is None or self.transport.world_size == 1,
            stages=self.hint.placement.num_stages, split_backward=self.hint.split_backward)
        if slots is not None:
            mbs = None if mbs is None else [mbs[m] for m in slots]
            tgts = None if tgts is None else [tgts[m] for m in slots]
        self._slots = slots
        step = self._step
        if self.stall_watchdog is not None and self._stall_arg is DEFAULT:
            # simulated time: the default is off
            self.stall_watchdog.enabled = virtual_clock(asyncio.get_running_loop()) is None
        try:
            loss = await self._guard.run(self._run(step, mbs, tgts), step)
        except Exception:
            if self.peer_monitor is not None:
                await self.peer_monitor.flush()
            raise
        self._step += 1
        reports = [rt.reports[-1] for rt in self.runtimes]
        self.history.append(reports)
        self.last_step = merge_reports(reports)
        if self.auto is not None:
            await self.auto.after_step(self)
        return loss

    async def watch(self, awaitable: Awaitable[T], *, what: str) -> T:
        """Await a wait outside `step` that involves the peers (a barrier, a gather, a close)
        under the peer timeout: a peer that stops answering meanwhile ends it with
        PeerLostError naming the peer and `what`, instead of waiting forever
        (docs/security.md "Faults and what ends a job"). Without peers, just awaits."""
        if self.peer_monitor is None:
            return await awaitable
        for rt in self.runtimes:
            rt.open()
        return await self.peer_monitor.watch(awaitable, what)

    async def _run(self, step: int, mbs: Any, tgts: Any) -> Any:
        if self.cross_stage is None:
            return await run_ranks(self.runtimes, step, mbs, tgts)
        self.cross_stage.before_step()
        loss = await run_ranks(self.runtimes, step, mbs, tgts)
        return await self.cross_stage.after_step(loss)  # DP means started during the step

    async def clip_grad_norm_(self, max_norm: float) -> Any:
        """Clip the gradients by their norm over every stage, TP shard and DP replica (torch's
        rule, `clip_coef = max_norm / (norm + 1e-6)`); return that norm. Collective: every rank
        calls it after the same step."""
        if self.cross_stage is None:
            raise RuntimeError("clip_grad_norm_ needs stage modules (this pipeline has none)")
        return await self.cross_stage.clip_grad_norm_(max_norm)

    @property
    def last_losses(self) -> list[tuple[float, float]] | None:
        """The last step's (loss, weight) per microbatch of this replica, where the last stage
        lives (weight 1 unless loss_fn returns (loss, weight)); None elsewhere."""
        for rt in self.runtimes:
            for ex in rt.executors or ():
                if ex.is_last:
                    out = [(float(loss), float(w)) for _, (loss, w) in sorted(ex.losses.items())]
                    if self._slots is not None:  # back to the caller's order
                        mine = dict(zip(self._slots, out))
                        out = [mine[m] for m in range(len(out))]
                    return out
        return None

    def close(self) -> None:
        if self.dashboard is not None:
            self.dashboard.close()
        if self.peer_monitor is not None:
            self.peer_monitor.close()
        for rt in self.runtimes:
            rt.device.close()
        for part in (self.cross_stage, self.grad_reducer):  # their collectives' pollers
            if part is not None and hasattr(part, "close"):
                part.close()

    def __repr__(self) -> str:
        return (f"<Pipeline hint={self.hint.name} mode={self.mode} M={self.microbatches} "
                f"ranks={[rt.rank for rt in self.runtimes]}>")

