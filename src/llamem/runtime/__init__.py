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
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'llamem.runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
