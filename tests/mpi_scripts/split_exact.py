"""`aioready.split` stages over MPITransport vs the unsplit model; rank 0 prints RESULT lines.

Usage: mpiexec -n R python tests/mpi_scripts/split_exact.py CASE [CASE ...]
CASE = model:placement:hint:split:recompute, e.g. llama:linear:1f1b:0:0. Every rank builds the
same whole model from a seed, splits it and keeps its own chunks (`of_rank`); the boundary is the
hidden state with the model's context (a dict: position ids, rotary cos/sin, None, a bool), which
crosses ranks as flat tensors and a schema. The reference runs the whole model on every rank.
"""

import copy
import os
import sys

import numpy as np
import torch
from mpi4py import MPI

import aioready
from aioready.launch import run, say
from aioready.testing.models import gpt_stages, lm_loss
from aioready.transports.mpi import MPITransport

os.environ.setdefault("HF_HUB_OFFLINE", "1")
VOCAB, SEQ = 32, 8
NAMES = {"gpt": dict(layers="blocks", before=["tok", "pos"], after=["ln_f", "head"]),
         "llama": dict(layers="model.layers", before=["model.embed_tokens", "model.rotary_emb"],
                       after=["model.norm", "lm_head"])}


def build(name: str) -> torch.nn.Module:
    if name == "gpt":
        return gpt_stages(1, layers_per_stage=4, vocab=VOCAB, dim=16, heads=2, seq=SEQ,
                          dtype=torch.float64)[0]
    import transformers
    cfg = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ, use_cache=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).double()


def logits_of(out):
    return out.logits if hasattr(out, "logits") else out


def max_all(comm, value: float) -> float:
    out = np.zeros(1)
    comm.Allreduce(np.array([value]), out, op=MPI.MAX)
    return float(out[0])


async def one_case(comm, case: str) -> None:
    name, placement, hint, split, recompute = case.split(":")
    rank, size = comm.Get_rank(), comm.Get_size()
    S = size if placement == "linear" else 2 * size
    M = 2 * S
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randint(0, VOCAB, (2, SEQ), generator=gen) for _ in range(M)]
    ys = [torch.randint(0, VOCAB, (2, SEQ), generator=gen) for _ in range(M)]
    model = build(name)
    ref = copy.deepcopy(model)
    ref_loss = 0.0
    for x, y in zip(xs, ys):
        loss = lm_loss(logits_of(ref(x)), y) / M
        loss.backward()
        ref_loss += float(loss.detach())
    stages = aioready.split(model, stages=S, placement=placement, ranks=size, **NAMES[name])
    transport = MPITransport(comm)
    pipe = aioready.Pipeline(stages.of_rank(rank), lm_loss, microbatches=M, hint=hint,
                             transport=transport, split_backward=split == "1",
                             recompute=recompute == "1")
    loss = await pipe.step(xs if rank == 0 else None, ys)
    await transport.close()
    pipe.close()
    mine = {id(p) for s in stages.of_rank(rank) for p in s.parameters()}
    gdiff, missing = 0.0, 0
    for p, q in zip(model.parameters(), ref.parameters()):
        if id(p) in mine:
            if p.grad is None:
                missing += 1
            else:
                gdiff = max(gdiff, float((p.grad - q.grad).abs().max()))
    ldiff = abs(float(loss) - ref_loss) if loss is not None else 0.0
    seen = max_all(comm, 1.0 if loss is not None else 0.0)
    gdiff, ldiff, missing = max_all(comm, gdiff), max_all(comm, ldiff), max_all(comm, float(missing))
    if rank == 0:
        say(f"RESULT {case} loss_diff={ldiff:.3e} grad_diff={gdiff:.3e} "
            f"loss_seen={int(seen)} missing={int(missing)}")


async def main() -> None:
    comm = MPI.COMM_WORLD
    for case in sys.argv[1:]:
        await one_case(comm, case)


if __name__ == "__main__":
    run(main())
