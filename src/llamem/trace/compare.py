"""Analytic vs trace, category by category: the accuracy check that keeps the engines together."""

from __future__ import annotations

from dataclasses import dataclass

from llamem.analytic import estimate
from llamem.model import ModelSpec
from llamem.trace.run import trace
from llamem.workload import Workload

PEAK_TOLERANCE = 0.02
"""Analytic peak within 2 % of the traced peak."""
CATEGORY_TOLERANCE = 0.05
"""Every category above 1 % of the peak within 5 %."""
CATEGORY_FLOOR = 0.01


@dataclass(frozen=True)
class Comparison:
    spec: ModelSpec
    workload: Workload
    analytic_peak_bytes: int
    traced_peak_bytes: int
    traced_phase: str
    category_errors: dict[str, float]
    """Relative error of each category above the floor, at the traced peak phase."""

    @property
    def peak_error(self) -> float:
        return self.analytic_peak_bytes / self.traced_peak_bytes - 1

    @property
    def worst_category(self) -> tuple[str, float]:
        if not self.category_errors:
            return "", 0.0
        key = max(self.category_errors, key=lambda k: abs(self.category_errors[k]))
        return key, self.category_errors[key]

    @property
    def ok(self) -> bool:
        return abs(self.peak_error) <= PEAK_TOLERANCE and abs(self.worst_category[1]) <= CATEGORY_TOLERANCE


def compare(spec: ModelSpec, workload: Workload) -> Comparison:
    analytic = estimate(spec, workload)
    traced = trace(spec, workload)
    phase = traced.peak_phase
    peak = traced.peak_allocated_bytes
    mine = analytic.phases.get(phase, {})
    errors = {}
    for key, value in traced.phases[phase].items():
        if value > CATEGORY_FLOOR * peak:
            errors[key] = mine.get(key, 0) / value - 1
    return Comparison(spec, workload, analytic.peak_allocated_bytes, peak, phase, errors)
