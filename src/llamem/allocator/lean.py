"""Replays that only ask whether a schedule runs on a card, and how much it reserves: fast.

The smallest-card search (`replay.SmallestCardSearch`) replays one schedule a dozen times on
cards of different capacities. This module makes the simulator's decisions
(`simulator.CachingAllocatorSim`, whose rules it follows step for step) in less time:

- Work that does not depend on the card is done once per schedule (`compile_ops`): each
  allocation's rounded size, pool, segment size and best-fit bounds, and which allocation each
  free releases.
- The allocator's state is plain integers in dicts and lists, copied at C speed. A block is named
  by its address plus its pool's index in the low 9 bits (addresses are multiples of 512 bytes);
  a pool's free blocks are sorted keys `size << 64 | block`, ordered as c10's comparator orders
  (size, address) within a stream. Segments never touch (a 2 MiB gap), so the block after one is
  the one at its end address and the block before it the one whose end is its address.
- On a card of capacity C a replay makes the unlimited replay's decisions up to the first
  cudaMalloc that would take the reserved bytes above C (the capacity is read nowhere else), and
  on an unlimited card nothing is ever released, so the reserved bytes only grow. `CardReplays`
  keeps the unlimited replay's segment history and copies of its state: a card of at least its
  peak needs no replay, any other resumes from the copy nearest before its first refused cudaMalloc.
- A replay that reserved at most P bytes and was refused no cudaMalloc below R bytes makes the same
  decisions on every card from P to R - 1: a card in such a range is answered without a replay.

Covered: the native allocator without expandable segments or a per-process memory fraction (each
makes the run depend on the card from its first allocation). `supported` says which
configurations; `card_peak` replays the others through `simulator.LeanAllocatorSim`.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort

from llamem.allocator.config import SIZE_MAX, AllocatorConfig
from llamem.allocator.simulator import (MIN_BLOCK, SMALL_BUFFER, SMALL_SIZE, Block, LeanAllocatorSim, SimulatedOOM,
                                        check_simulated)

KEY_SHIFT = 64
BLOCK_MASK = (1 << KEY_SHIFT) - 1
"""Free-list keys are `size << 64 | block`: block names stay below 2**64 (`AddressSpaceExhausted`)."""
POOL_MASK = 511
"""A block name's low 9 bits: the index of its pool (small or large, per stream) in the free lists."""
FIRST_ADDRESS = 1 << 40
"""The simulator's first segment address (`CachingAllocatorSim.next_address`)."""
EAGER_CHECKPOINTS = 8
"""Copies of the unlimited replay's state saved as it runs, evenly from where the search's cards first differ."""
MAX_CHECKPOINTS = 16
"""Copies of the unlimited replay's state kept per schedule (each a few thousand blocks and a number per
allocation), until the search pauses or ends."""


class AddressSpaceExhausted(Exception):
    """Segment addresses passed 2**64 (exabyte requests): the caller replays through the simulator."""


def supported(config: AllocatorConfig | None) -> bool:
    """Whether this module replays `config` (else `simulator.LeanAllocatorSim` does)."""
    config = config or AllocatorConfig()
    check_simulated(config)
    # With max_split at most 2 MiB a small-pool block can be oversize and split (the small pool splits
    # whatever max_split says), which the oversize release does not expect; empty or unaligned large
    # segments would break the block names: all left to the simulator.
    segment = config.large_segment_bytes
    return (not config.expandable_segments and config.per_process_memory_fraction is None
            and config.max_split_size_bytes > SMALL_BUFFER and segment > 0 and segment % MIN_BLOCK == 0)


def compile_ops(events, config: AllocatorConfig | None = None) -> tuple[list, int] | None:
    """The events as replay operations and the number of pools (None: more streams than pool names).

    An allocation is (rounded size, pool, lowest key, key bound, smallest rest worth a split,
    segment size), one tuple per distinct size and pool: best fit is the first free key >=
    `size << 64`, taken when below the bound (c10's refusal of oversize blocks). Allocations are
    numbered in order; a free is the number of the allocation it releases (an int), and frees of
    addresses not live are dropped, as replays ignore them."""
    rules = LeanAllocatorSim(config)  # its size rules; nothing is replayed through it
    pools: dict[tuple[int, bool], int] = {}
    shapes: dict[tuple[int, int], tuple] = {}  # by requested size and stream
    live: dict[int, int] = {}
    ops: list = []
    allocations = 0
    for event in events:
        if event.action != "alloc":
            slot = live.pop(event.addr, None)
            if slot is not None:
                ops.append(slot)
            continue
        shape = shapes.get((event.size, event.stream))
        if shape is None:
            size = rules.round_size(event.size)
            pool = pools.setdefault((event.stream, size <= SMALL_SIZE), len(pools))
            if pool > POOL_MASK:
                return None
            shape = shapes[(event.size, event.stream)] = _shape(rules, size, pool)
        live[event.addr] = allocations
        allocations += 1
        ops.append(shape)
    return ops, len(pools)


