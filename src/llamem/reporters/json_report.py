"""The --json form of a MemoryReport: integer bytes, keys with their unit."""

from __future__ import annotations

import dataclasses
from typing import Any

from llamem.report import MemoryReport


def report_to_dict(report: MemoryReport) -> dict[str, Any]:
    spec, workload = report.model, report.workload
    out: dict[str, Any] = {
        "model": {"name": spec.name, "hf_id": spec.hf_id, "source": spec.source, "num_params": spec.num_params,
                  "num_layers": spec.num_layers, "hidden_size": spec.hidden_size},
        "workload": {f.name: getattr(workload, f.name) for f in dataclasses.fields(workload)
                     if not f.name.startswith("_")},
        "engine": report.engine,
        "peak_allocated_bytes": report.peak_allocated_bytes,
        "peak_phase": report.peak_phase,
        "breakdown": report.breakdown,
        "phases": report.phase_peaks,
        "phase_breakdowns": {phase: dict(sorted(b.items())) for phase, b in report.phases.items()},
        "notes": list(report.notes),
    }
    out["workload"]["lora_targets"] = list(workload.lora_targets)
    if report.peak_reserved_bytes is not None:
        out["peak_reserved_bytes"] = report.peak_reserved_bytes
    if report.non_torch_bytes is not None:
        out["non_torch_bytes"] = report.non_torch_bytes
        out["device_bytes"] = report.device_bytes
    return out
