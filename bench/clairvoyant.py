"""An offline, clairvoyant list scheduler for large steps (S=128, M=512: 196k tasks).

CP-SAT (bench/optimum.py) proves the optimum only for a few dozen tasks. This scheduler knows
every duration in advance and builds a valid schedule of one step fast enough for S=128, under
the very same rules as bench/optimum.py's `Instance` (the runtime's task graph and its in-flight
count): F(s,m) after F(s-1,m) plus the activation's delay, B(s,m) after F(s,m) and B(s+1,m) plus
the gradient's delay, W(s,m) after B(s,m); one task at a time per rank, none preempted; a
microbatch is held on a rank from the start of its entry F to the end of its last backward piece
there, at most `cap` at once (a release at t before an admit at t). Every schedule it returns
is replayed by bench/optimum.py's `check`, which was written without this scheduler.

How it decides (docs/policy.md "A clairvoyant schedule at S=128"): time advances over every
rank's decisions in time order; a rank that is free picks, among its tasks whose inputs are
placed (so their arrival times are known, unlike online), the first class of `Rule.order`
(B: backward, F: a forward that admits nothing, A: an entry forward that admits a microbatch,
W: weight gradient) that has a task ready now and memory to run it, the smallest priority
first within a class. Clairvoyance enters as a reservation: a task of a later class starts only
if it ends no later than `reserve` units after the earliest known arrival of a task of an
earlier class; otherwise the rank idles for that task. `guard` keeps memory headroom: with
`held >= cap - guard` a ready W runs before an entry forward. `improve` searches these knobs
per rank (coordinate descent on the makespan, each trial a full schedule).

Run: python -m bench.clairvoyant [--stages 128] [--jitters lognormal:0.5] [--budgets per-rank,256]
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from aioready.placement import Placement
from aioready.tasks import Kind
from aioready.telemetry.bounds import lower_bound_table

from .optimum import Instance, TaskKey

__all__ = ["Rule", "Schedule", "list_schedule", "improve", "as_schedule", "memory_bound"]

CLASSES = "BFAW"
"""B backward, F non-entry forward, A entry forward (admits), W weight gradient."""

INF = math.inf


@dataclass(frozen=True)
class Rule:
    """One rank's decision rule (see the module's note)."""

    order: str = "BFAW"
    """class preference, a permutation of B, F, A, W"""
    reserve: float = INF
    """units a later-class task may overrun the next earlier-class arrival (inf: greedy)"""
    guard: int = 0
    """run W before an entry forward when held >= cap - guard"""
    window: float = INF
    """a forward whose activation goes to another rank waits while that many of this stage's
    forwards have started and the next stage's have not (a kanban against running ahead)"""
    strict_window: bool = False
    """hold the window even when the rank would idle (else a blocked forward runs when
    nothing else can)"""


@dataclass(frozen=True)
class Schedule:
    """Start times in units per task id (`tid = (stage * M + mb) * K + kind`), and makespan."""

    start: np.ndarray
    end: np.ndarray
    makespan: int
    kinds: int
    microbatches: int


