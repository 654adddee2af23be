"""llamem inside a real run: memory sources, the CPU tracker, the monitor, the OOM explainer,
the batch finder, token-budget batching and allocator settings.

torch is imported when a name is first used, so `import llamem.runtime` stays torch-free.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "CpuMemoryTracker": "llamem.runtime.tracker",
    "CudaSource": "llamem.runtime.sources",
    "TrackerSource": "llamem.runtime.sources",
    "memory_source": "llamem.runtime.sources",
    "infer_workload": "llamem.runtime.infer",
    "Inferred": "llamem.runtime.infer",
    "find_batch_size": "llamem.runtime.batch",
    "auto_batch_size": "llamem.runtime.batch",
    "BatchSizeResult": "llamem.runtime.batch",
    "Probe": "llamem.runtime.batch",
    "max_tokens_per_batch": "llamem.runtime.budget",
    "token_budget": "llamem.runtime.budget",
    "TokenBudget": "llamem.runtime.budget",
    "TokenBudgetBatchSampler": "llamem.runtime.budget",
    "PaddingCollator": "llamem.runtime.budget",
    "token_budget_dataloader": "llamem.runtime.budget",
    "write_oom_dump": "llamem.runtime.oom",
    "oom_guard": "llamem.runtime.oom",
    "OomGuard": "llamem.runtime.oom",
    "explain_oom": "llamem.runtime.explain",
    "read_log": "llamem.runtime.runlog",
    "summarize_log": "llamem.runtime.runlog",
    "MemoryMonitor": "llamem.runtime.monitor",
    "LlamemCallback": "llamem.runtime.callback",
    "configure_allocator": "llamem.runtime.allocator_conf",
    "AllocatorSetup": "llamem.runtime.allocator_conf",
    "AllocatorAlreadyStarted": "llamem.runtime.allocator_conf",
    "diagnose": "llamem.runtime.doctor",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'llamem.runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
