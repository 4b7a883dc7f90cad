"""The compiled MPI helper (aioready/transports/native) against the Python plans, one process.

Usage: python tests/mpi_scripts/native.py CASE [CASE ...]; prints one RESULT line per case.
CASE = bytes: every plannable dtype and shape sent by the C `send` (and `send_parts`, from the
  tensor's memory) to this rank itself arrives as the bytes the Python send plan writes.
CASE = receive: a message the C `probe` takes through a receive plan equals, tensor bit for bit,
  the one the Python plan builds from the same bytes.
CASE = declined: headers that differ from the plan's (magic, version, count, kind, dtype code,
  shape) are declined by the C probe as by the Python plan; a message over the bound comes back
  unreceived (its handle still receives it); a field the header cannot hold is NotImplemented.
CASE = heads: a header-only message (a notice) sent by the C `send_head` arrives as the bytes
  the several-tensor plan and the general encoder write; a field the header cannot hold is
  NotImplemented.
CASE = multi: messages of several tensors, None slots among them, sent by the C `send_multi`
  from the several-tensor plan's parts arrive as the bytes that plan packs; received by the C
  `probe` through a learned receive plan (`multi`), they equal, tensor bit for bit and None slot
  for None slot, the Message the Python plan builds from the same bytes (without `multi`: the
  bytes come back to Python).
CASE = notices: a header-only NOTICE the C `probe` takes through its receive plan is handed to
  the notice handler as the very fields the Python plan's Message holds (no Message); another
  kind stays a Message; bad headers (magic, version, count, kind) are declined as by the Python
  plan, the handler not called; what the handler raises comes back as (exception,).
CASE = errors: the same bad headers through a whole MPITransport: the error class and message
  the transport reports (run it with AIOREADY_MPI_NATIVE=0 and =1 and compare).
CASE = notice_errors: likewise for a notice's bad headers, the transport's notices routed to a
  handler (run it with AIOREADY_NATIVE_RECV_HEADS=0 and =1 and compare).
"""

import asyncio
import ctypes
import sys

import numpy as np
import torch
from mpi4py import MPI

from aioready.transports import native
from aioready.transports.base import Message, MessageKind
from aioready.transports.header import DTYPE_CODES
from aioready.transports.mpi import MPITransport
from aioready.transports.wire import WireCodec
from aioready.transports.wire_plans import ReceivePlans, SendPlans

SHAPES = [(3, 5), (), (7,), (2, 3, 4), (40, 40), (1, 1, 1, 1, 1, 1, 1, 1)]
BAD = {"magic": (0, 0x55), "version": (2, 9), "count": (18, 2), "kind-control": (3, 7),
       "kind-unknown": (3, 99), "dtype": (19, 1), "dtype-unknown": (19, 200), "shape": (21, 4)}


def tensors():
    gen = torch.Generator().manual_seed(0)
    for name in sorted(DTYPE_CODES):
        dt = getattr(torch, name)
        if dt.is_complex:
            continue  # (no plan: the general path)
        for shape in SHAPES:
            base = torch.randn(shape, generator=gen) * 50
            yield (base > 0) if dt is torch.bool else base.to(dt)


def message(t, i=0):
    return Message(3 + i, MessageKind.ACTIVATION, 1, 7 + i, (t,), tag=11 + i)


def c_send(mod, comm, plans, msg, tag):
    t, (_, desc, n, tail, off, total) = plans.lookup(msg)
    fields = (comm.handle, 0, tag, msg.kind, msg.step, msg.stage, msg.microbatch, msg.tag, desc,
              t.data_ptr(), n, off)
    if tail is None:
        left = mod.send(*fields, total)
    else:  # the payload from the tensor's memory
        left = mod.send_parts(*fields, tail, True)
    # not sent at once (a send to itself waits for its receive): the caller waits on it later,
    # the message's bytes kept until then
    return None if left is None else (MPI.Request.fromhandle(left[1]), left[0])


def done(req):
    if req is not None:
        req[0].Wait()