def _shape(rules: LeanAllocatorSim, size: int, pool: int) -> tuple:
    """One allocation's operation (see `compile_ops`), from get_free_block and _should_split."""
    max_split = rules.max_split
    bound = max_split if size < max_split else size + rules.config.max_non_split_rounding_bytes
    if size <= SMALL_SIZE:
        split_rest = MIN_BLOCK
    else:
        split_rest = SMALL_SIZE + 1 if size < max_split else SIZE_MAX + 1
    return size, pool, size << KEY_SHIFT, bound << KEY_SHIFT, split_rest, rules.segment_size(size)


class Diverged(Exception):
    """A cudaMalloc above the watched capacity, raised before the operation changed anything."""

    def __init__(self, index: int):
        self.index = index
        super().__init__(index)


class LeanState:
    """The allocator between two operations: what `CachingAllocatorSim` keeps, less its statistics."""

    __slots__ = ("blocks", "capacity", "ends", "free_lists", "history", "max_split", "next_address", "peak",
                 "refused", "sizes", "total", "watch")

    def __init__(self, num_pools: int, capacity: int, max_split: int):
        self.sizes: dict[int, int] = {}
        """Every block's size, negative while allocated."""
        self.ends: dict[int, int] = {}
        """The block ending at each block end (the address of the block after it, if any)."""
        self.free_lists: list[list[int]] = [[] for _ in range(num_pools)]
        self.blocks: list[int] = []
        """The block of each allocation so far, by number."""
        self.total = self.peak = 0
        self.next_address = FIRST_ADDRESS
        self.capacity, self.max_split = capacity, max_split
        self.history: list[tuple[int, int]] | None = None
        """(operation, reserved bytes after it) at each cudaMalloc, when recorded."""
        self.watch = SIZE_MAX
        """A cudaMalloc taking the reserved bytes above this raises `Diverged`."""
        self.refused: float = float("inf")
        """The fewest reserved bytes a refused cudaMalloc of this replay asked for."""

    def copy(self, capacity: int) -> LeanState:
        other = LeanState(0, capacity, self.max_split)
        other.sizes, other.ends, other.blocks = self.sizes.copy(), self.ends.copy(), self.blocks.copy()
        other.free_lists = [free.copy() for free in self.free_lists]
        other.total, other.peak, other.next_address = self.total, self.peak, self.next_address
        return other


def run(state: LeanState, ops: list, start: int, stop: int) -> bool:
    """Replay ops[start:stop] (False: out of memory): CachingAllocatorSim.malloc and free, inlined."""
    sizes, ends, free_lists, blocks = state.sizes, state.ends, state.free_lists, state.blocks
    size_of, block_ending, append, find, cache = sizes.get, ends.get, blocks.append, bisect_left, insort
    new_block, mask, shift, pools, integer = _new_block, BLOCK_MASK, KEY_SHIFT, POOL_MASK, int
    for index in range(start, stop):
        op = ops[index]
        if op.__class__ is integer:  # a free: coalesce with free neighbours, then cache
            block = blocks[op]
            size = -sizes[block]
            free = free_lists[block & pools]
            before = block_ending(block)
            if before is not None:
                before_size = sizes[before]
                if before_size > 0:
                    del free[find(free, before_size << shift | before)], sizes[block], ends[block]
                    size += before_size
                    block = before
            end = block + size
            after = size_of(end)
            if after is not None and after > 0:
                del free[find(free, after << shift | end)], sizes[end], ends[end]
                size += after
            ends[block + size] = block
            sizes[block] = size
            cache(free, size << shift | block)
            continue
        size, pool, low, bound, split_rest, segment = op
        free = free_lists[pool]
        at = find(free, low)
        if at < len(free) and free[at] < bound:
            key = free.pop(at)
            found, block = key >> shift, key & mask
        else:
            block = new_block(state, index, op)
            if block is None:
                return False
            found = segment
        rest = found - size
        if rest >= split_rest:
            remainder = block + size
            sizes[remainder] = rest
            ends[remainder] = block
            ends[remainder + rest] = remainder
            cache(free, rest << shift | remainder)
            sizes[block] = -size
        else:
            sizes[block] = -found
        append(block)
    return True


