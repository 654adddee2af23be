"""A faithful simulator of PyTorch's CUDA caching allocator (pure Python, no torch).

It predicts what `torch.cuda.max_memory_reserved()` will say, the fragmentation, and the
out-of-memory error itself, from a sequence of allocations and frees.
"""

from llamem.allocator.config import AllocatorConfig, AllocatorConfigError, parse_alloc_conf
from llamem.allocator.simulator import CachingAllocatorSim, SimulatedOOM, check_simulated

__all__ = ["AllocatorConfig", "AllocatorConfigError", "parse_alloc_conf", "CachingAllocatorSim", "SimulatedOOM",
           "check_simulated"]
