"""The rank runtime: what runs one step of a pipeline on a rank.

`rank.RankRuntime` (receive, arbitrate, execute, send), `pipeline.Pipeline` (the public entry
point and the step driver), `stage.StageExecutor` (a torch module's F, B and W), `watchdog`
(stalls), `faults` (peers that die or go silent), `checkpoint` (save and resume). Submodules load
on use: importing this package imports no torch.
"""
