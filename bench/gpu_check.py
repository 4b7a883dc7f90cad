"""One prepared GPU check (issue 9), plain `python3`, under 5 minutes on one GPU.

1. exactness: 4-stage in-process pipelines, every stage on the GPU on its own stream, strict and
   ready, each wake mode, float64, against the unsplit model (max abs diff <= 1e-10);
2. the cost of awaiting a CUDA event through the completion engine vs `event.synchronize()`
   (median microseconds from launch to the host knowing), per wake mode, and `query()` cost;
3. a 4-stage GPT-style pipeline with variable-length microbatches: strict vs ready step times
   (interleaved repeats, medians) and GPU busy fraction (union of per-task GPU intervals);
4. CUDA-aware MPI detection, the pinned-host staging round trip, and MPI ranks sharing the GPU
   (bench/gpu_mpi_check.py under mpiexec: MPITransport + CUDADevice, exactness);
5. torch.distributed NCCL under torchrun (tests/torch_scripts/cuda_roundtrip.py): a 1-rank NCCL
   group for the code paths, and CUDA tensors between 2 ranks when there are 2 GPUs;
6. the CuPy NCCL data plane of mpirun jobs (bench/gpu_nccl_check.py under mpiexec): 1 rank
   (send-to-self in an NCCL group, all-reduce), 2 ranks (the automatic choice, then
   AIOREADY_GPU_PLANE=nccl: on one GPU NCCL is expected to refuse two ranks);
and writes everything as JSON (--out). Usage: python3 bench/gpu_check.py --out gpu_check.json
[--quick]. Runs without pytest-asyncio: everything is driven by aioready.run.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import aioready  # noqa: E402
from aioready.cuda.events import CUDAEventSource, hostfn_available  # noqa: E402
from aioready.devices.cuda import CUDADevice  # noqa: E402
from aioready.runtime.pipeline import Pipeline  # noqa: E402
from aioready.testing.helpers import make_mlp_stages, max_grad_diff, mse_loss, reference_step  # noqa: E402

RESULTS: dict = {}


def log(*a: object) -> None:
    print(*a, flush=True)


def wakes() -> list[str]:
    return ["poll", "hybrid", "thread"] + (["hostfn"] if hostfn_available() else [])


# -- 1. exactness ------------------------------------------------------------------------------
class Embed(nn.Module):
    def __init__(self, vocab: int, dim: int, max_seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_seq, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        return self.tok(ids) + self.pos(pos)


class GPTBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(nn.functional.gelu(self.up(self.ln2(x))))


class Head(nn.Module):
    def __init__(self, dim: int, vocab: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def gpt_stages(num_stages: int, *, vocab: int, dim: int, heads: int, layers: int, seq: int,
               dtype: torch.dtype, seed: int = 0, device: str = "cuda") -> list[nn.Module]:
    torch.manual_seed(seed)
    stages = []
    for s in range(num_stages):
        parts: list[nn.Module] = [Embed(vocab, dim, seq)] if s == 0 else []
        parts += [GPTBlock(dim, heads) for _ in range(layers)]
        if s == num_stages - 1:
            parts.append(Head(dim, vocab))
        stages.append(nn.Sequential(*parts).to(dtype=dtype, device=device))
    return stages


def gpt_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def gpt_batch(lengths: list[int], batch: int, vocab: int, seed: int,
              device: str = "cuda") -> tuple[list, list]:
    gen = torch.Generator(device=device).manual_seed(seed)
    xs = [torch.randint(vocab, (batch, t), generator=gen, device=device) for t in lengths]
    ys = [torch.randint(vocab, (batch, t), generator=gen, device=device) for t in lengths]
    return xs, ys


async def exact_case(stages, loss_fn, xs, ys, *, mode: str, wake: str, split: bool) -> dict:
    for s in stages:
        s.zero_grad(set_to_none=True)
    ref_loss, ref = reference_step(stages, loss_fn, xs, ys)
    pipe = Pipeline(stages, loss_fn, microbatches=len(xs), mode=mode, split_backward=split,
                    device=lambda r: CUDADevice(r, wake=wake))
    t0 = time.perf_counter()
    loss = await asyncio.wait_for(pipe.step(xs, ys), 60)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    out = {"mode": mode, "wake": wake, "split_backward": split,
           "loss_diff": abs(float(loss) - float(ref_loss)),
           "grad_diff": max_grad_diff(stages, ref), "wall_s": wall,
           "streams": len({rt.device.stream.cuda_stream for rt in pipe.runtimes})}
    out["ok"] = out["loss_diff"] <= 1e-10 and out["grad_diff"] <= 1e-10
    pipe.close()
    return out


async def check_exactness(quick: bool) -> None:
    torch.manual_seed(0)
    mlp = [s.cuda() for s in make_mlp_stages(4)]
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 16, generator=gen, dtype=torch.float64).cuda() for _ in range(8)]
    ys = [torch.randn(4, 16, generator=gen, dtype=torch.float64).cuda() for _ in range(8)]
    cases = []
    for wake in wakes():
        for mode in ("strict", "ready"):
            for split in ((False,) if quick else (False, True)):
                try:
                    cases.append(await exact_case(mlp, mse_loss, xs, ys, mode=mode, wake=wake,
                                                  split=split) | {"model": "mlp"})
                except Exception as exc:
                    cases.append({"model": "mlp", "mode": mode, "wake": wake,
                                  "split_backward": split, "ok": False, "error": repr(exc)})
                log("exact", cases[-1])
    gpt = gpt_stages(4, vocab=97, dim=32, heads=4, layers=1, seq=64, dtype=torch.float64)
    gx, gy = gpt_batch([5, 17, 9, 33, 12, 64, 3, 21], 2, 97, seed=3)
    for mode in ("strict", "ready"):
        cases.append(await exact_case(gpt, gpt_loss, gx, gy, mode=mode, wake="poll",
                                      split=False) | {"model": "gpt-varlen"})
        log("exact", cases[-1])
    RESULTS["exactness"] = {"all_ok": all(c["ok"] for c in cases), "cases": cases}


# -- 2. event-await cost -----------------------------------------------------------------------
_CYCLES_PER_US: list[float] = []


def _sleep_cycles(us: float) -> int:
    """Cycles for torch.cuda._sleep to spin about `us` microseconds (calibrated once)."""
    if not _CYCLES_PER_US:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)
        a.record()
        torch.cuda._sleep(10_000_000)
        b.record()
        b.synchronize()
        _CYCLES_PER_US.append(10_000_000 / (a.elapsed_time(b) * 1e3))
    return int(us * _CYCLES_PER_US[0])


async def check_event_cost(quick: bool) -> None:
    reps = 100 if quick else 300
    stream = torch.cuda.Stream()
    loop = asyncio.get_running_loop()
    sources = {w: CUDAEventSource(loop, wake=w) for w in wakes()}
    ev_spin, ev_block = torch.cuda.Event(), torch.cuda.Event(blocking=True)
    res: dict = {"reps": reps}
    for kernel_us in (20.0, 200.0, 5000.0):
        n = reps if kernel_us < 1000 else 30
        cyc = _sleep_cycles(kernel_us)
        names = ["sync_spin", "sync_blocking", *sources]
        samples: dict[str, list[float]] = {k: [] for k in names}
        cpu: dict[str, list[float]] = {k: [] for k in names}
        for _ in range(10):  # warm-up
            with torch.cuda.stream(stream):
                torch.cuda._sleep(cyc)
            stream.synchronize()
        for i in range(n):
            for name in samples:
                stream.synchronize()
                await asyncio.sleep(0)
                if name.startswith("sync"):
                    ev = ev_block if name == "sync_blocking" else ev_spin
                else:  # fresh events: a waiter thread may still hold the last one
                    ev = torch.cuda.Event(blocking=name in ("thread", "hybrid"))
                c0 = time.process_time()
                t0 = time.perf_counter()
                with torch.cuda.stream(stream):
                    torch.cuda._sleep(cyc)
                ev.record(stream)
                if name.startswith("sync"):
                    ev.synchronize()
                else:
                    await sources[name].add(ev, stream.cuda_stream)
                samples[name].append((time.perf_counter() - t0) * 1e6)
                cpu[name].append((time.process_time() - c0) * 1e6)
        med = {k: statistics.median(v) for k, v in samples.items()}
        p90 = {k: sorted(v)[int(0.9 * len(v))] for k, v in samples.items()}
        over = {k: med[k] - med["sync_spin"] for k in sources}
        res[f"{kernel_us:g}us"] = {"median_us": med, "p90_us": p90,
                                   "overhead_vs_sync_spin_us": over,
                                   "median_cpu_us": {k: statistics.median(v)
                                                     for k, v in cpu.items()}}
        log("event cost", kernel_us, {k: round(v, 1) for k, v in med.items()})
    done = torch.cuda.Event()
    done.record(stream)
    stream.synchronize()
    n = 20000
    t0 = time.perf_counter()
    for _ in range(n):
        done.query()
    res["query_us"] = (time.perf_counter() - t0) / n * 1e6
    for src in sources.values():
        src.close()
    res["goal_under_20us"] = {f"{size}/{k}": v < 20 for size in ("20us", "200us", "5000us")
                              for k, v in res[size]["overhead_vs_sync_spin_us"].items()}
    RESULTS["event_cost"] = res


async def check_event_cost_again(quick: bool) -> None:
    """Two more runs of section 2, for the spread between runs (medians of each run)."""
    first = RESULTS["event_cost"]
    runs = [first]
    for _ in range(2):
        await check_event_cost(quick)
        runs.append(RESULTS["event_cost"])
    RESULTS["event_cost"] = first
    RESULTS["event_cost_runs"] = {
        size: {k: [round(r[size]["overhead_vs_sync_spin_us"][k], 1) for r in runs]
               for k in first[size]["overhead_vs_sync_spin_us"]}
        for size in ("20us", "200us", "5000us")}
    log("event overhead per run", RESULTS["event_cost_runs"])


# -- 3. GPT pipeline, variable-length microbatches ---------------------------------------------
def gpu_busy(devices: list[CUDADevice], t0_event: torch.cuda.Event) -> tuple[float, float]:
    """Union of the tasks' GPU intervals over the span from the step's first to last event (ms)."""
    spans = []
    for dev in devices:
        for _, a, b in dev.timings:
            spans.append((t0_event.elapsed_time(a), t0_event.elapsed_time(b)))
        dev.timings.clear()
    spans.sort()
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
    total = max(e for _, e in spans) - min(s for s, _ in spans)
    return busy, total


async def check_gpt(quick: bool, batch: int = 8, key: str = "gpt_pipeline") -> None:
    """batch=8 leaves the one loop thread launching for all 4 stages most of the time (host
    bound); batch=32 gives each launch 4x the GPU work."""
    dim, heads, layers, vocab = (1024, 16, 2, 8192)
    lengths = [128, 1024, 256, 768, 64, 896, 384, 512]
    stages = gpt_stages(4, vocab=vocab, dim=dim, heads=heads, layers=layers, seq=1024,
                        dtype=torch.bfloat16)
    xs, ys = gpt_batch(lengths, batch, vocab, seed=5)
    pipes = {}
    devs = {}
    labels = [("strict", "strict", "poll"), ("ready", "ready", "poll")]
    labels += [(f"ready/{w}", "ready", w) for w in wakes() if w != "poll"]
    labels += [("ready/one-stream", "ready", "poll")]
    shared = torch.cuda.Stream()
    for label, mode, wake in labels:
        devs[label] = [CUDADevice(r, timing=True, wake=wake,
                                  stream=shared if label.endswith("one-stream") else None)
                       for r in range(4)]
        pipes[label] = Pipeline(stages, gpt_loss, microbatches=len(xs), mode=mode,
                                device=lambda r, m=label: devs[m][r])
    whole = nn.Sequential(*stages)

    def unsplit() -> None:
        for x, y in zip(xs, ys):
            (gpt_loss(whole(x), y) / len(xs)).backward()

    repeats = 3 if quick else 7
    # step_ms is the runtime's loop-clock step time: uvloop's clock ticks in whole ms
    rows: dict[str, dict[str, list[float]]] = {m: {"step_ms": [], "wall_ms": [], "busy": [],
                                                   "span_busy": [], "enqueue_ms": [],
                                                   "await_ms": []} for m in pipes}
    rows["unsplit"] = {"wall_ms": []}
    for r in range(repeats + 2):
        for mode, pipe in pipes.items():
            torch.cuda.synchronize()
            t0e = torch.cuda.Event(enable_timing=True)
            t0e.record()
            for d in devs[mode]:
                d.enqueue_s = d.wait_s = 0.0
            t0 = time.perf_counter()
            await asyncio.wait_for(pipe.step(xs, ys), 60)
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) * 1e3
            busy, total = gpu_busy(devs[mode], t0e)
            if r >= 2:
                rows[mode]["step_ms"].append(pipe.last_step.step_time * 1e3)
                rows[mode]["wall_ms"].append(wall)
                rows[mode]["busy"].append(busy / total)
                rows[mode]["span_busy"].append(statistics.mean(pipe.last_step.busy_fraction()))
                rows[mode]["enqueue_ms"].append(sum(d.enqueue_s for d in devs[mode]) * 1e3)
                rows[mode]["await_ms"].append(sum(d.wait_s for d in devs[mode]) * 1e3)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        unsplit()
        torch.cuda.synchronize()
        if r >= 2:
            rows["unsplit"]["wall_ms"].append((time.perf_counter() - t0) * 1e3)
        for s in stages:
            s.zero_grad(set_to_none=True)
    res: dict = {"config": {"dim": dim, "heads": heads, "layers_per_stage": layers,
                            "vocab": vocab, "batch": batch, "lengths": lengths,
                            "dtype": "bfloat16", "hint": "1f1b", "repeats": repeats}}
    for mode, cols in rows.items():
        res[mode] = {f"median_{k}": statistics.median(v) for k, v in cols.items()}
        res[mode]["samples"] = cols
    res["ready_over_strict_wall"] = res["ready"]["median_wall_ms"] / res["strict"]["median_wall_ms"]
    order = {m: pipes[m].last_step.order(0) for m in pipes}
    res["rank0_order"] = order
    for p in pipes.values():
        p.close()
    RESULTS[key] = res
    log(key, {m: {k: round(v, 3) for k, v in res[m].items() if k.startswith("median")}
                for m in rows})


# -- 4. MPI detection and host staging ---------------------------------------------------------
def check_mpi() -> None:
    code = ("import json,aioready.cuda.mpi as c;s=c.cuda_mpi_support();"
            "print(json.dumps(s._asdict()))")
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=60, cwd=os.path.dirname(os.path.dirname(
                                  os.path.abspath(__file__))))
        RESULTS["cuda_mpi"] = (json.loads(done.stdout.strip().splitlines()[-1])
                               if done.returncode == 0 else {"error": done.stderr[-2000:]})
    except Exception as exc:
        RESULTS["cuda_mpi"] = {"error": repr(exc)}
    log("cuda_mpi", RESULTS["cuda_mpi"])


def mpi_results(mpiexec: str, n: int, script: str, env: dict
                ) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """`mpiexec -n N python SCRIPT` (150 s at most) and the JSON of its `RESULT ` lines."""
    done = subprocess.run([mpiexec, "-n", str(n), sys.executable, script], env=env,
                          capture_output=True, text=True, timeout=150)
    return done, [json.loads(line[7:]) for line in done.stdout.splitlines()
                  if line.startswith("RESULT ")]


def check_mpi_ranks(quick: bool) -> None:
    """bench/gpu_mpi_check.py under mpiexec: 2 and 4 ranks sharing the GPU, MPITransport."""
    import shutil
    here = os.path.dirname(os.path.abspath(__file__))
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        RESULTS["mpi_ranks"] = {"error": "no mpiexec on PATH"}
        return
    version = subprocess.run([mpiexec, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    env = dict(os.environ, PYTHONPATH=os.path.dirname(here), OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1",
               OMPI_MCA_btl_vader_single_copy_mechanism="none")
    res: dict = {"mpiexec": mpiexec, "version": version.strip().splitlines()[:1], "runs": []}
    for n in ((2,) if quick else (2, 4)):
        t0 = time.perf_counter()
        try:
            done, lines = mpi_results(mpiexec, n, os.path.join(here, "gpu_mpi_check.py"), env)
            run = {"ranks": n, "rc": done.returncode, "cases": lines,
                   "all_ok": bool(lines) and all(c["ok"] for c in lines)}
            if done.returncode or not lines:
                run["stderr"] = done.stderr[-3000:]
        except subprocess.TimeoutExpired as exc:
            run = {"ranks": n, "error": "timeout", "stderr": str(exc.stderr)[-2000:]}
        run["seconds"] = time.perf_counter() - t0
        res["runs"].append(run)
        log("mpi ranks", n, {k: v for k, v in run.items() if k != "cases"},
            [(c["mode"], c["split_backward"], c["width"], c["ok"]) for c in run.get("cases", [])])
    RESULTS["mpi_ranks"] = res


def check_torch_nccl(quick: bool) -> None:
    """tests/torch_scripts/cuda_roundtrip.py under torchrun: a 1-rank NCCL group (the NCCL Work
    paths of the transport and TorchTPComm) and, with 2+ GPUs, CUDA tensors over NCCL."""
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    script = os.path.join(root, "tests", "torch_scripts", "cuda_roundtrip.py")
    env = dict(os.environ, PYTHONPATH=root)
    res: dict = {"runs": []}
    for n in sorted({1, min(2, torch.cuda.device_count())}):
        t0 = time.perf_counter()
        try:
            done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                   f"--nproc-per-node={n}", script], env=env, cwd=root,
                                  capture_output=True, text=True, timeout=150)
            run = {"ranks": n, "rc": done.returncode, "ok": "CUDA OK" in done.stdout}
            if not run["ok"]:
                run["output"] = (done.stdout + done.stderr)[-3000:]
        except subprocess.TimeoutExpired as exc:
            run = {"ranks": n, "error": "timeout", "output": str(exc.stderr)[-2000:]}
        run["seconds"] = time.perf_counter() - t0
        res["runs"].append(run)
        log("torch nccl", n, {k: v for k, v in run.items() if k != "output"})
    res["unverified"] = ("NCCL between ranks on different GPUs"
                         if torch.cuda.device_count() < 2 else "")
    RESULTS["torch_nccl"] = res


def check_cupy_nccl(quick: bool) -> None:
    """bench/gpu_nccl_check.py under mpiexec: 1 rank, then 2 (automatic plane, then nccl)."""
    import shutil
    here = os.path.dirname(os.path.abspath(__file__))
    mpiexec = shutil.which("mpiexec") or os.path.join(os.path.dirname(sys.executable), "mpiexec")
    base = dict(os.environ, PYTHONPATH=os.path.dirname(here), OMPI_ALLOW_RUN_AS_ROOT="1",
                OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1")
    base.pop("AIOREADY_GPU_PLANE", None)
    res: dict = {"runs": [], "gpus": torch.cuda.device_count()}
    for n, plane in ((1, None), (2, None), (2, "nccl")):
        env = dict(base, **({"AIOREADY_GPU_PLANE": plane} if plane else {}))
        t0 = time.perf_counter()
        try:
            done, cases = mpi_results(mpiexec, n, os.path.join(here, "gpu_nccl_check.py"),
                                      env)
            run = {"ranks": n, "plane": plane or "auto", "rc": done.returncode, "cases": cases}
            if done.returncode or not cases or not all(c["ok"] for c in cases):
                run["output"] = (done.stdout + done.stderr)[-3000:]
        except subprocess.TimeoutExpired as exc:
            run = {"ranks": n, "plane": plane or "auto", "error": "timeout",
                   "output": str(exc.stderr)[-2000:]}
        run["seconds"] = time.perf_counter() - t0
        res["runs"].append(run)
        log("cupy nccl", n, plane, [(c["case"], c["ok"], c.get("plane"), c.get("error", "")[:200])
                                    for c in run.get("cases", [])])
    res["unverified"] = ("NCCL point-to-point between ranks on different GPUs (the one-way "
                         "communicators), and TP/DP collectives through them"
                         if torch.cuda.device_count() < 2 else "")
    RESULTS["cupy_nccl"] = res


async def check_staging() -> None:
    from aioready.cuda.mpi import HostStager
    stager = HostStager(torch.device("cuda", 0))
    res: dict = {"bytes": 64 << 20, "rounds": []}
    for r in range(4):  # round 0 pins a new buffer; later rounds reuse it from the pool
        x = torch.randn(16 * 1024 * 1024, device="cuda")  # 64 MB
        ready = torch.cuda.Event()
        ready.record()
        t0 = time.perf_counter()
        host, done = stager.to_host(x, ready)
        await stager.wait(done)
        t1 = time.perf_counter()
        back, done2 = stager.to_device(host)
        await stager.wait(done2)
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        res["rounds"].append({"exact": bool(torch.equal(back, x)), "pinned": host.is_pinned(),
                              "d2h_ms": (t1 - t0) * 1e3, "h2d_ms": (t2 - t1) * 1e3,
                              "d2h_GBps": 0.064 * 1.048576 / (t1 - t0),
                              "h2d_GBps": 0.064 * 1.048576 / (t2 - t1)})
        stager.release(host)
    res["exact"] = all(r["exact"] for r in res["rounds"])
    res["pool"] = {"allocated": stager.pool.num_allocated, "reused": stager.pool.num_reused,
                   "lent": stager.pool.num_lent}
    RESULTS["staging"] = res
    stager.close()
    log("staging", RESULTS["staging"])


async def main(args: argparse.Namespace) -> None:
    steps = [("exactness", check_exactness), ("event_cost", check_event_cost),
             ("gpt_pipeline", check_gpt), ("staging", lambda q: check_staging())]
    steps += [("mpi_ranks", lambda q: asyncio.to_thread(check_mpi_ranks, q)),
              ("torch_nccl", lambda q: asyncio.to_thread(check_torch_nccl, q)),
              ("cupy_nccl", lambda q: asyncio.to_thread(check_cupy_nccl, q))]
    if not args.quick:
        steps += [("event_cost_again", check_event_cost_again),
                  ("gpt_pipeline_b32", lambda q: check_gpt(q, 32, "gpt_pipeline_b32"))]
    for name, step in steps:
        t0 = time.perf_counter()
        try:
            await step(args.quick)
        except Exception:
            RESULTS.setdefault("errors", {})[name] = traceback.format_exc()[-3000:]
            log("ERROR in", name, traceback.format_exc())
        RESULTS.setdefault("section_s", {})[name] = time.perf_counter() - t0
        write(args.out)


def write(path: str) -> None:
    with open(path, "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu_check.json")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing to check", file=sys.stderr)
        sys.exit(2)
    props = torch.cuda.get_device_properties(0)
    RESULTS["env"] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                      "gpu": props.name, "torch": torch.__version__,
                      "cuda": torch.version.cuda, "python": sys.version.split()[0],
                      "hostfn_available": hostfn_available(), "wakes": wakes(),
                      "engine": "aioready.progress.ProgressEngine"}
    try:
        import uvloop
        RESULTS["env"]["uvloop"] = uvloop.__version__
    except ImportError:
        RESULTS["env"]["uvloop"] = None
    log("env", RESULTS["env"])
    check_mpi()
    aioready.run(main(args))
    write(args.out)
    log("SUMMARY", json.dumps({k: RESULTS.get(k) for k in ("section_s", "errors")},
                              default=str)[:3000])
    ex = RESULTS.get("exactness", {})
    log("exactness all_ok:", ex.get("all_ok"))
    ec = RESULTS.get("event_cost", {})
    for k in ("20us", "200us", "5000us"):
        if k in ec:
            log("event", k, {n: round(v, 1) for n, v in ec[k]["median_us"].items()})
            log("  cpu", k, {n: round(v, 1) for n, v in ec[k]["median_cpu_us"].items()})
    log("query_us", ec.get("query_us"))
    for key in ("gpt_pipeline", "gpt_pipeline_b32"):
        gp = RESULTS.get(key, {})
        log(key, "ready/strict wall", gp.get("ready_over_strict_wall"))
        for k, v in gp.items():
            if isinstance(v, dict) and "median_wall_ms" in v:
                log(" ", k, {kk: round(vv, 3) for kk, vv in v.items() if kk.startswith("median")})
