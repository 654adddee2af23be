"""The fast card replays (`llamem.allocator.lean`) answer exactly what the full simulator answers.

Reference: `replay` through `CachingAllocatorSim` with its statistics (peak reserved, or an
out-of-memory error), on small random streams of allocations and frees, for every allocator
setting the simulator knows and for cards of many capacities, asked in any order of one
`CardReplays` (so that replays resume from each other's saved states)."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llamem import build_workload, load_model
from llamem.allocator.config import SIZE_MAX, AllocatorConfig, parse_alloc_conf
from llamem.allocator.lean import CardReplays, SimulatedReplays, card_peak, supported
from llamem.allocator.replay import (
    AllocEvent,
    SmallestCardSearch,
    peak_allocated_bytes,
    replay,
    runs_on_card,
)
from llamem.analytic.schedule import schedule
from llamem.units import MiB

CONFIGS = {
    "default": AllocatorConfig(),
    "max_split": parse_alloc_conf("max_split_size_mb:24"),
    "max_split_rounding": parse_alloc_conf("max_split_size_mb:32,max_non_split_rounding_mb:40"),
    "roundup": parse_alloc_conf("roundup_power2_divisions:4"),
    "roundup_per_bucket": parse_alloc_conf("roundup_power2_divisions:[1:8,2:4,>:2]"),
    "large_segment": parse_alloc_conf("large_segment_size_mb:4"),
    "no_large_segment": parse_alloc_conf("large_segment_size_mb:0"),
    "gc_without_fraction": parse_alloc_conf("garbage_collection_threshold:0.5"),
    "expandable": parse_alloc_conf("expandable_segments:True"),
    "fraction_gc": AllocatorConfig(per_process_memory_fraction=0.8, garbage_collection_threshold=0.5),
}
SIZES = st.one_of(st.integers(0, 4096), st.integers(500_000, 3 * MiB), st.integers(3 * MiB, 48 * MiB))


@st.composite
def event_streams(draw, max_events: int = 60):
    """Allocations (sizes around the pool and segment boundaries, two streams) and frees of live ones."""
    events, live, address = [], [], 0
    for _ in range(draw(st.integers(1, max_events))):
        if live and draw(st.booleans()):
            events.append(AllocEvent("free", live.pop(draw(st.integers(0, len(live) - 1))), 0))
        else:
            address += 1
            events.append(AllocEvent("alloc", address, draw(SIZES), draw(st.sampled_from([0, 0, 1]))))
            live.append(address)
    if draw(st.booleans()):
        events.append(AllocEvent("free", 10**6, 0))  # never allocated: ignored by every replay
    return events


def reference_peak(events, capacity, config) -> int | None:
    result = replay(events, config, capacity_bytes=capacity)
    return result.peak_reserved_bytes if result.completes else None


def capacities(events, unlimited: int, draw) -> list[int]:
    """Cards from below the allocated peak to above the unlimited peak, in a drawn order."""
    allocated = peak_allocated_bytes(events)
    grid = {allocated + (unlimited - allocated) * k // 6 for k in range(7)}
    grid |= {max(allocated - 2 * MiB, 0), unlimited - 1, unlimited + 2 * MiB}
    return draw(st.permutations(sorted(grid)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=event_streams(), name=st.sampled_from(sorted(CONFIGS)), data=st.data())
def test_fast_replays_answer_as_the_simulator(events, name, data):
    config = CONFIGS[name]
    unlimited = reference_peak(events, None, config)
    assert card_peak(events, None, config) == unlimited == runs_on_card(events, None, config)
    replays = CardReplays(events, peak_allocated_bytes(events), config)
    assert replays.unlimited_peak == unlimited
    for capacity in capacities(events, unlimited, data.draw):
        expected = reference_peak(events, capacity, config)
        assert card_peak(events, capacity, config) == expected, capacity
        assert replays.peak_on(capacity) == expected, capacity


class ReferenceSearch(SmallestCardSearch):
    replays = SimulatedReplays


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=event_streams(max_events=80), pause=st.floats(0.9, 1.2))
def test_search_finds_the_reference_searchs_card(events, pause):
    fast, reference = SmallestCardSearch(events), ReferenceSearch(events)
    # Paused (its saved states dropped) and resumed, as the device figure's probes are.
    fast.settle_within(int(peak_allocated_bytes(events) * pause))
    fast.finish()
    reference.finish()
    assert (fast.allocated, fast.high, fast.low) == (reference.allocated, reference.high, reference.low)


def test_every_card_of_a_training_schedule_brute_force():
    """A real schedule, every card from the allocated peak to the unlimited one in 1/128 steps."""
    events = schedule(load_model("debug"), build_workload(task="train", batch=2, seq=256, precision="bf16-mixed",
                                                          optimizer="adamw"))
    allocated = peak_allocated_bytes(events)
    replays, reference = CardReplays(events, allocated), SimulatedReplays(events)
    assert replays.unlimited_peak == reference.unlimited_peak
    step = max(allocated // 128, 1)
    for capacity in range(allocated - step, replays.unlimited_peak + step, step):
        assert replays.peak_on(capacity) == reference.peak_on(capacity), capacity
    search, slow = SmallestCardSearch(events), ReferenceSearch(events)
    search.finish()
    slow.finish()
    assert (search.allocated, search.high) == (slow.allocated, slow.high)


def test_growing_cache_resumes_from_saved_states():
    """A cache that grows and frees: the unlimited card keeps everything, a real card retries."""
    events, old = [], None
    for step in range(40):
        events.append(AllocEvent("alloc", step, (64 + 8 * step) * MiB))
        if old is not None:
            events.append(AllocEvent("free", old, 0))
        old = step
    replays = CardReplays(events, peak_allocated_bytes(events))
    assert replays.checkpoints  # from the first cudaMalloc above the allocated peak on
    for capacity in (700 * MiB, 900 * MiB, 800 * MiB, 2000 * MiB, 750 * MiB):
        assert replays.peak_on(capacity) == reference_peak(events, capacity, None)
    # A card between a replay's peak and its smallest refused cudaMalloc makes its decisions: no replay.
    lowest, _beyond, answer = replays.known[0]
    replayed = len(replays.known)
    assert replays.peak_on(lowest) == answer == reference_peak(events, lowest, None)
    assert len(replays.known) == replayed


def test_unsupported_settings_and_huge_requests_fall_back_to_the_simulator():
    assert supported(None) and supported(CONFIGS["max_split"]) and supported(CONFIGS["gc_without_fraction"])
    assert not any(supported(CONFIGS[name]) for name in ("expandable", "fraction_gc", "no_large_segment"))
    assert not supported(AllocatorConfig(max_split_size_bytes=MiB))
    # Beyond 2**64 bytes: no card, not even an unlimited one, serves it.
    huge = [AllocEvent("alloc", 1, SIZE_MAX)]
    assert card_peak(huge, None, None) is None == reference_peak(huge, None, None)
    # Segment addresses past 2**64: the simulator, not the fast path, replays it.
    big = [AllocEvent("alloc", 1, 2**63), AllocEvent("alloc", 2, 2**62)]
    assert card_peak(big, None, None) == reference_peak(big, None, None) == 2**63 + 2**62
    assert CardReplays(big).peak_on(2**63 + 2**61) is None


def test_the_smallest_card_found_runs_when_nothing_below_the_unlimited_peak_does():
    """A far bound (unlimited peak over twice the allocated one) is lowered by one step before the search
    gallops; when no card below it runs, that lowered bound is tried too: a 0-byte request takes a whole 2 MiB
    segment, and a card one byte smaller runs out."""
    from llamem.allocator.replay import AllocEvent, SmallestCardSearch, runs_on_card

    events = [AllocEvent("alloc", 1, 0), AllocEvent("free", 1, 0)]
    search = SmallestCardSearch(events)
    search.finish()
    assert search.high == 2 << 20
    assert runs_on_card(events, search.high) == 2 << 20 and runs_on_card(events, search.high - 1) is None
