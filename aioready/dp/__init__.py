"""Data parallelism composed with the pipeline.

`reducer` (the GradReducer protocol and its MPI implementation: a stage's gradients averaged
over its data-parallel group in buckets, nonblocking, polled by the completion engine), `setup`
(a Pipeline's grid: the communicators, the pipeline line's transport, the reducer).
Submodules load on use.
"""
