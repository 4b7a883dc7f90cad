"""CUDA work awaited from the event loop: events as completions, and CUDA tensors over MPI.

`events` turns CUDA events into futures of the completion engine; `mpi` detects a CUDA-aware MPI
and otherwise stages tensors through pooled pinned host buffers; `plane` chooses how an mpirun
job's CUDA tensors travel, `nccl_bootstrap` shares NCCL unique ids over MPI as bytes, and `nccl`
makes the NCCL communicators with CuPy. They import torch (and CuPy) on use only.
"""