def _new_block(state: LeanState, index: int, op: tuple) -> int | None:
    """No cached block fits: a new segment, else free oversize cached blocks (with max_split) and
    retry, else free every unsplit cached segment and retry (CachingAllocatorSim.malloc)."""
    size, pool, _low, _bound, _split_rest, segment = op
    block = _alloc_segment(state, pool, segment, index)
    if block is None and state.max_split != SIZE_MAX and _release_oversize(state, pool, size):
        block = _alloc_segment(state, pool, segment, index)
    if block is None:
        _release_cached(state)
        block = _alloc_segment(state, pool, segment, index)
    return block


def _alloc_segment(state: LeanState, pool: int, segment: int, index: int) -> int | None:
    """cudaMalloc of a new segment (_alloc_block), None when the card has no room."""
    total = state.total + segment
    if total > state.capacity:
        state.refused = min(state.refused, total)
        return None
    if total > state.watch:
        raise Diverged(index)
    address = state.next_address
    if address + segment + SMALL_BUFFER > BLOCK_MASK:
        raise AddressSpaceExhausted
    if state.history is not None:
        state.history.append((index, total))
    state.next_address = address + segment + SMALL_BUFFER  # segments never touch
    state.total = total
    state.peak = max(state.peak, total)
    block = address | pool
    state.ends[block + segment] = block
    return block


def _release(state: LeanState, free: list[int], at: int) -> int:
    """Return the cached block free[at], a whole segment, to the driver (_release_block)."""
    key = free.pop(at)
    size, block = key >> KEY_SHIFT, key & BLOCK_MASK
    state.total -= size
    del state.sizes[block], state.ends[block + size]
    return size


def _release_oversize(state: LeanState, pool: int, size: int) -> bool:
    """_release_available_cached_blocks: one cached oversize block big enough, or the largest
    oversize ones until enough is freed."""
    max_split = state.max_split
    key_size = max(size, max_split)
    free = state.free_lists[pool]
    at = bisect_left(free, key_size << KEY_SHIFT)
    if at < len(free):
        _release(state, free, at)
        return True
    released = 0
    at -= 1
    while at >= 0 and released < key_size and free[at] >> KEY_SHIFT >= max_split:
        released += _release(state, free, at)
        at -= 1
    return released >= key_size


def _release_cached(state: LeanState) -> None:
    """_release_cached_blocks: every cached block that is a whole segment goes back to the driver."""
    sizes, ends = state.sizes, state.ends
    for free in state.free_lists:
        kept = []
        for key in free:
            size, block = key >> KEY_SHIFT, key & BLOCK_MASK
            if block in ends or block + size in sizes:  # a neighbour before or after: a split segment
                kept.append(key)
            else:
                state.total -= size
                del sizes[block], ends[block + size]
        free[:] = kept


def simulated_peak(events, capacity_bytes: int | None, config: AllocatorConfig | None = None) -> int | None:
    """Peak reserved bytes replaying through `LeanAllocatorSim` (None: out of memory): every
    configuration the simulator knows, at the simulator's speed."""
    sim = LeanAllocatorSim(config, capacity_bytes=capacity_bytes)
    live: dict[int, Block] = {}
    peak = 0
    try:
        for event in events:
            if event.action == "alloc":
                live[event.addr] = sim.malloc(event.size, event.stream)
                if sim.total_allocated > peak:
                    peak = sim.total_allocated
            else:
                block = live.pop(event.addr, None)
                if block is not None:
                    sim.free(block)
    except SimulatedOOM:
        return None
    return peak


def card_peak(events, capacity_bytes: int | None, config: AllocatorConfig | None = None) -> int | None:
    """Peak reserved bytes on a card where cudaMalloc can get `capacity_bytes` (None: without
    limit), or None if the events run out of memory there: one replay, by the fastest exact means."""
    compiled = compile_ops(events, config) if supported(config) else None
    if compiled is None:
        return simulated_peak(events, capacity_bytes, config)
    ops, num_pools = compiled
    state = LeanState(num_pools, SIZE_MAX if capacity_bytes is None else capacity_bytes,
                      (config or AllocatorConfig()).max_split_size_bytes)
    try:
        return state.peak if run(state, ops, 0, len(ops)) else None
    except AddressSpaceExhausted:
        return simulated_peak(events, capacity_bytes, config)


