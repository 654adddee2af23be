"""A snapshot whose trace starts late: the state at its first entry, and the capacity at its OOM.

`torch.cuda.memory._record_memory_history(max_entries=N)` keeps the last N trace entries in a
ring buffer: once it wraps, `device_traces` misses every allocation made before its first
entry, while the snapshot's `segments` still show the memory at capture time. Walking the
trace backwards from the segments gives the state at its first entry:
- a block the trace allocates was not live at its start;
- a free of an address the trace never allocated was live at its start, with the size it names;
- a block live at capture that the trace never allocated was live at its start;
- the same for segments: one the trace allocates (`segment_alloc`) did not exist at its start,
  one it frees without allocating did, and so did each segment at capture holding a block live
  at the start (segments never change size), or, when the trace records segment entries, each
  segment at capture the trace did not allocate.
Replay then puts that state into the simulator before the first entry (restore.py).

A trace that ends with torch's `oom` entry carries `device_free`, what cudaMemGetInfo reported
at the error; what cudaMalloc could get then is that plus the memory reserved at that point
(CUDACachingAllocator.cpp `malloc`: the OOM is raised after every cached block was released).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path

from llamem.allocator.trace_input import (SEGMENT_ACTIONS, AllocEvent, ParsedSnapshot, TraceFormatError,
                                          llamem_events, parse_snapshot, read_data, top_level)
from llamem.units import MiB, format_bytes

SMALL_SEGMENT_BYTES = 2 * MiB
"""kSmallBuffer: small-pool segments are 2 MiB; large-pool ones are at least 10 MiB."""


@dataclass(frozen=True)
class StartBlock:
    """A block live before the trace's first entry."""

    address: int
    requested_size: int
    stream: int
    size: int = 0
    """The block's bytes when the snapshot shows them; 0 when only a free told of it (the simulator rounds)."""


@dataclass(frozen=True)
class StartSegment:
    address: int
    total_size: int
    stream: int
    small: bool
    blocks: tuple[StartBlock, ...]

    @property
    def end(self) -> int:
        return self.address + self.total_size


@dataclass(frozen=True)
class StartState:
    """The memory at the trace's first entry."""

    segments: tuple[StartSegment, ...]
    """Segments as they were, with their live blocks at their addresses (the rest is cached)."""
    loose: tuple[StartBlock, ...] = ()
    """Live blocks in no segment that can be rebuilt (expandable segments, or a file without
    segments): allocated before the first entry, in address order."""

    @property
    def blocks(self) -> tuple[StartBlock, ...]:
        return tuple(b for s in self.segments for b in s.blocks) + self.loose

    @property
    def live_bytes(self) -> int:
        return sum(b.size or b.requested_size for b in self.blocks)

    @property
    def reserved_bytes(self) -> int:
        return sum(s.total_size for s in self.segments)

    def to_dict(self) -> dict:
        return {"live_blocks": len(self.blocks), "live_bytes": self.live_bytes, "segments": len(self.segments),
                "segments_reserved_bytes": self.reserved_bytes, "loose_blocks": len(self.loose)}


@dataclass(frozen=True)
class LoadedTrace:
    events: list[AllocEvent]
    """The allocations and frees of the trace, in order."""
    start: StartState | None = None
    """The memory live before the first entry, when the trace starts late; None otherwise."""
    failed_alloc: AllocEvent | None = None
    """The allocation refused by the `oom` entry that ends the trace."""
    oom_capacity_bytes: int | None = None
    """What cudaMalloc could get at that error: reserved then + device_free."""
    notes: tuple[str, ...] = ()
    capacity_note: str = ""

    def replay_events(self, with_failed_alloc: bool) -> list[AllocEvent]:
        """The events to replay; with the refused allocation last when a capacity can refuse it too."""
        if with_failed_alloc and self.failed_alloc is not None:
            return [*self.events, self.failed_alloc]
        return list(self.events)


def load_trace(path: str | Path) -> LoadedTrace:
    return trace_from_data(read_data(path), str(path))


def trace_from_data(data, label: str = "trace") -> LoadedTrace:
    data = top_level(data, label)
    if data.get("format") == "llamem-trace-v1":
        return LoadedTrace(llamem_events(data, label))
    if "format" in data and "device_traces" not in data:
        raise TraceFormatError(f"{label}: unknown format {data['format']!r}; expected 'llamem-trace-v1' "
                               "(from `llamem trace --save-trace`) or a torch memory snapshot")
    snap = parse_snapshot(data, label)
    free_action = "free_completed" if any(e.action == "free_completed" for e in snap.entries) else "free_requested"
    # A free counts when it completes (cross-stream frees wait for their events).
    events = [AllocEvent("alloc" if e.action == "alloc" else "free", e.addr, e.size, e.stream, e.index)
              for e in snap.entries if e.action in ("alloc", free_action)]
    start, notes = rebuild_start(snap, free_action)
    oom = snap.entries[-1] if snap.entries and snap.entries[-1].action == "oom" else None
    if oom is None:
        return LoadedTrace(events, start, notes=tuple(notes))
    # torch records the rounded size (params.size()) and no address: the block never existed.
    failed = AllocEvent("alloc", -1 - oom.index, oom.size, oom.stream, oom.index)
    capacity, note = _oom_capacity(snap, oom, wrapped=start is not None)
    return LoadedTrace(events, start, failed, capacity, tuple(notes), note)


