"""The simulator's state in the structure of `torch.cuda.memory._snapshot()`, and a
`torch.cuda.memory_summary()`-like table. torch's own `_memory_viz` reads the snapshot."""

from __future__ import annotations

from llamem.allocator.simulator import CachingAllocatorSim, format_size


def snapshot(sim: CachingAllocatorSim) -> dict:
    """{"segments": [...], "device_traces": [[...]]} as torch writes it (device 0)."""
    segments = []
    for head in sim.segment_heads():
        blocks, block = [], head
        while block is not None and block.mapped:
            state = "active_allocated" if block.allocated else "inactive"
            blocks.append({"address": block.ptr, "size": block.size,
                           "requested_size": block.requested if block.allocated else 0,
                           "state": state, "frames": []})
            block = block.next
            if block is not None and head.segment is not None and not block.mapped:
                break
        total = sum(b["size"] for b in blocks)
        allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
        segments.append({
            "device": 0, "address": head.ptr, "total_size": total, "stream": head.stream,
            "segment_type": "small" if head.pool.small else "large", "segment_pool_id": (0, 0),
            "is_expandable": head.segment is not None, "allocated_size": allocated, "active_size": allocated,
            "requested_size": sum(b["requested_size"] for b in blocks), "frames": [], "blocks": blocks,
        })
    return {"segments": segments, "device_traces": [list(sim.trace)], "allocator_settings": {}}


def memory_summary(sim: CachingAllocatorSim) -> str:
    """The rows of torch.cuda.memory_summary(), from the simulated statistics."""
    stats = sim.memory_stats()
    rule = "|" + "=" * 75 + "|"
    thin = "|" + "-" * 75 + "|"
    lines = [rule, "|{:^75}|".format("PyTorch CUDA memory summary (llamem simulation), device ID 0"), thin,
             "|{:^75}|".format(f"CUDA OOMs: {stats['num_ooms']:<12}|        cudaMalloc retries: "
                               f"{stats['num_alloc_retries']:<8}"), rule,
             "|        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  |", thin]
    rows = [("Allocated memory", "allocated_bytes", True), ("Active memory", "active_bytes", True),
            ("Requested memory", "requested_bytes", True), ("GPU reserved memory", "reserved_bytes", True),
            ("Non-releasable memory", "inactive_split_bytes", True), ("Allocations", "allocation", False),
            ("Active allocs", "active", False), ("GPU reserved segments", "segment", False),
            ("Non-releasable allocs", "inactive_split", False)]
    fields = ("current", "peak", "allocated", "freed")
    for label, key, is_bytes in rows:
        # As torch: each column's unit is chosen by the 'all' row's value.
        preferred = [stats[f"{key}.all.{f}"] for f in fields]
        for pool, name in (("all", label), ("large_pool", "      from large pool"), ("small_pool",
                                                                                    "      from small pool")):
            values = [stats[f"{key}.{pool}.{f}"] for f in fields]
            cells = [_size(v, p) if is_bytes else str(v) for v, p in zip(values, preferred)]
            lines.append(f"| {name:<21} | {cells[0]:>10} | {cells[1]:>10} | {cells[2]:>10} | {cells[3]:>10} |")
        lines.append(thin)
    for label, key in (("Oversize allocations", "oversize_allocations"), ("Oversize GPU segments",
                                                                          "oversize_segments")):
        values = [str(stats[f"{key}.{f}"]) for f in ("current", "peak", "allocated", "freed")]
        lines.append(f"| {label:<21} | {values[0]:>10} | {values[1]:>10} | {values[2]:>10} | {values[3]:>10} |")
    lines.append(rule)
    return "\n".join(lines)


def _size(num_bytes: int, preferred: int) -> str:
    """torch.cuda.memory._format_size: the next unit once the preferred value reaches 768 of it."""
    unit = "B  "
    for next_unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        if preferred < 768 * 1024:
            break
        unit = next_unit
        num_bytes //= 1024
        preferred /= 1024
    return f"{num_bytes:6d} {unit}"


__all__ = ["snapshot", "memory_summary", "format_size"]