def c_probe(mod, comm, by_len, limit=1 << 24, *on_notice):
    got = None
    for _ in range(100):
        got = mod.probe(comm.handle, 1, limit, by_len, *on_notice)
        if got is not None:
            return got
    raise AssertionError("the C probe matched nothing")


def wire_of(plans, msg):
    """The bytes the Python send plan puts on the wire (parts: the header, tensor, zeros)."""
    out = plans.encode(msg)
    if type(out) is tuple:
        head, t, n, tail = out
        return head + ctypes.string_at(t.data_ptr(), n) + bytes(tail)
    return out


def case_bytes(mod, comm):
    bad = []
    num = parts = 0
    for i, t in enumerate(list(tensors()) * 2):
        # the second round: payloads of 16 bytes or more from the tensor's memory
        plans = SendPlans(WireCodec(), 1 << 16, zero_copy=16 if num >= 60 else 0)
        msg = message(t, i)
        expected = wire_of(plans, msg)
        parts += plans.lookup(msg)[1][3] is not None
        req = c_send(mod, comm, plans, msg, i)
        src, tag, count, raw, handle = c_probe(mod, comm, {})
        done(req)
        num += 1
        if (src, tag, handle) != (0, i, 0) or bytes(raw) != expected:
            bad.append(f"{t.dtype}{tuple(t.shape)}")
    print(f"RESULT bytes num={num} parts={parts} bad={len(bad)} first={bad[:3]}", flush=True)


def learn(codec, receive, wire):
    buf = np.frombuffer(wire, np.uint8)
    _, layout = codec.decode(buf, 0)
    receive.learn(buf, layout)


def case_receive(mod, comm):
    codec = WireCodec()
    send = SendPlans(codec, 1 << 16)
    bad, num = [], 0
    for i, t in enumerate(tensors()):
        receive = ReceivePlans()  # (one plan a length: each layout its own)
        learn(codec, receive, send.encode(message(t, i)))
        msg = message(t + 1 if t.dtype is not torch.bool else ~t, i + 1)
        python = receive.message(bytearray(send.encode(msg)), 0)
        req = c_send(mod, comm, send, msg, i)
        got = c_probe(mod, comm, receive._by_len)
        done(req)
        if python is None:  # no plan here (bfloat16): the C probe declines it too
            if type(got) is not tuple or bytes(got[3]) != send.encode(msg):
                bad.append(f"{t.dtype}{tuple(t.shape)}")
            continue
        num += 1
        same = type(got) is Message and all(
            getattr(got, f) == getattr(python, f)
            for f in ("step", "kind", "stage", "microbatch", "tag", "source")) and (
            got.tensors[0].dtype == python.tensors[0].dtype
            and got.tensors[0].shape == python.tensors[0].shape
            and got.tensors[0].numpy().tobytes() == python.tensors[0].numpy().tobytes()
            and got.tensors[0].numpy().tobytes() == msg.tensors[0].numpy().tobytes())
        if not same:
            bad.append(f"{t.dtype}{tuple(t.shape)}")
    receive = ReceivePlans()
    # a header-only message (the reserving policy's notices) through its plan
    notice = Message(5, MessageKind.ACTIVATION, 2, 9, (), tag=4)
    wire = codec.encode_inline(notice, *codec.describe(())[:2])
    learn(codec, receive, wire)
    req = comm.Isend(wire, 0, 99)  # (a blocking send to itself waits for its receive)
    got = c_probe(mod, comm, receive._by_len)
    req.Wait()
    header_only = type(got) is Message and got.tensors == () and got.step == 5 and got.tag == 4
    print(f"RESULT receive num={num} bad={len(bad)} first={bad[:3]} "
          f"header_only={int(header_only)}", flush=True)


