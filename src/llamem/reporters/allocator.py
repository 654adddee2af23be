"""Human-readable output of `llamem allocator replay`."""

from __future__ import annotations

from llamem.units import format_bytes, format_gib


def render_replay(data: dict) -> str:
    frag = data["fragmentation"]
    lines = [
        f"replayed {data['events_replayed']} of {data['num_events']} events"
        + (f" with {data['allocator_settings']}" if data["allocator_settings"] else " (default allocator settings)")
        + _capacity(data),
        f"peak allocated {format_bytes(data['peak_allocated_bytes'])}, peak reserved "
        f"{format_bytes(data['peak_reserved_bytes'])} (+{format_bytes(frag['peak_reserved_minus_peak_allocated_bytes'])}"
        f"), {data['num_segments']} segments at most, {data['num_alloc_retries']} cudaMalloc retries",
        f"at the end: reserved but unallocated {format_bytes(frag['reserved_minus_allocated_bytes'])}, "
        f"non-releasable {format_bytes(frag['non_releasable_bytes'])}, rounding waste "
        f"{format_bytes(frag['rounding_waste_bytes'])}, largest free block {format_bytes(frag['largest_free_block_bytes'])}",
    ]
    if data["oom"]:
        entry = data["oom"].get("entry_index")
        where = f" (trace entry {entry})" if entry is not None else ""
        lines += [f"OUT OF MEMORY at event {data['oom']['event_index']}{where}:", "  " + data["oom"]["message"]]
    lines += _empty_cache_lines(data.get("empty_cache"))
    lines += _advice_lines(data)
    for warning in data.get("warnings", []):
        lines.append(f"warning: {warning}")
    return "\n".join(lines)


def _capacity(data: dict) -> str:
    capacity = data.get("capacity_bytes")
    if capacity is None:
        return ""
    inferred = " (inferred from the snapshot)" if data.get("capacity_inferred") else ""
    return f", within {format_gib(capacity)}{inferred}"


def _empty_cache_lines(compare: dict | None) -> list[str]:
    """Peak reserved memory and cudaMalloc calls with torch.cuda.empty_cache() every N allocations, and without."""
    if not compare:
        return []
    with_, without = compare["with"], compare["without"]
    saved = without["peak_reserved_bytes"] - with_["peak_reserved_bytes"]
    change = f"{format_bytes(saved)} less" if saved > 0 else (f"{format_bytes(-saved)} more" if saved else "the same")
    extra = with_["num_device_alloc"] - without["num_device_alloc"]
    cost = f"{extra} more" if extra > 0 else (f"{-extra} fewer" if extra else "as many")
    every, calls = compare["every_allocations"], compare["num_calls"]
    lines = [
        f"with torch.cuda.empty_cache() after every {'allocation' if every == 1 else f'{every} allocations'} "
        f"({calls} {'call' if calls == 1 else 'calls'}): peak reserved {format_bytes(with_['peak_reserved_bytes'])}, "
        f"without {format_bytes(without['peak_reserved_bytes'])} ({change})",
        f"  cudaMalloc calls {with_['num_device_alloc']}, without {without['num_device_alloc']} ({cost}: the time "
        "emptying the cache costs, as each is a slow driver call and every empty_cache synchronises the GPU)",
    ]
    if with_["oom_event_index"] != without["oom_event_index"]:
        def outcome(index):
            return "completes" if index is None else f"runs out of memory at event {index}"

        lines.append(f"  with it the replay {outcome(with_['oom_event_index'])}; without, it "
                     f"{outcome(without['oom_event_index'])}")
    return lines


def _advice_lines(data: dict) -> list[str]:
    capacity = data.get("capacity_bytes")
    lines = []
    for advice in data.get("advice", []):
        peak, saved = format_bytes(advice["peak_reserved_bytes"]), advice["saved_bytes"]
        if capacity is None:
            text = f"lowers the peak reserved memory by {format_bytes(saved)} (to {peak})"
        else:
            change = f", {format_bytes(saved)} less" if saved > 0 else ""
            text = f"completes within {format_gib(capacity)}: peak reserved {peak}{change}"
        lines.append(f"advice: PYTORCH_CUDA_ALLOC_CONF={advice['setting']} {text}")
        if advice.get("note"):
            lines.append(f"  ({advice['note']})")
    if not data.get("advice") and data.get("advice_summary"):
        lines.append(f"advice: {data['advice_summary']}")
    return lines
