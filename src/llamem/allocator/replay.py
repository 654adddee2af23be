"""Replay an allocation trace through the simulator: peak reserved, fragmentation, the OOM.

Reading the input lives in trace_input.py (pickle, JSON or a llamem trace, checked entry by
entry) and window.py (a snapshot whose trace starts late: the state at its first entry,
rebuilt from the segments; the capacity at a final out-of-memory error); restore.py puts
that state into the simulator. The readers are re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from llamem.allocator.config import AllocatorConfig
from llamem.allocator.lean import CardReplays, SimulatedReplays, card_peak
from llamem.allocator.restore import resolve_start, restore_start
from llamem.allocator.simulator import Block, CachingAllocatorSim, SimulatedOOM
from llamem.allocator.trace_input import AllocEvent, TraceFormatError
from llamem.allocator.window import LoadedTrace, StartState, load_trace, trace_from_data
from llamem.errors import LlamemError

MAX_EVENT_WARNINGS = 10

__all__ = ["AllocEvent", "LoadedTrace", "ReplayResult", "TraceFormatError", "empty_cache_comparison",
           "events_from_data", "load_events", "load_trace", "peak_allocated_bytes", "replay", "replay_trace",
           "runs_on_card", "smallest_card", "trace_from_data"]


def load_events(path: str | Path) -> list[AllocEvent]:
    """The allocations and frees of a file. Without the memory live before its first entry:
    `load_trace` and `replay_trace` keep that too."""
    return load_trace(path).events


def events_from_data(data, label: str = "trace") -> list[AllocEvent]:
    return trace_from_data(data, label).events


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
    oom_entry_index: int | None = None
    """The device-trace entry of the allocation that ran out (None for events built in code)."""
    start: StartState | None = None
    """The memory put in before the first event (a trace that starts late)."""
    capacity_bytes: int | None = None
    capacity_inferred: bool = False
    empty_cache_every: int = 0
    """torch.cuda.empty_cache() ran before every allocation that followed this many (0: never)."""
    num_empty_cache_calls: int = 0

    @property
    def completes(self) -> bool:
        return self.oom_event_index is None

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
                                                               "entry_index": self.oom_entry_index,
                                                               "message": self.oom_message},
            "capacity_bytes": self.capacity_bytes,
            "capacity_inferred": self.capacity_inferred,
            "start_state": None if self.start is None else self.start.to_dict(),
            "fragmentation": self.fragmentation(),
            "allocator_settings": self.sim.config.source,
            "memory_stats": stats,
            "warnings": self.warnings,
        }


def replay(events: list[AllocEvent], config: AllocatorConfig | None = None, *, capacity_bytes: int | None = None,
           device_total_bytes: int | None = None, record_trace: bool = False,
           start: StartState | None = None, empty_cache_every: int = 0) -> ReplayResult:
    """Replay `events`; with `start`, the memory live before the first one is put in first. With
    `empty_cache_every` N > 0, `torch.cuda.empty_cache()` runs before allocation N+1, 2N+1, ...:
    after every N allocations and the frees that follow them, as a training loop calling it
    between steps would."""
    if empty_cache_every < 0:
        raise LlamemError(f"empty_cache_every must be 0 (never) or a number of allocations, got {empty_cache_every}")
    sim = CachingAllocatorSim(config, capacity_bytes=capacity_bytes, device_total_bytes=device_total_bytes,
                              record_trace=record_trace)
    warnings: list[str] = []
    result = ReplayResult(sim, len(events), 0, 0, 0, 0, warnings=warnings, start=start,
                          empty_cache_every=empty_cache_every)
    live: dict[int, Block] = {}
    if start is not None:
        try:
            live = restore_start(sim, start, warnings)
        except SimulatedOOM as oom:
            warnings.append("out of memory before the first event, while allocating the blocks live then")
            return _finish(result, 0, 0, oom)
    index, oom, result.reserved_at_allocated_peak_bytes = _run(sim, events, live, warnings, result)
    return _finish(result, index, events[index].entry if oom is not None else None, oom)


def _run(sim: CachingAllocatorSim, events: list[AllocEvent], live: dict[int, Block], warnings: list[str],
         result: ReplayResult) -> tuple[int, SimulatedOOM | None, int]:
    """(events replayed, or the index of the one that ran out; the error; reserved at the allocated peak)."""
    allocated_stat, reserved_stat = sim.stats["allocated_bytes"][0], sim.stats["reserved_bytes"][0]
    peak_allocated, reserved_at_peak = allocated_stat.current, reserved_stat.current
    every, num_allocs = result.empty_cache_every, 0
    for index, event in enumerate(events):
        if event.action == "alloc":
            if every and num_allocs and num_allocs % every == 0:
                sim.empty_cache()
                result.num_empty_cache_calls += 1
            num_allocs += 1
            try:
                block = sim.malloc(event.size, event.stream)
            except SimulatedOOM as oom:
                return index, oom, reserved_at_peak
            if event.addr in live and len(warnings) < MAX_EVENT_WARNINGS:
                warnings.append(f"event {index}: address {event.addr:#x} allocated twice without a free")
            live[event.addr] = block
            if allocated_stat.current > peak_allocated:
                peak_allocated, reserved_at_peak = allocated_stat.current, reserved_stat.current
        else:
            block = live.pop(event.addr, None)
            if block is None:
                # Freed before the trace began, and no snapshot segments told of it.
                if len(warnings) < MAX_EVENT_WARNINGS:
                    warnings.append(f"event {index}: free of {event.addr:#x}, never allocated in this trace; ignored")
                continue
            sim.free(block)
    return len(events), None, reserved_at_peak


def _finish(result: ReplayResult, index: int, entry: int | None, oom: SimulatedOOM | None) -> ReplayResult:
    stats = result.sim.stats
    result.events_replayed = index
    result.peak_allocated_bytes = stats["allocated_bytes"][0].peak
    result.peak_reserved_bytes = stats["reserved_bytes"][0].peak
    if oom is not None:
        result.oom_event_index, result.oom_entry_index, result.oom_message = index, entry, str(oom)
    return result


def replay_trace(trace: LoadedTrace, config: AllocatorConfig | None = None, *, capacity_bytes: int | None = None,
                 device_total_bytes: int | None = None, record_trace: bool = False,
                 empty_cache_every: int = 0) -> ReplayResult:
    """Replay a loaded file with what it tells beyond its events: the memory live before its first
    entry, and, when it ends with an out-of-memory error and no capacity is given, the capacity
    at that error (then the replay should run out at that entry too). `result.start` is that
    memory with every block size settled: replay other settings from it (advice)."""
    inferred = capacity_bytes is None and trace.oom_capacity_bytes is not None
    capacity = trace.oom_capacity_bytes if inferred else capacity_bytes
    events = trace.replay_events(with_failed_alloc=capacity is not None)
    start = resolve_start(trace.start, config) if trace.start is not None else None
    result = replay(events, config, capacity_bytes=capacity, device_total_bytes=device_total_bytes,
                    record_trace=record_trace, start=start, empty_cache_every=empty_cache_every)
    notes = list(trace.notes)
    if trace.failed_alloc is not None and (inferred or capacity is None):
        notes.append(trace.capacity_note)
    if trace.failed_alloc is not None and capacity is not None:
        notes.extend(_oom_agreement(trace.failed_alloc.entry, result))
    result.warnings[:0] = notes
    result.capacity_bytes, result.capacity_inferred = capacity, inferred
    return result


def empty_cache_comparison(without: ReplayResult, emptied: ReplayResult) -> dict:
    """What emptying the cache changes: peak reserved memory, and the segments it allocates again.
    Every segment returned to the driver must be cudaMalloc'ed again when memory is next needed;
    each call synchronises the device, so `num_device_alloc` is the time emptying the cache costs."""
    def figures(result: ReplayResult) -> dict:
        sim = result.sim
        return {"peak_reserved_bytes": result.peak_reserved_bytes, "peak_allocated_bytes": result.peak_allocated_bytes,
                "num_device_alloc": sim.num_device_alloc, "num_device_free": sim.num_device_free,
                "oom_event_index": result.oom_event_index}

    return {"every_allocations": emptied.empty_cache_every, "num_calls": emptied.num_empty_cache_calls,
            "with": figures(emptied), "without": figures(without)}


def _oom_agreement(entry: int, result: ReplayResult) -> list[str]:
    if result.oom_entry_index == entry:
        return []
    if result.completes:
        return [f"torch ran out of memory at entry {entry}; the simulation does not, with this capacity"]
    return [f"torch ran out of memory at entry {entry}; the simulation runs out earlier, at entry "
            f"{result.oom_entry_index}"]


SEARCH_PRECISION = 128
"""The smallest card is found to 1/128 of the allocated peak (0.8 %): finer than the synthetic
schedules' own agreement with traces, and two replays fewer per search than 1/512."""


