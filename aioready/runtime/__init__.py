"""The rank runtime: what runs one step of a pipeline on a rank.

`rank.RankRuntime` (receive, arbitrate, execute, send), `pipeline.Pipeline` (the public entry
point), `driver.run_ranks` (one step over a set of rank runtimes, for Pipeline and the
simulator alike), `stage.StageExecutor` (a torch module's F, B and W), `watchdog` (stalls),
`faults` (peers that die or go silent), `checkpoint` (save and resume). Submodules load on use:
importing this package imports no torch.
"""
