"""Replay an allocation trace through the simulator: peak reserved, fragmentation, the OOM.

Inputs, all read without torch:
- JSON in the structure of a torch snapshot's `device_traces`
  (`{"device_traces": [[{"action": "alloc", "addr": 1, "size": 1000, "stream": 0}, ...]]}`);
- a pickled snapshot from `torch.cuda.memory._dump_snapshot`, loaded with an unpickler that
  refuses every global (a snapshot holds only dicts, lists, strings and numbers, so nothing
  legitimate is lost, and a crafted pickle cannot run code);
- an event trace from `llamem trace --save-trace`.
"""

from __future__ import annotations

import io
import json
import pickle
from dataclasses import dataclass, field
from pathlib import Path

from llamem.allocator.config import AllocatorConfig
from llamem.allocator.simulator import CachingAllocatorSim, SimulatedOOM
from llamem.errors import LlamemError


class TraceFormatError(LlamemError):
    """A file replay cannot read."""


@dataclass(frozen=True)
class AllocEvent:
    action: str  # "alloc" | "free"
    addr: int
    size: int
    stream: int = 0


class _NoGlobalsUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        raise TraceFormatError(f"refusing to load {module}.{name} from a pickle: a memory snapshot holds only "
                               "plain data, and this file asks to import code; it was not loaded")


def load_events(path: str | Path) -> list[AllocEvent]:
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise TraceFormatError(f"{path}: no such file") from None
    if raw[:1] == b"\x80":  # pickle protocol 2+
        try:
            data = _NoGlobalsUnpickler(io.BytesIO(raw)).load()
        except TraceFormatError:
            raise
        except Exception as err:
            raise TraceFormatError(f"{path}: not a readable pickle ({err})") from None
    else:
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise TraceFormatError(f"{path}: neither JSON nor a pickled snapshot ({err})") from None
    return events_from_data(data, str(path))


def events_from_data(data, label: str = "trace") -> list[AllocEvent]:
    if isinstance(data, dict) and data.get("format") == "llamem-trace-v1":
        return [AllocEvent(e["action"], int(e["addr"]), int(e.get("nbytes", e["size"]))) for e in data["events"]]
    if not isinstance(data, dict) or "device_traces" not in data:
        raise TraceFormatError(f"{label}: expected a snapshot with 'device_traces' or a llamem trace "
                               "(from `llamem trace --save-trace`)")
    traces = [t for t in data["device_traces"] if t]
    if len(traces) > 1:
        raise TraceFormatError(f"{label}: holds traces of {len(traces)} devices; replay one at a time")
    return _from_device_trace(traces[0] if traces else [])


def _from_device_trace(entries: list[dict]) -> list[AllocEvent]:
    """Allocs and frees; a free counts when it completes (cross-stream frees wait for their events)."""
    completes = any(e.get("action") == "free_completed" for e in entries)
    free_action = "free_completed" if completes else "free_requested"
    events = []
    for entry in entries:
        action = entry.get("action")
        if action == "alloc":
            events.append(AllocEvent("alloc", int(entry["addr"]), int(entry["size"]), int(entry.get("stream", 0))))
        elif action == free_action:
            events.append(AllocEvent("free", int(entry["addr"]), int(entry["size"]), int(entry.get("stream", 0))))
    return events


@dataclass
class ReplayResult:
    sim: CachingAllocatorSim
    num_events: int
    events_replayed: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    reserved_at_allocated_peak_bytes: int
    oom_event_index: int | None = None
    oom_message: str | None = None
    warnings: list[str] = field(default_factory=list)

    def fragmentation(self) -> dict[str, float | int]:
        sim = self.sim
        stats = sim.memory_stats()
        free = [b.size for b in sim.free_blocks()]
        total_free = sum(free)
        largest = max(free, default=0)
        return {
            "reserved_minus_allocated_bytes": sim.reserved_bytes - sim.allocated_bytes,
            "peak_reserved_minus_peak_allocated_bytes": self.peak_reserved_bytes - self.peak_allocated_bytes,
            "non_releasable_bytes": stats["inactive_split_bytes.all.current"],
            "rounding_waste_bytes": stats["allocated_bytes.all.current"] - stats["requested_bytes.all.current"],
            "largest_free_block_bytes": largest,
            "external_fragmentation": 0.0 if total_free == 0 else round(1 - largest / total_free, 6),
        }

    def to_dict(self) -> dict:
        stats = self.sim.memory_stats()
        return {
            "num_events": self.num_events,
            "events_replayed": self.events_replayed,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "num_segments": stats["segment.all.peak"],
            "num_segments_at_end": stats["segment.all.current"],
            "num_alloc_retries": stats["num_alloc_retries"],
            "num_ooms": stats["num_ooms"],
            "oom": None if self.oom_event_index is None else {"event_index": self.oom_event_index,
                                                               "message": self.oom_message},
            "fragmentation": self.fragmentation(),
            "allocator_settings": self.sim.config.source,
            "memory_stats": stats,
            "warnings": self.warnings,
        }


