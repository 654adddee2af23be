"""Where runtime memory figures come from: the CUDA caching allocator (with NVML for what
nvidia-smi shows), or a CpuMemoryTracker standing in for a GPU. Both answer the same keys.

Keys of `stats()` (bytes unless said): allocated_bytes, reserved_bytes, active_bytes,
peak_allocated_bytes, peak_reserved_bytes, num_alloc_retries, num_ooms (counts),
nvml_used_bytes and non_torch_bytes (None where NVML is absent), capacity_bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from llamem.measure import nvml_used_bytes

if TYPE_CHECKING:  # the tracker imports torch; this module's keys are read without it
    from llamem.runtime.tracker import CpuMemoryTracker

STAT_KEYS = ("allocated_bytes", "reserved_bytes", "active_bytes", "peak_allocated_bytes", "peak_reserved_bytes",
             "num_alloc_retries", "num_ooms", "nvml_used_bytes", "non_torch_bytes", "capacity_bytes")


@dataclass
class TrackerSource:
    """A CPU tracker read like a GPU: nothing is cached, so reserved equals allocated."""

    tracker: CpuMemoryTracker
    kind: str = "cpu-tracker"

    def stats(self) -> dict:
        t = self.tracker
        return {"allocated_bytes": t.live_bytes, "reserved_bytes": t.live_bytes, "active_bytes": t.live_bytes,
                "peak_allocated_bytes": t.peak_bytes, "peak_reserved_bytes": t.peak_bytes,
                "num_alloc_retries": 0, "num_ooms": t.num_ooms, "nvml_used_bytes": None,
                "non_torch_bytes": None, "capacity_bytes": t.capacity_bytes}

    def reset_peak(self) -> None:
        self.tracker.reset_peak()

    def snapshot(self) -> dict:
        """llamem-trace-v1, which `llamem allocator replay` reads."""
        return self.tracker.snapshot()

    def empty_cache(self) -> None:
        """Nothing is cached on the tracker."""


@dataclass
class CudaSource:
    """torch.cuda.memory_stats() of one device, and NVML's view of the same device."""

    device: int = 0
    kind: str = "cuda"

    def stats(self) -> dict:
        import torch

        s = torch.cuda.memory_stats(self.device)
        used = nvml_used_bytes(self.device)
        reserved = s.get("reserved_bytes.all.current", 0)
        return {"allocated_bytes": s.get("allocated_bytes.all.current", 0), "reserved_bytes": reserved,
                "active_bytes": s.get("active_bytes.all.current", 0),
                "peak_allocated_bytes": s.get("allocated_bytes.all.peak", 0),
                "peak_reserved_bytes": s.get("reserved_bytes.all.peak", 0),
                "num_alloc_retries": s.get("num_alloc_retries", 0), "num_ooms": s.get("num_ooms", 0),
                "nvml_used_bytes": used, "non_torch_bytes": None if used is None else max(0, used - reserved),
                "capacity_bytes": torch.cuda.get_device_properties(self.device).total_memory}

    def reset_peak(self) -> None:
        import torch

        torch.cuda.reset_peak_memory_stats(self.device)

    def snapshot(self) -> dict:
        """torch.cuda.memory._snapshot(): segments, and the trace if memory history is recorded."""
        import torch

        return torch.cuda.memory._snapshot(self.device)

    def empty_cache(self) -> None:
        import torch

        torch.cuda.empty_cache()


def memory_source(tracker: CpuMemoryTracker | None = None, device: int | None = None):
    """The tracker when given; else CUDA when available; else an error naming the fix."""
    if tracker is not None:
        return TrackerSource(tracker)
    import torch

    if torch.cuda.is_available():
        return CudaSource(torch.cuda.current_device() if device is None else device)
    raise RuntimeError("no CUDA device: on a CPU, run inside `with CpuMemoryTracker() as tracker:` "
                       "and pass tracker=tracker")