def case_heads(mod, comm):
    from aioready.transports.header import _FIXED
    from aioready.transports.wire import align
    codec = WireCodec()
    plans = SendPlans(codec, 1 << 16)
    bad, num = [], 0
    fields = [(MessageKind.NOTICE, 0, 1, 0, 0), (MessageKind.NOTICE, 7, 3, 5, (1 << 31) | 1234),
              (MessageKind.NOTICE, (1 << 32) - 1, (1 << 16) - 1, (1 << 32) - 1, (1 << 32) - 1),
              (MessageKind.ACTIVATION, 2, 1, 9, 4)]
    for i, (kind, step, stage, mb, tag) in enumerate(fields):
        msg = Message(step, kind, stage, mb, (), tag)
        expected = plans.encode(msg)
        general = codec.encode_inline(msg, *codec.describe(())[:2])
        left = mod.send_head(comm.handle, 0, 40 + i, msg.kind, step, stage, mb, tag,
                             align(_FIXED.size))
        src, got_tag, count, raw, handle = c_probe(mod, comm, {})
        if left is not None:
            MPI.Request.fromhandle(left[1]).Wait()
        num += 1
        if (src, got_tag, handle) != (0, 40 + i, 0) or not bytes(raw) == expected == general:
            bad.append(f"{kind.name}:{step}:{stage}:{mb}:{tag}")
    overflow = mod.send_head(comm.handle, 0, 50, MessageKind.NOTICE, 1 << 32, 0, 0, 0,
                             align(_FIXED.size))
    short = mod.send_head(comm.handle, 0, 50, MessageKind.NOTICE, 0, 0, 0, 0, _FIXED.size - 1)
    print(f"RESULT heads num={num} bad={len(bad)} first={bad[:3]} "
          f"overflow={int(overflow is NotImplemented and short is NotImplemented)}", flush=True)


def several(i):
    gen = torch.Generator().manual_seed(i)
    x = torch.randn(2, 16, 8, generator=gen)
    return [(x, torch.arange(32).reshape(2, 16) + i), (x, None), (None, x.double()),
            (x > 0, x[0], None), (x.half(), x.to(torch.int8), x.to(torch.int32), x[1, 2])][i % 5]


def case_multi(mod, comm):
    plans = SendPlans(WireCodec(), 1 << 16)
    bad, num = [], 0
    for i in range(10):
        msg = Message(3 + i, MessageKind.ACTIVATION if i % 2 else MessageKind.GRADIENT, 1, i,
                      several(i), tag=(1 << 32) - 1 - i)
        expected = plans.encode(msg)
        desc, parts, total = plans.parts(msg)
        left = mod.send_multi(comm.handle, 0, 60 + i, msg.kind, msg.step, msg.stage,
                              msg.microbatch, msg.tag, desc, len(msg.tensors), parts, total)
        src, got_tag, count, raw, handle = c_probe(mod, comm, {})
        if left is not None:
            MPI.Request.fromhandle(left[1]).Wait()
        num += 1
        if (src, got_tag, handle) != (0, 60 + i, 0) or bytes(raw) != expected:
            bad.append(i)
    received = multi_received(mod, comm, plans)
    msg = Message(0, MessageKind.ACTIVATION, 1, 0, several(0))
    desc, parts, total = plans.parts(msg)
    overflow = mod.send_multi(comm.handle, 0, 70, msg.kind, 1 << 32, 0, 0, 0, desc, 2, parts,
                              total)
    outside = mod.send_multi(comm.handle, 0, 70, msg.kind, 0, 0, 0, 0, desc, 2, parts,
                             parts[-1][2] + parts[-1][1] - 1)  # the last part past the end
    print(f"RESULT multi received={received} num={num} bad={len(bad)} first={bad[:3]} "
          f"overflow={int(overflow is NotImplemented and outside is NotImplemented)}",
          flush=True)


NOTICE_FIELDS = [(0, 1, 0, 0), (7, 3, 5, (1 << 31) | 1234),
                 ((1 << 32) - 1, (1 << 16) - 1, (1 << 32) - 1, (1 << 32) - 1)]
HEAD_BAD = ("magic", "version", "count", "kind-control", "kind-unknown")


