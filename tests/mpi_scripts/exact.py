"""Pipeline cases over MPITransport vs the unsplit model; rank 0 prints one RESULT line per case.

Usage: mpiexec -n R python tests/mpi_scripts/exact.py CASE [CASE ...]
CASE = hint:mode:split:varlen[:policy], e.g. 1f1b:ready:1:0 (policy: reserve unless named).
Every rank builds the same full model from a fixed seed and keeps its own stages; the reference
runs the whole model on every rank.
CASE = ooo (2 ranks): rank 0 is a raw MPITransport sender that runs stage 0 by hand and sends
microbatch 3 first, the others 0.3 s later; rank 1 runs stage 1 in ready mode and must run F3
first. Gradients of both stages are still checked against the reference.
CASE = dtypes, plans, multi (2 ranks): payloads of every kind, lone tensors, and several tensors
with None slots, there and back.
K=V,K=V@CASE: CASE with those environment switches set (and put back after); the RESULT line
names the whole token.
"""

import asyncio
import os
import sys
import time

import numpy as np
import torch
from mpi4py import MPI

from aioready.launch import run, say
from aioready.progress import ProgressEngine
from aioready.runtime.pipeline import Pipeline
from aioready.schedulers import HINTS, make_hint
from aioready.testing.helpers import make_mlp_stages, mse_loss, reference_step
from aioready.transports.base import Message, MessageKind
from aioready.transports.header import DTYPE_CODES
from aioready.transports.mpi import MPITransport

WIDTH = 16


PLANES: list = []
LABEL = [""]  # the token being run, as its RESULT line names it


def make_transport(comm, **kwargs) -> MPITransport:
    """MPITransport; with PLANE=mpi-bytes in the environment, payloads that are not inline go
    over aioready.testing.mpi_plane's ordered byte plane (the NCCL plane's path, on CPUs)."""
    if os.environ.get("PLANE") == "mpi-bytes":
        from aioready.testing.mpi_plane import MPIBytePlane
        PLANES.append(MPIBytePlane(comm))
        kwargs["gpu_plane"] = PLANES[-1]
    return MPITransport(comm, **kwargs)


