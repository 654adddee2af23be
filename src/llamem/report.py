"""MemoryReport: the one result type every engine returns, so engines compare field by field.

A report is a labelled breakdown that checks itself: per phase, the bytes of each category
at that phase's peak moment; the peak is the worst phase (never a sum of maxima), and its
total is derived from the breakdown, never stored twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llamem.device import DeviceMemory
from llamem.model import ModelSpec
from llamem.workload import Workload

# Display order of the top-level categories; keys may carry a '/sub' part.
CATEGORY_ORDER = ("weights", "gradients", "optimizer", "activations", "logits", "kv_cache", "temporaries", "inputs")


def category_sort_key(key: str) -> tuple[int, str]:
    top = key.split("/", 1)[0]
    rank = CATEGORY_ORDER.index(top) if top in CATEGORY_ORDER else len(CATEGORY_ORDER)
    return rank, key


@dataclass(frozen=True, kw_only=True)
class MemoryReport:
    model: ModelSpec
    workload: Workload
    engine: str
    """analytic | trace | measure"""
    phases: dict[str, dict[str, int]]
    """phase -> category -> bytes at that phase's peak moment."""
    notes: tuple[str, ...] = ()
    """What was approximated, emulated or assumed; never silent."""
    device: DeviceMemory | None = None
    """What the card must hold (`llamem.device`): allocated + fragmentation + non-torch, if computed."""
    layout: str = "1 GPU"
    """Which GPU the figures are for (the busiest one of a parallel layout)."""
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.phases:
            raise ValueError("a report needs at least one phase")
        for phase, breakdown in self.phases.items():
            for key, value in breakdown.items():
                if not isinstance(value, int) or value < 0:
                    raise ValueError(f"{phase}/{key}: bytes must be a non-negative int, got {value!r}")

    def phase_total_bytes(self, phase: str) -> int:
        return sum(self.phases[phase].values())

    @property
    def phase_peaks(self) -> dict[str, int]:
        return {phase: self.phase_total_bytes(phase) for phase in self.phases}

    @property
    def peak_phase(self) -> str:
        peaks = self.phase_peaks
        return max(peaks, key=lambda p: peaks[p])

    @property
    def breakdown(self) -> dict[str, int]:
        """Category -> bytes at the overall peak, largest first within the display order."""
        items = self.phases[self.peak_phase].items()
        return dict(sorted(((k, v) for k, v in items if v), key=lambda kv: category_sort_key(kv[0])))

    @property
    def peak_allocated_bytes(self) -> int:
        return self.phase_total_bytes(self.peak_phase)

    @property
    def peak_reserved_bytes(self) -> int | None:
        return None if self.device is None else self.device.peak_reserved_bytes

    @property
    def non_torch_bytes(self) -> int | None:
        return None if self.device is None else self.device.non_torch_bytes

    @property
    def device_bytes(self) -> int | None:
        return None if self.device is None else self.device.device_bytes

    def top_category(self) -> tuple[str, int]:
        totals: dict[str, int] = {}
        for key, value in self.breakdown.items():
            top = key.split("/", 1)[0]
            totals[top] = totals.get(top, 0) + value
        name = max(totals, key=lambda k: totals[k])
        return name, totals[name]
