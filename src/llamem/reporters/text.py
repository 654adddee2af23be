"""Human-readable reports: which phase is the peak, what dominates it, in GiB."""

from __future__ import annotations

from llamem.report import MemoryReport
from llamem.units import GiB, format_gib


def describe_workload(report: MemoryReport) -> str:
    w = report.workload
    parts = [w.task, f"batch {w.batch} x seq {w.seq}", w.precision]
    if w.task == "infer":
        parts += [f"{w.new_tokens} new tokens", f"kv {w.kv_dtype}"]
        if w.prefill_step < w.seq:
            parts.append(f"prefill chunks of {w.prefill_chunk}")
    else:
        parts += [w.optimizer, f"ac {w.ac_label}"]
        if w.grad_accum > 1:
            parts.append(f"grad-accum {w.grad_accum}")
        if w.loss != "full":
            parts.append(f"{w.loss} loss")
    if w.quant != "none":
        parts.append(w.quant)
    if w.uses_adapters:
        parts.append(f"LoRA r={w.lora_rank} on {','.join(w.lora_targets)}")
    if w.teacher:
        parts.append(f"teacher {w.teacher}")
    parts.append(w.attn)
    return " · ".join(parts)


def render_report(report: MemoryReport) -> str:
    spec = report.model
    peak = report.peak_allocated_bytes
    top, top_bytes = report.top_category()
    lines = [
        f"{spec.name} ({spec.num_params / 1e9:.2f} B params) · {describe_workload(report)}   [{report.engine}]",
        f"peak allocated {format_gib(peak)} in phase '{report.peak_phase}'; largest: {top} "
        f"({format_gib(top_bytes)}, {100 * top_bytes / peak:.0f}%)",
    ]
    if report.device_bytes is not None:
        lines.append(f"peak reserved {format_gib(report.peak_reserved_bytes)} + non-torch "
                     f"{format_gib(report.non_torch_bytes)} = device {format_gib(report.device_bytes)}")
    lines += ["", "phase peaks: " + " · ".join(f"{p} {v / GiB:.2f}" for p, v in report.phase_peaks.items()) + " GiB",
              f"breakdown at the peak ({report.peak_phase}):"]
    small = {k: v for k, v in report.breakdown.items() if v < peak / 1000}
    for key, value in report.breakdown.items():
        if key not in small:
            lines.append(f"  {key:<28} {value / GiB:>10.3f} GiB  {100 * value / peak:5.1f}%")
    if small:
        label = f"other ({len(small)} under 0.1%)"
        lines.append(f"  {label:<28} {sum(small.values()) / GiB:>10.3f} GiB  {100 * sum(small.values()) / peak:5.1f}%")
    lines.append(f"  {'total':<28} {peak / GiB:>10.3f} GiB")
    for note in report.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)