def list_schedule(inst: Instance, rules: Sequence[Rule] | Rule = Rule(),
                  prio: np.ndarray | None = None) -> Schedule:
    """One schedule by clairvoyant list scheduling; `rules` one per rank (or one for all),
    `prio` a priority per task id (default: the microbatch index, so FIFO within a class)."""
    pl = inst.placement
    S, M, R = pl.num_stages, inst.num_microbatches, pl.num_ranks
    K = 3 if inst.split_backward else 2
    n = S * M * K
    rules = [rules] * R if isinstance(rules, Rule) else list(rules)
    dur = inst.durations[:, :, :K].reshape(-1).tolist()
    comm = inst.comm.tolist()
    key = (np.repeat(np.arange(M), K)[None].repeat(S, 0).reshape(-1) if prio is None
           else np.asarray(prio)).tolist()
    rank_of = [pl.rank_of(s) for s in range(S)]
    entry = [pl.stage_of(r, 0) for r in range(R)]
    pieces0 = [len(pl.stages_of(r)) for r in range(R)]
    last_kind = K - 1
    # class of each task: 0..3 index into CLASSES
    cls_of = []
    for s in range(S):
        is_entry = entry[rank_of[s]] == s
        for _m in range(M):
            cls_of += [2 if is_entry else 1, 0, 3][:K]
    npred = [0] * n
    for s in range(S):
        for m in range(M):
            base = (s * M + m) * K
            npred[base] = 1 if s > 0 else 0
            npred[base + 1] = 2 if s < S - 1 else 1
            if K == 3:
                npred[base + 2] = 1
    ready_at = [0] * n
    start = [-1] * n
    pos = [[r.order.index(c) for c in CLASSES] for r in rules]  # class -> rank of preference
    caps = list(inst.caps)
    rdy = [[[] for _ in range(4)] for _ in range(R)]  # heaps of (prio, tid) ready now
    fut = [[[] for _ in range(4)] for _ in range(R)]  # heaps of (ready_at, prio, tid)
    rel: list[list[int]] = [[] for _ in range(R)]  # known future releases
    held = [0] * R
    left = [[p] * M for p in pieces0]
    last_end = [[0] * M for _ in range(R)]
    free = [0] * R
    nextdec = [INF] * R
    ahead = [0] * S  # forwards started at stage s and not yet at s + 1
    events: list[tuple[float, int]] = []

    def wake(r: int, at: float) -> None:
        at = max(at, free[r])
        if at < nextdec[r]:
            nextdec[r] = at
            heapq.heappush(events, (at, r))

    def release_task(t: int, r: int) -> None:
        heapq.heappush(fut[r][cls_of[t]], (ready_at[t], key[t], t))
        wake(r, ready_at[t])

    for s in range(S):  # stage 0's forwards have no inputs
        if s == 0:
            for m in range(M):
                release_task((s * M + m) * K, rank_of[s])
    done = 0
    while events:
        now, r = heapq.heappop(events)
        if now != nextdec[r]:
            continue
        nextdec[r] = INF
        rule = rules[r]
        order = pos[r]
        for c in range(4):
            f = fut[r][c]
            while f and f[0][0] <= now:
                _, p, t = heapq.heappop(f)
                heapq.heappush(rdy[r][c], (p, t))
        rh = rel[r]
        while rh and rh[0] <= now:
            heapq.heappop(rh)
            held[r] -= 1
        room = held[r] < caps[r]
        usable = [False] * 4
        blocked = [False] * 4  # a forward held back by the window
        for c in range(4):
            h = rdy[r][c]
            if h and (c != 2 or room):
                usable[c] = True
                if 0 < c < 3 and rule.window < INF:
                    sf = h[0][1] // (M * K)
                    blocked[c] = sf < S - 1 and rank_of[sf + 1] != r and \
                        ahead[sf] >= rule.window
        best_c, best_pos = -1, 99
        for c in range(4):
            if usable[c] and not blocked[c] and order[c] < best_pos:
                best_c, best_pos = c, order[c]
        if best_c < 0 and not rule.strict_window:
            for c in range(4):
                if usable[c] and order[c] < best_pos:
                    best_c, best_pos = c, order[c]
        guarded = best_c == 2 and rdy[r][3] and held[r] >= caps[r] - rule.guard
        if guarded:
            best_c, best_pos = 3, order[3]
        soonest = INF  # earliest known arrival of a better class
        for c in range(4):
            if order[c] < best_pos and not guarded and not blocked[c]:
                at = fut[r][c][0][0] if fut[r][c] else INF
                if c == 2:
                    if rdy[r][2]:
                        at = now
                    if held[r] >= caps[r]:
                        at = max(at, rh[0]) if rh else INF
                soonest = min(soonest, at)
        if best_c < 0:
            if soonest < INF:
                wake(r, soonest)
            continue
        p, t = rdy[r][best_c][0]
        if soonest < INF and now + dur[t] > soonest + rule.reserve:
            wake(r, soonest)
            continue
        heapq.heappop(rdy[r][best_c])
        start[t] = now
        end = now + dur[t]
        free[r] = end
        done += 1
        if best_c == 2:
            held[r] += 1
        st, rest = divmod(t, M * K)
        m, k = divmod(rest, K)
        if k == 0:  # F -> F(s+1), B(s)
            if st > 0:
                ahead[st - 1] -= 1
                wake(rank_of[st - 1], now)
            if st < S - 1:
                ahead[st] += 1
                u = t + M * K
                ready_at[u] = max(ready_at[u], end + comm[st + 1][m][0])
                npred[u] -= 1
                if npred[u] == 0:
                    release_task(u, rank_of[st + 1])
            u = t + 1
        else:  # B -> B(s-1), W(s); W releases
            if k == 1 and st > 0:
                u = t - M * K
                ready_at[u] = max(ready_at[u], end + comm[st - 1][m][1])
                npred[u] -= 1
                if npred[u] == 0:
                    release_task(u, rank_of[st - 1])
            u = t + 1 if k == 1 and K == 3 else -1
            if k == last_kind:
                left[r][m] -= 1
                last_end[r][m] = max(last_end[r][m], end)
                if left[r][m] == 0:
                    heapq.heappush(rel[r], last_end[r][m])
        if u >= 0:
            ready_at[u] = max(ready_at[u], end)
            npred[u] -= 1
            if npred[u] == 0:
                release_task(u, rank_of[st])
        wake(r, end)
    if done != n:
        raise RuntimeError(f"clairvoyant list schedule is stuck: {done} of {n} tasks placed "
                           "(a cap below 1, or a reservation waiting on a task never placed)")
    s_arr = np.asarray(start, dtype=np.int64)
    e_arr = s_arr + np.asarray(dur, dtype=np.int64)
    return Schedule(s_arr, e_arr, int(e_arr.max()), K, M)