class CardReplays:
    """One schedule replayed on cards of many capacities, each answer `card_peak`'s.

    The unlimited replay runs first and records each cudaMalloc (its operation and the reserved
    bytes after it), with copies of its state from the first cudaMalloc that a card of
    `floor_bytes` would refuse (the search asks about no smaller card) to the end. A card of
    capacity C first differs from it at its first cudaMalloc above C: the card's replay starts from
    the latest copy before that and leaves a copy there for later cards (up to MAX_CHECKPOINTS).

    A replay whose cudaMallocs reserved at most P bytes when granted and at least R when refused
    makes the same decisions on every card from P to R - 1 (the capacity is compared with nothing
    else): its answer holds for them all (`known`), and a card in such a range is not replayed."""

    def __init__(self, events, floor_bytes: int = 0, config: AllocatorConfig | None = None):
        self.events, self.config = events, config
        self.fast = supported(config)
        self.max_split = (config or AllocatorConfig()).max_split_size_bytes
        self._ops: list | None = None
        self.num_pools = 0
        self.checkpoints: dict[int, LeanState] = {}
        self.growth_ops: list[int] = []
        self.growth_totals: list[int] = []
        self.known: list[tuple[int, float, int | None]] = []
        """(lowest card, first card beyond, answer) of each replay so far."""
        self.unlimited_peak = self._unlimited(floor_bytes) if self.ops is not None else None
        if not self.fast:
            self.unlimited_peak = simulated_peak(events, None, config)

    @property
    def ops(self) -> list | None:
        """The compiled events (None: replayed through the simulator), compiled again after `release`."""
        if self._ops is None and self.fast:
            compiled = compile_ops(self.events, self.config)
            if compiled is None:
                self.fast = False
                return None
            self._ops, self.num_pools = compiled
        return self._ops

    def release(self) -> None:
        """Drop the compiled events and the saved states (a paused search keeps only the history)."""
        self._ops = None
        self.checkpoints = {}

    def _unlimited(self, floor_bytes: int) -> int | None:
        ops = self.ops
        state = LeanState(self.num_pools, SIZE_MAX, self.max_split)
        state.history, state.watch = [], floor_bytes
        try:
            try:
                ran = run(state, ops, 0, len(ops))
            except Diverged as diverged:
                ran = self._run_saving(state, diverged.index)
        except AddressSpaceExhausted:
            self.fast, self._ops, self.checkpoints = False, None, {}
            return None
        self.growth_ops = [index for index, _total in state.history]
        self.growth_totals = [total for _index, total in state.history]
        return state.peak if ran else None

    def _run_saving(self, state: LeanState, start: int) -> bool:
        """The rest of the unlimited replay from `start`, where cards of the floor first differ, with
        copies of its state at EAGER_CHECKPOINTS evenly spaced operations from there."""
        state.watch = SIZE_MAX
        ops, step = self.ops, -(-(len(self.ops) - start) // EAGER_CHECKPOINTS)
        for at in range(start, len(ops), max(step, 1)):
            self.checkpoints[at] = state.copy(SIZE_MAX)
            if not run(state, ops, at, min(at + step, len(ops))):
                return False
        return True

    def peak_on(self, capacity_bytes: int | None) -> int | None:
        """`card_peak(events, capacity_bytes, config)`, replaying only what differs from the unlimited card."""
        if capacity_bytes is None:
            return self.unlimited_peak
        if not self.fast or self.unlimited_peak is None:
            return card_peak(self.events, capacity_bytes, self.config)
        first = bisect_right(self.growth_totals, capacity_bytes)
        if first == len(self.growth_totals):
            return self.unlimited_peak  # every cudaMalloc of the unlimited replay fits: the same replay
        for lowest, beyond, answer in self.known:
            if lowest <= capacity_bytes < beyond:
                return answer
        return self._resume(self.growth_ops[first], capacity_bytes)

    def _resume(self, diverges: int, capacity_bytes: int) -> int | None:
        ops = self.ops
        start = max((index for index in self.checkpoints if index <= diverges), default=None)
        if start is None:
            start, state = 0, LeanState(self.num_pools, capacity_bytes, self.max_split)
        else:
            state = self.checkpoints[start].copy(capacity_bytes)
        try:
            run(state, ops, start, diverges)  # the unlimited replay's decisions: nothing refused
            if diverges > start and len(self.checkpoints) < MAX_CHECKPOINTS:
                self.checkpoints[diverges] = state.copy(SIZE_MAX)
            answer = state.peak if run(state, ops, diverges, len(ops)) else None
        except AddressSpaceExhausted:
            return card_peak(self.events, capacity_bytes, self.config)
        self.known.append((state.peak, state.refused, answer))
        return answer


class SimulatedReplays:
    """`CardReplays`' answers from whole replays through `simulator.LeanAllocatorSim`, one per card:
    the reference the fast path is checked against (tests, `benchmarks/replay_speed.py`)."""

    def __init__(self, events, floor_bytes: int = 0, config: AllocatorConfig | None = None):
        self.events, self.config = events, config
        self.unlimited_peak = simulated_peak(events, None, config)

    def peak_on(self, capacity_bytes: int | None) -> int | None:
        return simulated_peak(self.events, capacity_bytes, self.config)

    def release(self) -> None:
        """Nothing is kept between replays."""
