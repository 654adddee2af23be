"""Memory a process uses on the GPU outside PyTorch's caching allocator (`non_torch_bytes`).

A cited table, not a fit: what NVML shows beyond `torch.cuda.memory_reserved()`.

| item | bytes | source |
|---|---|---|
| CUDA context, CUDA >= 11.7 with lazy module loading (torch >= 2.0 default) | ~400 MiB | pytorch/pytorch#109888 (ptrblck: "around 400MB if CUDA >= 11.7 is used and lazy module loading enabled"); #107667 ("~300MB") |
| CUDA context, eager module loading (CUDA < 11.7, or CUDA_MODULE_LOADING=EAGER) | ~1000 MiB | pytorch/pytorch#107667 ("took >1000MB") |
| NCCL communicator buffers, per process in a multi-GPU job | ~512 MiB (assumed) | not calibrated: NCCL allocates outside the caching allocator (vLLM PR #2031 found the profiler missing them); to be measured on a multi-GPU machine |

cuBLAS/cuBLASLt workspaces come from the caching allocator itself in torch 2.x, so they are
inside reserved memory, not here. Values to be replaced by measurements from
`benchmarks/gpu_validate.py` (NVML used minus reserved) as they arrive.
"""

from __future__ import annotations

from llamem.units import MiB

CUDA_CONTEXT_LAZY_BYTES = 400 * MiB
CUDA_CONTEXT_EAGER_BYTES = 1000 * MiB
NCCL_BUFFERS_BYTES = 512 * MiB


def non_torch_bytes(num_gpus: int = 1, lazy_loading: bool = True) -> int:
    context = CUDA_CONTEXT_LAZY_BYTES if lazy_loading else CUDA_CONTEXT_EAGER_BYTES
    return context + (NCCL_BUFFERS_BYTES if num_gpus > 1 else 0)
