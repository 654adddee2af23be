"""Human-readable reports: which phase is the peak, what dominates it, in GiB."""

from __future__ import annotations

from llamem.report import MemoryReport
from llamem.techniques import workload_labels
from llamem.units import display_unit, format_count, format_in


def describe_workload(report: MemoryReport) -> str:
    return " · ".join(workload_labels(report.workload))


def render_report(report: MemoryReport) -> str:
    spec = report.model
    peak = report.peak_allocated_bytes
    unit = display_unit(peak)
    size = lambda b: format_in(b, unit)  # noqa: E731
    top, top_bytes = report.top_category()
    lines = [
        f"{spec.name} ({format_count(spec.num_params)} params) · {describe_workload(report)}   [{report.engine}]",
        f"peak allocated {size(peak)} in phase '{report.peak_phase}'; largest: {top} "
        f"({size(top_bytes)}, {100 * top_bytes / peak:.0f}%)",
    ]
    if report.device is not None:
        lines.append(f"peak reserved {size(report.peak_reserved_bytes)} + non-torch "
                     f"{size(report.non_torch_bytes)} = device {size(report.device_bytes)}"
                     + ("" if report.layout == "1 GPU" else " per GPU"))
    phases = " · ".join(f"{p} {v / unit[1]:.2f}" for p, v in report.phase_peaks.items())
    lines += ["", f"phase peaks: {phases} {unit[0]}", f"breakdown at the peak ({report.peak_phase}):"]
    small = {k: v for k, v in report.breakdown.items() if v < peak / 1000}
    rows = [(k, v) for k, v in report.breakdown.items() if k not in small]
    if small:
        rows.append((f"other ({len(small)} under 0.1%)", sum(small.values())))
    for key, value in rows:
        lines.append(f"  {key:<28} {value / unit[1]:>10.3f} {unit[0]}  {100 * value / peak:5.1f}%")
    lines.append(f"  {'total':<28} {peak / unit[1]:>10.3f} {unit[0]}")
    for note in tuple(getattr(report.model, "notes", ())) + report.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)