def batch(M: int, varlen: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    lens = [3 + (5 * m) % 7 for m in range(M)] if varlen else [4] * M
    xs = [torch.randn(2, L, WIDTH, generator=gen, dtype=torch.float64) for L in lens]
    ys = [torch.randn(2, L, WIDTH, generator=gen, dtype=torch.float64) for L in lens]
    return xs, ys


def max_all(comm, value: float) -> float:
    out = np.zeros(1)
    comm.Allreduce(np.array([value]), out, op=MPI.MAX)
    return float(out[0])


async def one_case(comm, case: str, seed: int) -> None:
    hint_name, mode, split, varlen, *policy = case.split(":")
    split_b, var = split == "1", varlen == "1"
    size, rank = comm.Get_size(), comm.Get_rank()
    spec = HINTS[hint_name]
    S = size * spec.chunks
    M = 2 * size
    hint = make_hint(hint_name, num_stages=S, num_ranks=size, num_microbatches=M,
                     split_backward=split_b)
    mine = hint.placement.stages_of(rank)
    full = make_mlp_stages(S, width=WIDTH, seed=seed)
    xs, ys = batch(M, var, seed + 1)
    transport = make_transport(comm)
    pipe = Pipeline([full[s] for s in mine], mse_loss, microbatches=M, hint=hint, mode=mode,
                    transport=transport, split_backward=split_b,
                    policy=policy[0] if policy else "reserve")
    loss = await pipe.step(xs, ys)
    await transport.close()
    pipe.close()
    quiet = comm.allreduce(sum(getattr(rt.device, "num_quiet", 0) for rt in pipe.runtimes))
    disarms = comm.allreduce(ProgressEngine.for_loop().num_inline_disarms)  # since the start
    hushes = comm.allreduce(ProgressEngine.for_loop().num_inline_hushes)
    heads = comm.allreduce(getattr(transport._native, "num_heads", 0))  # notices sent in C
    # notices read in C, handed to the runtime as fields (route_notices)
    notices_in = comm.allreduce(getattr(transport._native, "num_notices", 0))
    board = transport.notice_board  # notices posted on the shared-memory board, read or dropped
    posted = comm.allreduce(0 if board is None else board.num_posted)
    board_read = comm.allreduce(0 if board is None else board.num_read)
    board_skipped = comm.allreduce(0 if board is None else board.num_skipped)
    ref_loss, ref = reference_step(make_mlp_stages(S, width=WIDTH, seed=seed), mse_loss, xs, ys)
    gdiff = 0.0
    for s in mine:
        for p, q in zip(full[s].parameters(), ref[s].parameters()):
            gdiff = max(gdiff, float((p.grad - q.grad).abs().max()))
    ldiff = abs(float(loss) - float(ref_loss)) if loss is not None else 0.0
    has_loss = max_all(comm, 1.0 if loss is not None else 0.0)
    gdiff, ldiff = max_all(comm, gdiff), max_all(comm, ldiff)
    if rank == 0:
        say(f"RESULT {LABEL[0]} loss_diff={ldiff:.3e} grad_diff={gdiff:.3e} "
            f"loss_seen={int(has_loss)} quiet={quiet} disarms={disarms} "
            f"hushes={hushes} heads={heads} notices_in={notices_in} board={posted} "
            f"board_read={board_read} board_skipped={board_skipped}")


async def out_of_order(comm, seed: int) -> None:
    rank, M = comm.Get_rank(), 4
    full = make_mlp_stages(2, width=WIDTH, seed=seed)
    xs, ys = batch(M, True, seed + 1)
    transport = make_transport(comm)
    order = ""
    if rank == 0:
        grads: dict[int, tuple] = {}
        transport.open(lambda msg: msg.kind is MessageKind.GRADIENT
                       and grads.__setitem__(msg.microbatch, msg.tensors))
        outs = {m: full[0](xs[m]) for m in range(M)}
        for m in (3, 2, 1, 0):
            transport.send_nowait(1, Message(0, MessageKind.ACTIVATION, 1, m,
                                             (outs[m].detach(),)))
            if m == 3:
                await transport.wait_sent()
                await asyncio.sleep(0.3)
        while len(grads) < M:
            await asyncio.sleep(0.001)
        for m in range(M):
            outs[m].backward(grads[m][0])
    else:
        # memory for every microbatch: F3 may run ahead of F0, which the 1F1B order names
        # first (at the last stage's own cap of one, the reservation keeps the device for F0)
        pipe = Pipeline([full[1]], mse_loss, microbatches=M, hint="1f1b", mode="ready",
                        transport=transport, cap=M)
        await pipe.step(None, ys)
        pipe.close()
        spans = sorted((s for s in pipe.last_step.spans if s.kind.name == "F"),
                       key=lambda s: s.start)
        order = ",".join(f"F{s.microbatch}" for s in spans)
    await transport.close()
    _, ref = reference_step(make_mlp_stages(2, width=WIDTH, seed=seed), mse_loss, xs, ys)
    gdiff = max(float((p.grad - q.grad).abs().max())
                for p, q in zip(full[rank].parameters(), ref[rank].parameters()))
    gdiff = max_all(comm, gdiff)
    if rank == 1:
        say(f"RESULT {LABEL[0]} order={order} grad_diff={gdiff:.3e}")


def dtype_payload(m: int) -> tuple:
    """Every wire dtype, inline-size and large, 0-d, empty, None, a view, a grad-requiring one."""
    gen = torch.Generator().manual_seed(m)
    out: list = []
    if m % 2 == 0:  # every dtype (MAX_TENSORS slots at most per message)
        for name in DTYPE_CODES:
            dt = getattr(torch, name)
            base = torch.randn(3, 5, generator=gen) * 50
            out.append((base > 0) if dt is torch.bool else base.to(dt))
        return tuple(out)
    return (None, torch.randn(300, 70, generator=gen, dtype=torch.float64),  # 168 KB payload
            torch.randn(2, 3, generator=gen, dtype=torch.bfloat16).expand(4, 2, 3),
            torch.tensor(7, dtype=torch.int64), torch.empty(0, 4),
            torch.randn(6, 4, generator=gen).t(), torch.randn(3, generator=gen).requires_grad_())


async def dtypes(comm) -> None:
    """Rank 0 sends every payload kind to rank 1 and to itself; rank 1 echoes back."""
    rank = comm.Get_rank()
    transport = make_transport(comm, inline_bytes=4096)
    got: dict[tuple[int, int], tuple] = {}
    transport.open(lambda msg: got.__setitem__((msg.kind.value, msg.microbatch), msg.tensors))
    bad = []
    if rank == 0:
        for m in range(4):
            transport.send_nowait(1, Message(0, MessageKind.ACTIVATION, 1, m, dtype_payload(m)))
            transport.send_nowait(0, Message(0, MessageKind.GRADIENT, 0, m, dtype_payload(m)))
        while len(got) < 8:
            await asyncio.sleep(0.001)
        for (kind, m), tensors in got.items():
            for i, (a, b) in enumerate(zip(tensors, dtype_payload(m % 10))):
                same = a is None and b is None or (
                    a is not None and b is not None and a.dtype == b.dtype
                    and a.shape == b.shape and torch.equal(a, b.detach()))
                if not same:
                    bad.append(f"kind {kind} mb {m} slot {i}")
            if len(tensors) != len(dtype_payload(m % 10)):
                bad.append(f"kind {kind} mb {m}: {len(tensors)} slots")
        if sorted(got) != sorted([(1, m) for m in range(4)] + [(1, 10 + m) for m in range(4)]):
            bad.append(f"messages {sorted(got)}")
    else:
        while len(got) < 4:
            await asyncio.sleep(0.001)
        for (_, m), tensors in sorted(got.items()):
            transport.send_nowait(0, Message(0, MessageKind.GRADIENT, 0, 10 + m, tensors))
    await transport.wait_sent()
    comm.Barrier()
    await transport.close()
    if rank == 0:
        say(f"RESULT {LABEL[0]} bad={len(bad)} first={'|'.join(bad[:3]).replace(' ', '_')}")


def lone_payload(i: int) -> torch.Tensor:
    """One tensor a message (what the precompiled plans of wire_plans.py take): every dtype,
    then a view, a 0-d one, a grad-requiring one, an empty one and one over 4096 bytes."""
    gen = torch.Generator().manual_seed(i)
    names = sorted(DTYPE_CODES)
    if i < 2 * len(names):  # each dtype twice: the first teaches the receiver its plan
        dt = getattr(torch, names[i // 2])
        base = torch.randn(3, 5, generator=gen) * 50
        return (base > 0) if dt is torch.bool else base.to(dt)
    extra = [torch.randn(6, 4, generator=gen).t(), torch.tensor(2.5, dtype=torch.float64),
             torch.randn(3, generator=gen).requires_grad_(), torch.empty(0, 4),
             torch.randn(40, 40, generator=gen)]
    return extra[(i - 2 * len(names)) % len(extra)]


async def plans(comm) -> None:
    """Rank 0 sends lone tensors to rank 1, which echoes each back: the same values, dtypes and
    shapes come back, and (the plans on) the receive plans took some of them."""
    from aioready.transports import wire_plans
    taken = [0]
    message = wire_plans.ReceivePlans.message

    def counted(self, buf, source):  # counts the messages a plan took
        msg = message(self, buf, source)
        taken[0] += msg is not None
        return msg

    wire_plans.ReceivePlans.message = counted  # type: ignore[method-assign]
    rank = comm.Get_rank()
    transport = make_transport(comm, inline_bytes=4096)
    got: dict[int, torch.Tensor] = {}
    transport.open(lambda msg: got.__setitem__(msg.microbatch, msg.tensors[0]))
    n = 2 * len(DTYPE_CODES) + 10
    try:
        if rank == 0:
            for i in range(n):
                transport.send_nowait(1, Message(0, MessageKind.ACTIVATION, 1, i,
                                                 (lone_payload(i),), tag=i))
        while len(got) < n:
            await asyncio.sleep(0.001)
        if rank == 1:
            for i in sorted(got):
                transport.send_nowait(0, Message(1, MessageKind.GRADIENT, 0, i, (got[i],)))
        await transport.wait_sent()
        comm.Barrier()
        bad = [i for i in range(n) if not (
            got[i].dtype == lone_payload(i).dtype and got[i].shape == lone_payload(i).shape
            and torch.equal(got[i], lone_payload(i).detach()))]
        # the compiled helper (transports/native) takes them in C, without the Python plan
        native = transport._native  # None where it is off
        native_in = 0 if native is None else native.num_received
        native_out = 0 if native is None else native.num_sent
        taken_all = comm.allreduce(taken[0] + native_in)
        native_in, native_out = comm.allreduce(native_in), comm.allreduce(native_out)
    finally:
        wire_plans.ReceivePlans.message = message  # type: ignore[method-assign]
        await transport.close()
    if rank == 0:
        say(f"RESULT {LABEL[0]} bad={len(bad)} first={bad[:3]} taken={taken_all} "
            f"native_in={native_in} native_out={native_out}")


def multi_payload(i: int) -> tuple[torch.Tensor | None, ...]:
    """Several tensors a message, None slots among them (wire_plans.MultiPlans)."""
    gen = torch.Generator().manual_seed(i)
    x = torch.randn(2, 4, 8, generator=gen)
    return ((x, torch.arange(2) + i), (x, None), (None, x.double()), (x > 0, x[0], None))[i % 4]


async def multi(comm) -> None:
    """Rank 0 sends messages of several tensors to rank 1, which echoes each back: the same
    tensors and None slots come back; counts the messages with a None slot a plan took."""
    from aioready.transports import wire_plans
    taken = [0]
    message = wire_plans.ReceivePlans.message

    def counted(self, buf, source):
        msg = message(self, buf, source)
        taken[0] += msg is not None and any(t is None for t in msg.tensors)
        return msg

    wire_plans.ReceivePlans.message = counted  # type: ignore[method-assign]
    rank = comm.Get_rank()
    transport = make_transport(comm)
    got: dict[int, tuple] = {}
    transport.open(lambda msg: got.__setitem__(msg.microbatch, msg.tensors))
    n = 16
    try:
        if rank == 0:
            for i in range(n):
                transport.send_nowait(1, Message(0, MessageKind.ACTIVATION, 1, i,
                                                 multi_payload(i)))
        while len(got) < n:
            await asyncio.sleep(0.001)
        if rank == 1:
            for i in sorted(got):
                transport.send_nowait(0, Message(1, MessageKind.GRADIENT, 0, i, got[i]))
        await transport.wait_sent()
        comm.Barrier()

        def same(a, b) -> bool:
            return len(a) == len(b) and all(
                (x is None and y is None) or (x is not None and y is not None and
                                              x.dtype == y.dtype and torch.equal(x, y))
                for x, y in zip(a, b))
        bad = [i for i in range(n) if not same(got[i], multi_payload(i))]
        taken_all = comm.allreduce(taken[0])
        # sent by the compiled helper's send_multi (transports/native), where it is on
        in_c = comm.allreduce(getattr(transport._native, "num_multi", 0))
        # received and viewed by the C probe (every message here has several tensors)
        in_c_received = comm.allreduce(getattr(transport._native, "num_received", 0))
    finally:
        wire_plans.ReceivePlans.message = message  # type: ignore[method-assign]
        await transport.close()
    if rank == 0:
        say(f"RESULT {LABEL[0]} bad={len(bad)} taken={taken_all} native_multi={in_c} "
            f"native_in={in_c_received}")


def switched(token: str) -> tuple[dict[str, str], str]:
    """`K=V,K=V@CASE` -> ({K: V}, CASE); a plain CASE has no switches."""
    if "@" not in token:
        return {}, token
    switches, case = token.split("@", 1)
    return dict(pair.split("=", 1) for pair in switches.split(",")), case


async def one_token(comm, token: str, i: int) -> None:
    case = switched(token)[1]
    LABEL[0] = token
    if case == "ooo":
        await out_of_order(comm, seed=100 + i)
    elif case == "dtypes":
        await dtypes(comm)
    elif case == "plans":
        await plans(comm)
    elif case == "multi":
        await multi(comm)
    else:
        await one_case(comm, case, seed=100 + i)


def main() -> None:
    """Each token in its own event loop, its switches set in the environment around it: a
    loop's progress engine and a transport read their switches when made, so one launch runs a
    case with a switch on and off."""
    comm = MPI.COMM_WORLD
    for i, token in enumerate(sys.argv[1:]):
        t0 = time.perf_counter()
        switches = switched(token)[0]
        before = {key: os.environ.get(key) for key in switches}
        os.environ.update(switches)
        try:
            run(one_token(comm, token, i))
        finally:
            for key, value in before.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        comm.Barrier()
        if comm.Get_rank() == 0:
            print(f"TIME {token} {time.perf_counter() - t0:.2f}s", file=sys.stderr, flush=True)
    if PLANES:
        say(f"PLANE rank {comm.Get_rank()} sent={sum(p.num_sent for p in PLANES)} "
            f"received={sum(p.num_received for p in PLANES)}")


if __name__ == "__main__":
    main()
