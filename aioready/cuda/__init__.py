"""CUDA work awaited from the event loop: events as completions, and CUDA tensors over MPI.

`events` turns CUDA events into futures of the completion engine; `mpi` detects a CUDA-aware MPI
and otherwise stages tensors through pooled pinned host buffers. Both import torch on use only.
"""