def _oom_capacity(snap: ParsedSnapshot, oom, *, wrapped: bool) -> tuple[int | None, str]:
    has_segment_entries = any(e.action in SEGMENT_ACTIONS for e in snap.entries)
    if snap.segments:
        # Nothing follows the oom entry: the segments at capture are the memory reserved at the error.
        reserved, source = sum(s.total_size for s in snap.segments), "the snapshot's segments"
    elif has_segment_entries and not wrapped:
        reserved, source = _reserved_by_entries(snap), "the trace's segment entries"
    elif snap.segments is not None:
        reserved, source = 0, "the snapshot, which shows no segments"
    else:
        return None, (f"the trace ends with an out-of-memory error (entry {oom.index}), but the file shows no "
                      "segments to tell the memory reserved then: pass --capacity to reproduce it")
    capacity = reserved + oom.device_free
    return capacity, (f"capacity inferred from the out-of-memory error at entry {oom.index}: "
                      f"{format_bytes(reserved)} reserved (from {source}) + {format_bytes(oom.device_free)} free "
                      f"on the device (device_free, as torch read it from cudaMemGetInfo) = {format_bytes(capacity)}; "
                      "--capacity replays with another")


def _reserved_by_entries(snap: ParsedSnapshot) -> int:
    sign = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
    return max(0, sum(sign[e.action] * e.size for e in snap.entries if e.action in sign))


def rebuild_start(snap: ParsedSnapshot, free_action: str) -> tuple[StartState | None, list[str]]:
    """The memory live at the trace's first entry (None when the trace shows all of it), and notes."""
    from_frees, allocated, stray = _walk_blocks(snap, free_action)
    blocks = dict(from_frees)
    for segment in snap.segments or ():
        for block in segment.blocks:
            if block.live and block.address not in allocated and block.address not in blocks:
                blocks[block.address] = StartBlock(block.address, block.requested_size, segment.stream, block.size)
    notes = [f"{stray} frees of addresses the trace had already freed: ignored"] if stray else []
    segments, dropped = _start_segments(snap, blocks)
    if not blocks and not segments:
        return None, notes
    state = _place(sorted(blocks.values(), key=lambda b: b.address), segments)
    notes.append(_start_note(snap, state, dropped))
    return state, notes


def _walk_blocks(snap: ParsedSnapshot, free_action: str) -> tuple[dict[int, StartBlock], set[int], int]:
    from_frees: dict[int, StartBlock] = {}
    allocated: set[int] = set()
    live: set[int] = set()
    stray = 0
    for entry in snap.entries:
        if entry.action == "alloc":
            allocated.add(entry.addr)
            live.add(entry.addr)
        elif entry.action == free_action:
            if entry.addr in live:
                live.discard(entry.addr)
            elif entry.addr in allocated or entry.addr in from_frees:
                stray += 1
            else:
                from_frees[entry.addr] = StartBlock(entry.addr, entry.size, entry.stream)
    return from_frees, allocated, stray


def _start_segments(snap: ParsedSnapshot, blocks: dict[int, StartBlock]) -> tuple[list[tuple], int]:
    """(address, total_size, stream, small) of each segment that existed at the start; and how many
    overlapping ones were dropped. Expandable segments are left out: their blocks are allocated."""
    allocated: set[int] = set()
    found: dict[int, tuple] = {}
    for entry in snap.entries:
        if entry.action == "segment_alloc":
            allocated.add(entry.addr)
        elif entry.action == "segment_free" and entry.addr not in allocated and entry.addr not in found:
            found[entry.addr] = (entry.addr, entry.size, entry.stream, entry.size <= SMALL_SEGMENT_BYTES)
    recorded = any(e.action in SEGMENT_ACTIONS for e in snap.entries)
    addresses = sorted(blocks)
    for s in snap.segments or ():
        if s.expandable or s.address in allocated or s.address in found:
            continue
        holds_live = bisect_right(addresses, s.address + s.total_size - 1) > bisect_right(addresses, s.address - 1)
        if recorded or holds_live:
            found[s.address] = (s.address, s.total_size, s.stream, s.small)
    kept, end = [], -1
    for segment in sorted(found.values()):
        if segment[0] >= end:
            kept.append(segment)
            end = segment[0] + segment[1]
    return kept, len(found) - len(kept)


def _place(blocks: list[StartBlock], segments: list[tuple]) -> StartState:
    starts = [s[0] for s in segments]
    inside: list[list[StartBlock]] = [[] for _ in segments]
    loose = []
    for block in blocks:
        n = bisect_right(starts, block.address) - 1
        if n >= 0 and block.address + max(block.size, block.requested_size, 1) <= starts[n] + segments[n][1]:
            inside[n].append(block)
        else:
            loose.append(block)
    built = tuple(StartSegment(a, size, stream, small, tuple(inside[n]))
                  for n, (a, size, stream, small) in enumerate(segments))
    return StartState(built, tuple(loose))


def _start_note(snap: ParsedSnapshot, state: StartState, dropped: int) -> str:
    blocks = state.blocks
    note = (f"the trace starts after the program did (the ring buffer of "
            f"torch.cuda.memory._record_memory_history(max_entries=...) wrapped, or recording began late): "
            f"{len(blocks)} blocks ({format_bytes(state.live_bytes)}) were live before its first entry")
    if snap.segments is None:
        note += "; the file has no segments, so they are allocated first, in address order"
    else:
        note += (f"; the state at its start was rebuilt from the snapshot's segments: {len(state.segments)} "
                 f"segments ({format_bytes(state.reserved_bytes)} reserved)")
        if state.loose:
            note += (f"; {len(state.loose)} blocks lie in expandable segments or in none the snapshot shows, "
                     "and are allocated first, in address order")
    if dropped:
        note += f"; {dropped} segments overlapping others were left out"
    return note


__all__ = ["LoadedTrace", "StartBlock", "StartSegment", "StartState", "load_trace", "rebuild_start",
           "trace_from_data"]
