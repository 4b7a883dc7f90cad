"""Tensor parallelism composed with the pipeline.

`grid` (the DP x PP x TP process grid and its communicators), `coordination` (the group's leader
chooses each task, the members follow), `collectives` (tagged all-reduces with a deadline),
`layers` (Megatron-style column- and row-parallel layers). Submodules load on use.
"""