def replay(events: list[AllocEvent], config: AllocatorConfig | None = None, *, capacity_bytes: int | None = None,
           device_total_bytes: int | None = None, record_trace: bool = False) -> ReplayResult:
    sim = CachingAllocatorSim(config, capacity_bytes=capacity_bytes, device_total_bytes=device_total_bytes,
                              record_trace=record_trace)
    live = {}
    warnings: list[str] = []
    peak_allocated = reserved_at_peak = 0
    for index, event in enumerate(events):
        if event.action == "alloc":
            try:
                block = sim.malloc(event.size, event.stream)
            except SimulatedOOM as oom:
                return ReplayResult(sim, len(events), index, sim.stats["allocated_bytes"][0].peak,
                                    sim.stats["reserved_bytes"][0].peak, reserved_at_peak, index, str(oom), warnings)
            if event.addr in live and len(warnings) < 10:
                warnings.append(f"event {index}: address {event.addr:#x} allocated twice without a free")
            live[event.addr] = block
            allocated = sim.stats["allocated_bytes"][0].current
            if allocated > peak_allocated:
                peak_allocated, reserved_at_peak = allocated, sim.stats["reserved_bytes"][0].current
        else:
            block = live.pop(event.addr, None)
            if block is None:
                # Freed before the trace began (a ring buffer that wrapped, or history started late).
                if len(warnings) < 10:
                    warnings.append(f"event {index}: free of {event.addr:#x}, never allocated in this trace; ignored")
                continue
            sim.free(block)
    return ReplayResult(sim, len(events), len(events), sim.stats["allocated_bytes"][0].peak,
                        sim.stats["reserved_bytes"][0].peak, reserved_at_peak, warnings=warnings)


BISECTION_PRECISION = 256


def required_reserved_bytes(events: list[AllocEvent], config: AllocatorConfig | None = None, *,
                            smallest_card: bool = False, runs_within: int | None = None) -> tuple[int, int]:
    """(peak allocated, peak reserved) that a card must hold for these allocations.

    By default the peak reserved on a card without limit, what `max_memory_reserved()` shows on
    a large card. Generation grows its KV cache by repeated concatenation, and each freed
    block stays cached, too small for the next request: that figure then runs away with the
    number of steps or prefill chunks, while a card that runs out frees its cached blocks and
    retries before it raises. `smallest_card` answers instead the smallest capacity that
    replays without an out-of-memory error, found by bisection to 0.4 % of the allocated peak,
    below `runs_within` (a capacity known to run) when given, else below the unlimited peak."""
    if smallest_card and runs_within is not None:
        peak = low = peak_allocated_bytes(events)
        high = max(runs_within, low)
    else:
        free = replay(events, config)
        peak = low = free.peak_allocated_bytes
        high = free.peak_reserved_bytes
        if not smallest_card:
            return peak, high

    def runs(capacity: int) -> bool:
        return runs_on_card(events, capacity, config) is not None

    # The unlimited figure can be many times the allocated peak: gallop up from it first.
    step = max(low // 32, 1)
    while low + step < high:
        if runs(low + step):
            high = low + step
            break
        low, step = low + step, step * 2
    while high - low > low // BISECTION_PRECISION:
        mid = (low + high) // 2
        if runs(mid):
            high = mid
        else:
            low = mid
    return peak, high


def peak_allocated_bytes(events: list[AllocEvent]) -> int:
    """The largest sum of live allocations, without replaying through the allocator."""
    sizes: dict[int, int] = {}
    current = peak = 0
    for event in events:
        if event.action == "alloc":
            sizes[event.addr] = event.size
            current += event.size
            peak = max(peak, current)
        else:
            current -= sizes.pop(event.addr, 0)
    return peak


def runs_on_card(events: list[AllocEvent], capacity_bytes: int, config: AllocatorConfig | None = None) -> int | None:
    """Peak reserved bytes when these allocations replay on a card where cudaMalloc can get
    `capacity_bytes`, or None if they run out of memory there."""
    result = replay(events, config, capacity_bytes=capacity_bytes)
    return result.peak_reserved_bytes if result.oom_event_index is None else None
