"""Which allocator setting would help, and by how much: found by replaying with each.

With a capacity, a setting is advised only when the replay completes within it; without one,
only when it lowers the peak reserved memory by at least WORTH_REPORTING. Advice is ranked by
peak reserved memory, lowest first.
"""

from __future__ import annotations

from dataclasses import dataclass

from llamem.allocator.config import parse_alloc_conf
from llamem.allocator.replay import replay
from llamem.allocator.trace_input import AllocEvent
from llamem.allocator.window import StartState
from llamem.units import format_gib

MAX_SPLIT_SIZES_MIB = (64, 128, 256, 512, 1024)
"""max_split_size_mb values tried; torch refuses below 20 (CUDAAllocatorConfig: 'must be >= 20')."""
GC_THRESHOLDS = (0.6, 0.8)
GC_NOTE = ("garbage_collection_threshold acts only under a per-process memory fraction (the `set_fraction` "
           "guard in CUDACachingAllocator.cpp malloc), so this sets per_process_memory_fraction:1.0 too, the same "
           "as torch.cuda.set_per_process_memory_fraction(1.0)")
ROUNDUP_SETTINGS = ("roundup_power2_divisions:4", "roundup_power2_divisions:8",
                    "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]")
WORTH_REPORTING = 0.02
"""Without a capacity, advise a setting only when it saves at least 2 % of the peak reserved memory."""


@dataclass(frozen=True)
class Advice:
    setting: str
    """The PYTORCH_CUDA_ALLOC_CONF value replayed."""
    peak_reserved_bytes: int
    saved_bytes: int
    """Baseline peak reserved minus this one's (negative when it reserves more, yet completes)."""
    completes: bool
    """The replay ran to the end without an out-of-memory error."""
    ooms: int
    """Out-of-memory errors in the replay (0 or 1: a replay stops at the first)."""
    note: str = ""


def candidates(capacity_bytes: int | None) -> tuple[tuple[str, str], ...]:
    """(setting, note) pairs to replay. Garbage collection only with a capacity: without a memory
    fraction of a finite card it never runs."""
    found = [("expandable_segments:True", "")]
    found += [(f"max_split_size_mb:{mib}", "") for mib in MAX_SPLIT_SIZES_MIB]
    if capacity_bytes is not None:
        found += [(f"garbage_collection_threshold:{t},per_process_memory_fraction:1.0", GC_NOTE)
                  for t in GC_THRESHOLDS]
    found += [(setting, "") for setting in ROUNDUP_SETTINGS]
    return tuple(found)


def advise(events: list[AllocEvent], baseline_reserved: int, *, capacity_bytes: int | None = None,
           baseline_completes: bool = True, start: StartState | None = None,
           device_total_bytes: int | None = None) -> list[Advice]:
    """Each candidate setting, replayed (within `capacity_bytes` when given, from `start` when the
    trace starts late); those that help, lowest peak reserved first.

    With a capacity a setting helps when it completes, and, if the baseline completed too, saves
    WORTH_REPORTING of its peak; without one, when it saves WORTH_REPORTING."""
    threshold = WORTH_REPORTING * max(baseline_reserved, 1)
    useful = []
    for setting, note in candidates(capacity_bytes):
        result = replay(events, parse_alloc_conf(setting), capacity_bytes=capacity_bytes,
                        device_total_bytes=device_total_bytes, start=start)
        advice = Advice(setting, result.peak_reserved_bytes, baseline_reserved - result.peak_reserved_bytes,
                        result.completes, result.sim.num_ooms, note)
        if _helps(advice, threshold, capacity_bytes is not None, baseline_completes):
            useful.append(advice)
    return sorted(useful, key=lambda a: (a.peak_reserved_bytes, a.setting))


def _helps(advice: Advice, threshold: float, has_capacity: bool, baseline_completes: bool) -> bool:
    saves = advice.saved_bytes >= threshold
    if not has_capacity:
        return saves
    return advice.completes and (saves or not baseline_completes)


def summarize(advice: list[Advice], *, capacity_bytes: int | None, baseline_completes: bool = True) -> str:
    """One sentence for the report: the best setting, or that none helps."""
    within = f" within {format_gib(capacity_bytes)}" if capacity_bytes is not None else ""
    if advice:
        verb = "completes" if capacity_bytes is not None and not baseline_completes else "lowers peak reserved memory"
        others = f" ({len(advice) - 1} more below)" if len(advice) > 1 else ""
        return f"best: PYTORCH_CUDA_ALLOC_CONF={advice[0].setting} {verb}{within}{others}"
    if capacity_bytes is not None and not baseline_completes:
        return f"no allocator setting completes{within}"
    return f"no allocator setting lowers the peak reserved memory by {WORTH_REPORTING:.0%} or more{within}"