def smallest_card(events) -> tuple[int, int]:
    """(peak allocated, the smallest capacity on which the events replay without an out-of-memory
    error), to 1/128 of the allocated peak (`SmallestCardSearch`, run to the end)."""
    search = SmallestCardSearch(events)
    search.finish()
    return search.allocated, search.high


class SmallestCardSearch:
    """The smallest-card search, one replay at a time. On a card without limit the allocator never
    has to free its cache, so the unlimited replay's peak reserved always works; often nothing
    smaller does (a freed block left in a split segment is too small for a later request, which
    then needs a new segment however much is cached), and one replay just below it says so.
    Otherwise: a search between the allocated peak and that bound, galloping up first (steps of the
    precision, doubling) when the bound is more than twice the peak (a growing KV cache leaves many
    cached blocks behind on a card without limit, while a card that runs out frees them and retries).

    The replays and their order depend on the events only, so stopping early (`settle_within`) and
    resuming later reach the same answer as running through: `high` is always the smallest
    capacity seen to work, an upper bound on the answer, and is the answer when `done`. Each card
    is answered by `lean.CardReplays`: resumed from a saved state of the unlimited replay, or not
    replayed at all where an earlier replay already decides it, with the same answer either way."""

    replays = CardReplays
    """What answers each card (`lean.SimulatedReplays`: the same answers from whole simulator replays)."""

    def __init__(self, events: list[AllocEvent]):
        self.events = events
        self.allocated = peak_allocated_bytes(events)
        self.low = self.allocated
        self.high: int | None = None
        self.precision = max(self.allocated // SEARCH_PRECISION, 1)
        self.done = False
        self._replays: CardReplays | SimulatedReplays | None = None
        self._steps = self._search()

    def _runs(self, capacity: int) -> bool:
        return self._replays.peak_on(capacity) is not None

    def _search(self):
        # No card asked about is below the allocated peak: the replays resume from there (`CardReplays`).
        self._replays = self.replays(self.events, self.allocated)
        self.high = self._replays.unlimited_peak
        if self.high is None:  # a request beyond what any allocator can address (2**64 bytes)
            raise LlamemError("a single allocation of this workload exceeds 16 EiB, more than any allocator "
                              "addresses: check the model's sizes and the workload's batch and sequence")
        yield
        far = self.high > 2 * self.low
        if self.high - self.low <= self.precision or (not far and not self._runs(self.high - self.precision)):
            return
        self.high -= self.precision
        untested = self.high if far else None  # far: taken as running until something below it does
        yield
        step = self.precision
        while far and self.low + step < self.high:
            ran = self._runs(self.low + step)
            if ran:
                self.high = self.low + step
            else:
                self.low, step = self.low + step, step * 2
            yield
            if ran:
                break
        while self.high - self.low > self.precision:
            mid = (self.low + self.high) // 2
            if self._runs(mid):
                self.high = mid
            else:
                self.low = mid
            yield
        if self.high == untested and not self._runs(self.high):  # nothing below ran, nor does it: the bound does
            self.high += self.precision

    def step(self) -> None:
        if not self.done and next(self._steps, StopIteration) is StopIteration:
            # The answer is known: the events and the replays' saved states are no longer needed.
            self.done, self.events, self._replays = True, [], None

    def finish(self) -> None:
        while not self.done:
            self.step()

    def settle_within(self, bound: int) -> bool:
        """Whether the answer is at most `bound`, replaying only as far as needed to know."""
        if self.high is None:
            self.step()
        while not self.done and self.high > bound:
            self.step()
        if not self.done:  # paused, perhaps for good: keep the history, not the compiled events and states
            self._replays.release()
        return self.high <= bound


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


def runs_on_card(events: list[AllocEvent], capacity_bytes: int | None, config: AllocatorConfig | None = None) -> int | None:
    """Peak reserved bytes when these allocations replay on a card where cudaMalloc can get
    `capacity_bytes` (None: without limit), or None if they run out of memory there. The same
    decisions as `replay`, without its statistics (`llamem.allocator.lean`)."""
    return card_peak(events, capacity_bytes, config)
