"""Add what the card must hold to a report: the allocator's reserved memory (from replaying the
workload's allocations through the simulator), the non-torch overhead, and advice."""

from __future__ import annotations

import dataclasses

from llamem.allocator.advice import advise
from llamem.allocator.replay import AllocEvent, required_reserved_bytes
from llamem.overhead import non_torch_bytes
from llamem.report import MemoryReport
from llamem.units import format_bytes

ADVISE_ABOVE = 0.05
"""Look for a better allocator setting when reserved exceeds allocated by more than 5 %."""


def add_device_memory(report: MemoryReport, events: list[AllocEvent], *, exact: bool,
                      num_gpus: int = 1) -> MemoryReport:
    """`exact`: the events are the workload's real allocations (trace); otherwise a synthetic
    schedule (analytic), whose fragmentation is added to the analytic peak."""
    allocated, needed = required_reserved_bytes(events, smallest_card=report.workload.task == "infer")
    if exact:
        reserved = max(needed, report.peak_allocated_bytes)
    else:
        # The schedule's sizes are coarser than the analytic peak: carry over its fragmentation ratio.
        ratio = max(0.0, needed / max(allocated, 1) - 1)
        reserved = int(report.peak_allocated_bytes * (1 + ratio))
    notes = list(report.notes)
    waste = reserved - report.peak_allocated_bytes
    source = "the traced allocations" if exact else "a synthetic allocation schedule"
    where = " on the smallest card it runs on" if report.workload.task == "infer" else ""
    notes.append(f"reserved memory from replaying {source} through the caching-allocator simulator{where}: "
                 f"{format_bytes(waste)} above allocated")
    if waste > ADVISE_ABOVE * report.peak_allocated_bytes:
        for advice in advise(events, needed)[:1]:
            notes.append(f"allocator: PYTORCH_CUDA_ALLOC_CONF={advice.setting} would lower peak reserved memory by "
                         f"{format_bytes(advice.saved_bytes)}")
    return dataclasses.replace(report, peak_reserved_bytes=reserved, non_torch_bytes=non_torch_bytes(num_gpus),
                               notes=tuple(notes))