def as_schedule(sch: Schedule) -> dict[TaskKey, tuple[int, int]]:
    """The schedule as bench/optimum.py's task -> (start, end), for `check`."""
    K, M = sch.kinds, sch.microbatches
    out = {}
    for t, (a, b) in enumerate(zip(sch.start.tolist(), sch.end.tolist())):
        s, rest = divmod(t, M * K)
        m, k = divmod(rest, K)
        out[(k, s, m)] = (a, b)
    return out


def improve(inst: Instance, rules: Sequence[Rule], *, candidates: Sequence[dict],
            groups: int = 8, rounds: int = 1, log: list[str] | None = None
            ) -> tuple[list[Rule], Schedule]:
    """Coordinate descent over the ranks' rules: ranks in `groups` contiguous blocks; for each
    block and each candidate change (a dict of Rule fields), keep it if the makespan drops."""
    rules = list(rules)
    best = list_schedule(inst, rules)
    R = len(rules)
    bounds = np.linspace(0, R, groups + 1).round().astype(int)
    for _ in range(rounds):
        for g in range(groups):
            lo, hi = int(bounds[g]), int(bounds[g + 1])
            for change in candidates:
                trial = rules[:lo] + [replace(x, **change) for x in rules[lo:hi]] + rules[hi:]
                sch = list_schedule(inst, trial)
                if sch.makespan < best.makespan:
                    rules, best = trial, sch
                    if log is not None:
                        log.append(f"ranks {lo}-{hi - 1} {change}: {sch.makespan}")
    return rules, best


def first_idle(sch: Schedule, inst: Instance) -> np.ndarray:
    """Per rank: time idle between its first start and the makespan (units)."""
    K, M = sch.kinds, sch.microbatches
    S = inst.placement.num_stages
    st = sch.start.reshape(S, M, K)
    busy = inst.durations[:, :, :K].sum(axis=(1, 2))
    out = np.zeros(inst.placement.num_ranks)
    for r in range(inst.placement.num_ranks):
        stages = list(inst.placement.stages_of(r))
        out[r] = sch.makespan - st[stages].min() - busy[stages].sum()
    return out


def memory_bound(placement: Placement, table: np.ndarray, split_backward: bool,
                 caps: Sequence[int]) -> float:
    """A lower bound on any schedule that respects `caps` (docs/policy.md "A memory-aware lower
    bound"); at least telemetry.bounds.lower_bound_table. Communication is ignored (a delay only
    lengthens a schedule), so it holds with it too.

    On rank r, once its last backward B ends (at b), only weight gradients are left, and each
    belongs to a microbatch the rank still holds: at most caps[r] microbatches, so at most the
    caps[r] largest per-microbatch W sums. The rank started no earlier than its head, and runs
    one task at a time, so b >= head + busy - those W. Before its first B starts only forwards
    ran, of at most caps[r] admitted microbatches (nothing is released before a backward), so
    also b >= reach + busy - the largest F sums - the largest W sums, where reach is the least
    time a gradient can reach r. After b the gradient of that microbatch still has to travel
    down to stage 0 (and run stage 0's W there): the tail.
    """
    F, B = table[:, :, Kind.F], table[:, :, Kind.B]
    W = table[:, :, Kind.W] if split_backward else np.zeros_like(F)
    before_f = np.vstack([np.zeros((1, F.shape[1])), np.cumsum(F, axis=0)])  # F of < s
    before_b = np.vstack([np.zeros((1, B.shape[1])), np.cumsum(B, axis=0)])  # B of < s
    after_b = B.sum(axis=0) - before_b[1:]  # B of stages > s, per (s, m)
    best = lower_bound_table(placement, table, split_backward)
    for rank in range(placement.num_ranks):
        stages = list(placement.stages_of(rank))
        cap = int(caps[rank])
        busy = float(table[stages][:, :, :3 if split_backward else 2].sum())
        head = float(before_f[stages].min())
        reach = float((F.sum(axis=0) + after_b[stages]).min())
        tails = [before_b[s] + W[0] if s > 0 else np.zeros(F.shape[1]) for s in stages]
        tail = float(np.min(tails))
        top_w = float(np.sort(W[stages].sum(axis=0))[::-1][:cap].sum())
        top_f = float(np.sort(F[stages].sum(axis=0))[::-1][:cap].sum())
        best = max(best, max(head + busy - top_w, reach + busy - top_f - top_w) + tail)
    return best
