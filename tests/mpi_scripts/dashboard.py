"""`aioready train`'s loop under MPI with the dashboard on rank 0: after each step rank 0 reads
its JSON endpoint and prints what it holds of every rank.

Usage: mpiexec -n 2 python tests/mpi_scripts/dashboard.py PORT
Prints `SNAP step=.. last=.. ranks=[..] spans=.. msgs={..} done=..` per step on rank 0.
"""

import json
import sys
import urllib.request

from aioready.cli import trainer
from aioready.cli.train import mpi_comm
from aioready.launch import run, say

PORT = int(sys.argv[1])
M = 4
comm = mpi_comm()
rank = comm.Get_rank()
cfg = trainer.TrainConfig(stages=2, microbatches=M, steps=3, sleep_only=True, task_ms=2,
                          dashboard=PORT)


def on_step(step, metrics, loss):  # type: ignore[no-untyped-def]
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/api/snapshot", timeout=30) as res:
        snap = json.loads(res.read())
    last = snap["last_step"]
    msgs = {f"{m['src']}>{m['dest']}": m["messages"] for m in snap["messages"]}
    say(f"SNAP step={step} last={last['step']} ranks={sorted({s[0] for s in last['spans']})} "
        f"spans={len(last['spans'])} msgs={json.dumps(msgs, sort_keys=True)} "
        f"done={snap['steps_done']} rows={len(snap['ranks'])}")


run(trainer.train(cfg, comm=comm, on_step=on_step))
