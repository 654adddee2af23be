"""The --json form of a MemoryReport: integer bytes, keys with their unit."""

from __future__ import annotations

import dataclasses
from typing import Any

from llamem.report import MemoryReport


def workload_dict(workload) -> dict[str, Any]:
    out = {f.name: getattr(workload, f.name) for f in dataclasses.fields(workload) if not f.name.startswith("_")}
    out["lora_targets"] = list(workload.lora_targets)
    return out


def report_to_dict(report: MemoryReport) -> dict[str, Any]:
    spec = report.model
    out: dict[str, Any] = {
        "model": {"name": spec.name, "hf_id": spec.hf_id, "source": spec.source, "num_params": spec.num_params,
                  "num_layers": spec.num_layers, "hidden_size": spec.hidden_size},
        "workload": workload_dict(report.workload),
        "engine": report.engine,
        "layout": report.layout,
        "peak_allocated_bytes": report.peak_allocated_bytes,
        "peak_phase": report.peak_phase,
        "breakdown": report.breakdown,
        "phases": report.phase_peaks,
        "phase_breakdowns": {phase: dict(sorted(b.items())) for phase, b in report.phases.items()},
        "notes": list(getattr(spec, "notes", ())) + list(report.notes),
    }
    device = report.device
    if device is not None:
        out.update(peak_reserved_bytes=device.peak_reserved_bytes, fragmentation_bytes=device.fragmentation_bytes,
                   non_torch_bytes=device.non_torch_bytes, device_bytes=device.device_bytes)
        if device.exact_shape_device_bytes is not None:
            out["exact_shape_device_bytes"] = device.exact_shape_device_bytes
        if device.unlimited_card_reserved_bytes is not None:
            out["unlimited_card_reserved_bytes"] = device.unlimited_card_reserved_bytes
    return out
