"""Which allocator setting would help, and by how much: found by replaying with each."""

from __future__ import annotations

from dataclasses import dataclass

from llamem.allocator.config import parse_alloc_conf
from llamem.allocator.replay import AllocEvent, replay

CANDIDATES = ("expandable_segments:True", "max_split_size_mb:512", "max_split_size_mb:128",
              "roundup_power2_divisions:4")
WORTH_REPORTING = 0.02
"""Advise a setting only when it saves at least 2 % of the peak reserved memory."""


@dataclass(frozen=True)
class Advice:
    setting: str
    peak_reserved_bytes: int
    saved_bytes: int
    ooms: int


def advise(events: list[AllocEvent], baseline_reserved: int, *, capacity_bytes: int | None = None) -> list[Advice]:
    """Each candidate setting, replayed; those that save enough, best first."""
    found = []
    for setting in CANDIDATES:
        result = replay(events, parse_alloc_conf(setting), capacity_bytes=capacity_bytes)
        saved = baseline_reserved - result.peak_reserved_bytes
        found.append(Advice(setting, result.peak_reserved_bytes, saved, result.sim.num_ooms))
    useful = [a for a in found if a.saved_bytes >= WORTH_REPORTING * max(baseline_reserved, 1)]
    return sorted(useful, key=lambda a: -a.saved_bytes)