def case_notices(mod, comm):
    codec = WireCodec()
    send, receive = SendPlans(codec, 1 << 16), ReceivePlans()
    learn(codec, receive, send.encode(Message(0, MessageKind.NOTICE, 0, 0, (), 0)))
    seen = []
    bad, num = [], 0
    for i, (step, stage, mb, tag) in enumerate(NOTICE_FIELDS):
        wire = send.encode(Message(step, MessageKind.NOTICE, stage, mb, (), tag))
        python = receive.message(bytearray(wire), 0)
        req = comm.Isend(wire, 0, 60 + i)
        got = c_probe(mod, comm, receive._by_len, 1 << 24, lambda *f: seen.append(f))
        req.Wait()
        num += 1
        if got is not True or python is None or seen[-1:] != [
                (python.step, python.stage, python.microbatch, python.tag)]:
            bad.append(f"{step}:{stage}:{mb}:{tag}")
    calls = len(seen)
    # another kind, header only: the Message as before
    wire = send.encode(Message(2, MessageKind.ACTIVATION, 1, 9, (), 4))
    req = comm.Isend(wire, 0, 70)
    other = c_probe(mod, comm, receive._by_len, 1 << 24, lambda *f: seen.append(f))
    req.Wait()
    other_ok = type(other) is Message and other.kind is MessageKind.ACTIVATION
    taken = []
    wire_notice = send.encode(Message(1, MessageKind.NOTICE, 0, 2, (), 3))
    for name in HEAD_BAD:
        where, value = BAD[name]
        wrong = mutated(wire_notice, where, value)
        req = comm.Isend(wrong, 0, 71)
        got = c_probe(mod, comm, receive._by_len, 1 << 24, lambda *f: seen.append(f))
        req.Wait()
        python = receive.message(bytearray(wrong), 0)
        declined = type(got) is tuple and len(got) == 5 and bytes(got[3]) == wrong
        if not declined or (python is not None and python.kind is MessageKind.NOTICE):
            taken.append(name)
    untouched = len(seen) == calls and other_ok

    def boom(*_):
        raise ValueError("handler failed")
    req = comm.Isend(wire_notice, 0, 72)
    raised = c_probe(mod, comm, receive._by_len, 1 << 24, boom)
    req.Wait()
    raised_ok = (type(raised) is tuple and len(raised) == 1
                 and isinstance(raised[0], ValueError) and str(raised[0]) == "handler failed")
    print(f"RESULT notices num={num} bad={len(bad)} first={bad[:3]} taken={taken} "
          f"untouched={int(untouched)} raised={int(raised_ok)}", flush=True)


def same_message(a, b):
    return type(a) is Message and type(b) is Message and all(
        getattr(a, f) == getattr(b, f)
        for f in ("step", "kind", "stage", "microbatch", "tag", "source")) and len(
        a.tensors) == len(b.tensors) and all(
        (x is None and y is None) or (x is not None and y is not None and x.dtype == y.dtype
                                      and x.shape == y.shape
                                      and x.numpy().tobytes() == y.numpy().tobytes())
        for x, y in zip(a.tensors, b.tensors))


def multi_received(mod, comm, plans):
    """Messages of several tensors through learned receive plans: (taken by the C probe and
    equal to the Python plan's and to what was sent, declined without `multi`) of 10."""
    codec, good = WireCodec(), 0
    for i in range(10):
        msg = Message(3 + i, MessageKind.ACTIVATION, 1, i, several(i), tag=i, source=0)
        wire = plans.encode(msg)
        receive = ReceivePlans()
        learn(codec, receive, wire)
        python = receive.message(bytearray(wire), 0)
        req = comm.Isend(wire, 0, 80 + i)
        got = c_probe(mod, comm, receive._by_len, 1 << 24, None, True)
        req.Wait()
        req = comm.Isend(wire, 0, 90 + i)
        left = c_probe(mod, comm, receive._by_len, 1 << 24, None, False)
        req.Wait()
        good += (same_message(got, python) and same_message(got, msg)
                 and type(left) is tuple and bytes(left[3]) == wire)
    return good


def mutated(wire, where, value):
    out = bytearray(wire)
    out[where] = value
    return bytes(out)


