"""Human-readable output of `llamem allocator replay`."""

from __future__ import annotations

from llamem.units import format_bytes


def render_replay(data: dict) -> str:
    frag = data["fragmentation"]
    lines = [
        f"replayed {data['events_replayed']} of {data['num_events']} events"
        + (f" with {data['allocator_settings']}" if data["allocator_settings"] else " (default allocator settings)"),
        f"peak allocated {format_bytes(data['peak_allocated_bytes'])}, peak reserved "
        f"{format_bytes(data['peak_reserved_bytes'])} (+{format_bytes(frag['peak_reserved_minus_peak_allocated_bytes'])}"
        f"), {data['num_segments']} segments at most, {data['num_alloc_retries']} cudaMalloc retries",
        f"at the end: reserved but unallocated {format_bytes(frag['reserved_minus_allocated_bytes'])}, "
        f"non-releasable {format_bytes(frag['non_releasable_bytes'])}, rounding waste "
        f"{format_bytes(frag['rounding_waste_bytes'])}, largest free block {format_bytes(frag['largest_free_block_bytes'])}",
    ]
    if data["oom"]:
        lines += [f"OUT OF MEMORY at event {data['oom']['event_index']}:", "  " + data["oom"]["message"]]
    for advice in data.get("advice", []):
        lines.append(f"advice: PYTORCH_CUDA_ALLOC_CONF={advice['setting']} lowers the peak reserved memory by "
                     f"{format_bytes(advice['saved_bytes'])} (to {format_bytes(advice['peak_reserved_bytes'])})")
    for warning in data.get("warnings", []):
        lines.append(f"warning: {warning}")
    return "\n".join(lines)
