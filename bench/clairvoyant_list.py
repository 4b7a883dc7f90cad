"""An offline, clairvoyant list scheduler for large steps (S=128, M=512: 196k tasks).

CP-SAT (bench/optimum.py) proves the optimum only for a few dozen tasks. This scheduler knows
every duration in advance and builds a valid schedule of one step fast enough for S=128, under
the very same rules as bench/optimum.py's `Instance` (the runtime's task graph and its in-flight
count): F(s,m) after F(s-1,m) plus the activation's delay, B(s,m) after F(s,m) and B(s+1,m) plus
the gradient's delay, W(s,m) after B(s,m); one task at a time per rank, none preempted; a
microbatch is held on a rank from the start of its entry F to the end of its last backward piece
there, at most `cap` at once (a release at t before an admit at t). Every schedule it returns
is replayed by bench/optimum.py's `check`, which was written without this scheduler.

How it decides (docs/policy_measurements.md "The true limit at S=128"): time advances over every
rank's decisions in time order; a rank that is free picks, among its tasks whose inputs are placed
(so their arrival times are known, unlike online), the first class of `Rule.order` (B: backward,
F: a forward that admits nothing, A: an entry forward that admits a microbatch, W: weight
gradient) that has a task ready now and memory to run it, the least priority first within a
class (the microbatch index, or `overtaking`'s). Clairvoyance enters as a reservation: a task of
a later class starts only if it ends no later than `reserve` units after the earliest known
arrival of a task of an earlier class (of `protect`; with `predict`, also the arrivals an earlier
schedule had); a W under a reservation is the longest that fits; otherwise the rank idles for
that task. `improve` searches the rules per block of ranks (coordinate descent on the makespan,
each trial a full schedule: about a second at S=128).

Run at S=128: python -m bench.clairvoyant
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from .optimum import Instance, TaskKey

__all__ = ["Rule", "Schedule", "list_schedule", "improve", "as_schedule", "ready_times",
           "overtaking", "in_order"]

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
    protect: str = "BFA"
    """the classes whose arrival a reservation protects"""
    drain_only: bool = False
    """reserve only once the rank has started all its forwards"""
    drain_keep: float = 0.0
    """after its last forward, a rank keeps this many times its tail (the least time from
    its backward to the end of stage 0's W) in ready W, running none below it until its last
    backward: the rank stays free for the gradients passing through, and the W fill the tail"""
    fit: bool = True
    """under a reservation, run the longest W that fits before the arrival"""
    w_pick: str = "short"
    """which W otherwise: "short" or "long" """


@dataclass(frozen=True)
class Schedule:
    """Start times in units per task id (`tid = (stage * M + mb) * K + kind`), and makespan."""

    start: np.ndarray
    end: np.ndarray
    makespan: int
    kinds: int
    microbatches: int


def list_schedule(inst: Instance, rules: Sequence[Rule] | Rule = Rule(),
                  prio: np.ndarray | None = None, predict: np.ndarray | None = None
                  ) -> Schedule:
    """One schedule by clairvoyant list scheduling; `rules` one per rank (or one for all),
    `prio` a priority per task id (default: the microbatch index, so FIFO within a class).
    `predict` (per task id, say `ready_times` of an earlier schedule): a reservation also
    protects the predicted arrival of a task whose inputs are not placed yet."""
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
    prot = [[c in r.protect for c in CLASSES] for r in rules]
    caps = list(inst.caps)
    rdy = [[[] for _ in range(4)] for _ in range(R)]  # heaps of (prio, tid) ready now
    fut = [[[] for _ in range(4)] for _ in range(R)]  # heaps of (ready_at, prio, tid)
    rel: list[list[int]] = [[] for _ in range(R)]  # known future releases
    held = [0] * R
    left = [[p] * M for p in pieces0]
    last_end = [[0] * M for _ in range(R)]
    free = [0] * R
    nextdec = [INF] * R
    events: list[tuple[float, int]] = []

    fwd_left = [M * p for p in pieces0]
    b_left = [M * p for p in pieces0]
    wsum = [0] * R  # ready W work per rank
    tails = inst.durations[:, :, 1].cumsum(axis=0) - inst.durations[:, :, 1]  # B of stages < s
    keep_w = [rules[q].drain_keep * float(min(
        (tails[s] + inst.durations[0, :, K - 1] * (K == 3)).min() if s > 0 else 0.0
        for s in pl.stages_of(q))) for q in range(R)]
    def wake(r: int, at: float) -> None:
        at = max(at, free[r])
        if at < nextdec[r]:
            nextdec[r] = at
            heapq.heappush(events, (at, r))

    known = [False] * n
    pred_h: list[list[list[tuple[int, int]]]] = [[[] for _ in range(4)] for _ in range(R)]
    if predict is not None:
        for t, at in enumerate(np.asarray(predict).tolist()):
            pred_h[rank_of[t // (M * K)]][cls_of[t]].append((at, t))
        for heaps in pred_h:
            for h in heaps:
                heapq.heapify(h)

    def release_task(t: int, r: int) -> None:
        known[t] = True
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
                if c == 3:  # weight gradients: sorted by duration, to fit gaps
                    bisect.insort(rdy[r][3], (dur[t], t))
                    wsum[r] += dur[t]
                else:
                    heapq.heappush(rdy[r][c], (p, t))
        rh = rel[r]
        while rh and rh[0] <= now:
            heapq.heappop(rh)
            held[r] -= 1
        room = held[r] < caps[r]
        keep = fwd_left[r] == 0 and b_left[r] > 0 and wsum[r] <= keep_w[r]
        best_c, best_pos = -1, 99
        for c in range(4):
            if rdy[r][c] and (c != 2 or room) and order[c] < best_pos and not (c == 3 and keep):
                best_c, best_pos = c, order[c]
        guarded = best_c == 2 and rdy[r][3] and held[r] >= caps[r] - rule.guard
        if guarded:
            best_c, best_pos = 3, order[3]
        if best_c < 0:  # idle until the next arrival or release
            at = min((f[0][0] for f in fut[r] if f), default=INF)
            if (rdy[r][2] or fut[r][2]) and rh:
                at = min(at, rh[0])
            if at < INF:
                wake(r, at)
            continue
        soonest = INF  # earliest known arrival of a better class
        if not guarded and (not rule.drain_only or fwd_left[r] == 0):
            for c in range(4):
                if not prot[r][c] or order[c] >= best_pos:
                    continue
                at = fut[r][c][0][0] if fut[r][c] else INF
                ph = pred_h[r][c]
                while ph and (known[ph[0][1]] or ph[0][0] <= now):
                    heapq.heappop(ph)
                if ph and ph[0][0] < at:
                    at = ph[0][0]
                if c == 2 and held[r] >= caps[r]:  # an entry forward waits for memory
                    if rdy[r][2]:
                        at = now
                    at = max(at, rh[0]) if rh else INF
                soonest = min(soonest, at)
        if soonest <= now:  # nothing to wait for (a wait must end later than now)
            soonest = INF
        if best_c == 3:
            wl = rdy[r][3]
            if soonest < INF and rule.fit:  # the longest W that fits
                i = bisect.bisect_right(wl, (soonest + rule.reserve - now, n)) - 1
            else:
                i = 0 if rule.w_pick == "short" else len(wl) - 1
            t = wl[max(i, 0)][1]
            if soonest < INF and now + dur[t] > soonest + rule.reserve:
                wake(r, soonest)
                continue
            del wl[max(i, 0)]
            wsum[r] -= dur[t]
        else:
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
        if best_c in (1, 2):
            fwd_left[r] -= 1
        elif best_c == 0:
            b_left[r] -= 1
        st, rest = divmod(t, M * K)
        m, k = divmod(rest, K)
        if k == 0:  # F -> F(s+1), B(s)
            if st < S - 1:
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


def ready_times(inst: Instance, sch: Schedule) -> np.ndarray:
    """When each task of `sch` had its inputs (its predecessors' ends plus delays)."""
    S, M, K = inst.placement.num_stages, sch.microbatches, sch.kinds
    end = sch.end.reshape(S, M, K)
    out = np.zeros((S, M, K), dtype=np.int64)
    out[1:, :, 0] = end[:-1, :, 0] + inst.comm[1:, :, 0]
    out[:, :, 1] = end[:, :, 0]
    out[:-1, :, 1] = np.maximum(out[:-1, :, 1], end[1:, :, 1] + inst.comm[:-1, :, 1])
    if K == 3:
        out[:, :, 2] = end[:, :, 1]
    return out.reshape(-1)


def as_schedule(sch: Schedule) -> dict[TaskKey, tuple[int, int]]:
    """The schedule as bench/optimum.py's task -> (start, end), for `check`."""
    K, M = sch.kinds, sch.microbatches
    out = {}
    for t, (a, b) in enumerate(zip(sch.start.tolist(), sch.end.tolist())):
        s, rest = divmod(t, M * K)
        m, k = divmod(rest, K)
        out[(k, s, m)] = (a, b)
    return out


def overtaking(inst: Instance, weight: float) -> np.ndarray:
    """Priorities for `list_schedule`: the microbatch index, plus for forwards `weight` times
    the forward's duration over the mean forward, so a short forward overtakes up to about
    `weight` microbatches that are ready with it (0: forwards in microbatch order)."""
    S, M = inst.placement.num_stages, inst.num_microbatches
    K = 3 if inst.split_backward else 2
    key = np.broadcast_to(np.arange(M, dtype=np.float64)[None, :, None], (S, M, K)).copy()
    F = inst.durations[:, :, 0].astype(np.float64)
    key[:, :, 0] += weight * F / max(F.mean(), 1e-12)
    return key.reshape(-1)


def in_order(sch: Schedule, stages: int) -> bool:
    """Whether every stage ran its forwards in microbatch order."""
    first = sch.start.reshape(stages, sch.microbatches, sch.kinds)[:, :, 0]
    return bool(np.all(np.diff(first, axis=1) > 0))


def improve(inst: Instance, rules: Sequence[Rule], *, candidates: Sequence[dict],
            groups: int = 8, rounds: int = 1, log: list[str] | None = None,
            prio: np.ndarray | None = None, predict: np.ndarray | None = None
            ) -> tuple[list[Rule], Schedule]:
    """Coordinate descent over the ranks' rules: ranks in `groups` contiguous blocks; for each
    block and each candidate change (a dict of Rule fields), keep it if the makespan drops."""
    rules = list(rules)
    best = list_schedule(inst, rules, prio, predict)
    R = len(rules)
    bounds = np.linspace(0, R, groups + 1).round().astype(int)
    for _ in range(rounds):
        for g in range(groups):
            lo, hi = int(bounds[g]), int(bounds[g + 1])
            for change in candidates:
                trial = rules[:lo] + [replace(x, **change) for x in rules[lo:hi]] + rules[hi:]
                sch = list_schedule(inst, trial, prio, predict)
                if sch.makespan < best.makespan:
                    rules, best = trial, sch
                    if log is not None:
                        log.append(f"ranks {lo}-{hi - 1} {change}: {sch.makespan}")
    return rules, best