def case_declined(mod, comm):
    codec = WireCodec()
    send, receive = SendPlans(codec, 1 << 16), ReceivePlans()
    msg = message(torch.arange(6, dtype=torch.float32).reshape(2, 3))
    wire = send.encode(msg)
    learn(codec, receive, wire)
    taken = []
    for name, (where, value) in BAD.items():
        bad = mutated(wire, where, value)
        req = comm.Isend(bad, 0, 1)
        got = c_probe(mod, comm, receive._by_len)
        req.Wait()
        python = receive.message(bytearray(bad), 0)
        if type(got) is not tuple or bytes(got[3]) != bad or python is not None:
            taken.append(name)
    # over the bound: matched, not received; the handle given back receives it
    req = comm.Isend(wire, 0, 2)
    src, tag, count, raw, handle = c_probe(mod, comm, receive._by_len, limit=len(wire) - 1)
    buf = bytearray(count)
    MPI.Message.fromhandle(handle).Recv(buf)
    req.Wait()
    bound = raw is None and count == len(wire) and bytes(buf) == wire
    t, (_, desc, n, _, off, total) = send.lookup(msg)
    overflow = mod.send(comm.handle, 0, 3, msg.kind, 1 << 32, 0, 0, 0, desc, t.data_ptr(), n,
                        off, total)
    print(f"RESULT declined taken={taken} bound={int(bound)} "
          f"overflow={int(overflow is NotImplemented)}", flush=True)


async def transport_error(wire, bad, notices=False):
    """The error an MPITransport on COMM_SELF reports for `bad` after it learned `wire`
    (`notices`: its notices routed to a handler)."""
    transport = MPITransport(MPI.COMM_SELF)
    errors, got = [], []
    transport.open(got.append, on_failure=errors.append)
    if notices:
        transport.route_notices(lambda *fields: got.append(fields))
    try:
        for buf in (wire, wire, bad):  # the first teaches the plan, the second takes it
            req = transport._hdr.Isend(buf, 0, 0)
            for _ in range(100):
                if transport.poll() or errors:
                    break
            req.Wait()
    finally:
        try:
            await transport.close()
        except Exception:
            pass
    used = transport._native is not None and (
        transport._native.num_notices if notices else transport._native.num_received) > 0
    if not errors:
        return f"none(delivered={len(got)})", used
    return f"{type(errors[0]).__name__}:{errors[0]}".replace(" ", "_"), used


async def case_errors(_mod, _comm):
    msg = message(torch.arange(6, dtype=torch.float32).reshape(2, 3))
    wire = SendPlans(WireCodec(), 1 << 16).encode(msg)
    out, used = [], []
    for name, (where, value) in BAD.items():
        if name == "kind-control":
            continue  # a CONTROL message of its own, valid: delivered, not an error
        text, native_used = await transport_error(wire, mutated(wire, where, value))
        out.append(f"{name}={text}")
        used.append(native_used)
    print(f"RESULT errors native_used={int(all(used))} " + " ".join(out), flush=True)


async def case_notice_errors(_mod, _comm):
    wire = SendPlans(WireCodec(), 1 << 16).encode(Message(1, MessageKind.NOTICE, 0, 2, (), 3))
    out, used = [], []
    for name in HEAD_BAD:
        if name == "kind-control":
            continue  # a CONTROL message of its own, valid: delivered, not an error
        where, value = BAD[name]
        text, native_used = await transport_error(wire, mutated(wire, where, value), True)
        out.append(f"{name}={text}")
        used.append(native_used)
    print(f"RESULT notice_errors native_used={int(all(used))} " + " ".join(out), flush=True)


def main():
    mod = native.load()
    comm = MPI.COMM_SELF.Dup()
    print(f"STATUS {native.status().replace(' ', '_')}", flush=True)
    for case in sys.argv[1:]:
        if case in ("errors", "notice_errors"):
            asyncio.run({"errors": case_errors, "notice_errors": case_notice_errors}[case](
                mod, comm))
            continue
        assert mod is not None, native.status()
        {"bytes": case_bytes, "receive": case_receive, "declined": case_declined,
         "heads": case_heads, "multi": case_multi, "notices": case_notices}[case](mod, comm)
    comm.Free()


if __name__ == "__main__":
    main()
