"""Data parallelism composed with the pipeline, and the reductions across stages.

`setup` (a Pipeline's `grid=`: the communicators, the pipeline line's transport, a TP
coordinator), `reducer` (the GradReducer protocol and its MPI implementation: each stage's
gradients averaged over its data-parallel group in buckets, from the end of its last backward
piece), `requests` (the completion source of their nonblocking collectives), `cross_stage` (the
end-of-step reductions, global clipping, tied weights, token weights, GradScaler), `zero`
(ZeRO-1: optimizer state sharded over the replicas).
Submodules load on use.
"""
